"""The GPU suite (``make test-gpu``): CUDA tensors through the NCCL path, on a machine with at
least one CUDA device. Everything here is skipped, with the reason, where
``torch.cuda.is_available()`` is False (CI, CPU-only machines).

``GPU_SUITE_DRY_RUN_ON_CPU=1`` runs the suite anyway, with the workers on CPU tensors and
nothing about the GPU path checked: a check of the harness and of the workers' arithmetic for
whoever edits them on a machine without a GPU (it proves nothing about CUDA).

The suite needs only torch with CUDA, pytest and this source tree built with ``python3 build.py``
(no PySpark, no Java, no pytest-timeout): every job runs under a subprocess timeout instead.
"""

from __future__ import annotations

import os

import pytest

from .availability import DRY_RUN, gpu_unavailable_reason

# Set by tests/gpu/device_run.sh: on the GPU machine a missing GPU is an error, not a skip.
REQUIRE_GPU = os.environ.get("GPU_SUITE_REQUIRE_GPU") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/gpu; skipped without one)")


def pytest_collection_modifyitems(config, items):
    # This hook sees every collected item of the session (not only this folder's).
    mine = [item for item in items
            if "/tests/gpu/" in str(item.fspath).replace("\\", "/")]
    if not mine:
        return
    reason = None if DRY_RUN else gpu_unavailable_reason()
    if reason and REQUIRE_GPU:
        raise pytest.UsageError(f"GPU suite: {reason} (and GPU_SUITE_REQUIRE_GPU=1)")
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"GPU suite: {reason}"))
