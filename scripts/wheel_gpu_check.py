#!/usr/bin/env python3
"""The manylinux wheel on a GPU machine (issue 32, "Done when"): the same wheel file, installed
into a venv that sees the machine's CUDA torch, passes tests/gpu.

    python3 scripts/wheel_gpu_check.py dist/spark_hvd-*.whl [pytest arguments...]

Makes the venv as scripts/wheel_smoke.py does (the wheel installed alone with pip
``--no-index --no-deps --only-binary=:all:``, compilers shadowed by failing stubs, the given
interpreter's packages, CUDA torch among them, visible through a .pth file), copies tests/ to a
folder outside the repository (so every job imports spark_hvd from the venv's site-packages,
never from the source tree), prints what ``spark-hvd-run --check-build`` says of the wheel's
binaries, and runs the GPU suite there with GPU_SUITE_REQUIRE_GPU=1 (a missing GPU is an error).
Exits with pytest's status. Python packages the machine lacks (Keras) may come through
PYTHONPATH, which the jobs keep.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import wheel_smoke  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv or not argv[0].endswith(".whl"):
        print(__doc__)
        return 2
    wheel, pytest_args = Path(argv[0]).resolve(), argv[1:]
    # The source tree never: spark_hvd must come from the wheel.
    extra_path = os.pathsep.join(
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() != REPO and not (Path(p) / "spark_hvd").exists())
    with tempfile.TemporaryDirectory(prefix="spark_hvd-wheel-gpu-") as tmp:
        root = Path(tmp)
        venv = wheel_smoke.make_venv(wheel, root)
        print(f"{wheel.name} installed in {venv['site']} (compilers shadowed)", flush=True)
        shutil.copytree(REPO / "tests", root / "tests",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        env = dict(venv["env"], PYTHONUNBUFFERED="1")
        if os.environ.get("GPU_SUITE_DRY_RUN_ON_CPU") == "1":  # the harness, on CPU tensors
            env["GPU_SUITE_DRY_RUN_ON_CPU"] = "1"
        else:
            env["GPU_SUITE_REQUIRE_GPU"] = "1"
        if extra_path:
            env["PYTHONPATH"] = extra_path
        check = subprocess.run([str(venv["run"]), "--check-build"], capture_output=True,
                               text=True, env=env, cwd=root, timeout=120)
        print(check.stdout + check.stderr, flush=True)
        where = subprocess.run([str(venv["py"]), "-c", "import spark_hvd.torch, spark_hvd; "
                                "print(spark_hvd.__file__)"], capture_output=True, text=True,
                               env=env, cwd=root, timeout=120)
        print(f"spark_hvd imported from: {where.stdout.strip()} {where.stderr[-2000:]}",
              flush=True)
        if not where.stdout.startswith(venv["site"]):
            print("FAIL: spark_hvd does not come from the venv's site-packages")
            return 1
        return subprocess.run([str(venv["py"]), "-m", "pytest", "tests/gpu", "-v", "-rs",
                               "-p", "no:cacheprovider", *pytest_args], env=env,
                              cwd=root).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
