"""Whether CUDA tests can run here: the GPU suite (tests/gpu/conftest.py) and the bed's CUDA
tests (tests/multihost) ask the same question the same way."""

from __future__ import annotations

import functools
import os

# GPU_SUITE_DRY_RUN_ON_CPU=1: the tests run anyway, on CPU tensors, to check their harness on a
# machine without a GPU (it proves nothing about CUDA).
DRY_RUN = os.environ.get("GPU_SUITE_DRY_RUN_ON_CPU") == "1"


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    """Why CUDA tests cannot run here, or None when they can."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any failure to import torch means no CUDA tests
        return f"torch is not importable ({type(e).__name__}: {e})"
    try:
        if not torch.cuda.is_available():
            return (f"no CUDA device: torch.cuda.is_available() is False (torch "
                    f"{torch.__version__}, built for CUDA {torch.version.cuda})")
    except Exception as e:  # noqa: BLE001
        return f"torch.cuda.is_available() raised {type(e).__name__}: {e}"
    return None
