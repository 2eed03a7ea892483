#!/usr/bin/env python3
"""Runs the manylinux wheel where no compiler is, against the frameworks of a given environment.

    python scripts/wheel_smoke.py dist/spark_hvd-*.whl                      # this environment's
    python scripts/wheel_smoke.py dist/spark_hvd-*.whl --python /opt/tf216/bin/python
    python scripts/wheel_smoke.py dist/spark_hvd-*.whl --python ENV/bin/python --jobs torch

It makes a fresh venv with ``--python``'s interpreter (default: this one) that sees that
environment's packages (a .pth file after the venv's own site-packages: torch, TensorFlow, NumPy
... come from there, nothing is downloaded), shadows gcc, g++, cc, c++, clang, clang++ and zig
with failing stubs, installs the wheel alone (``pip install --no-index --no-deps
--only-binary=:all:``), checks that ``spark_hvd`` comes from the venv's site-packages, and runs
from outside the repository, at 2 ranks through the venv's ``spark-hvd-run``:

  numpy       an allreduce
  torch       a DistributedOptimizer job whose gradients go through the torch allocator built for
              that torch's minor (the job fails when there is none: no silent fallback)
  tensorflow  a tf.function allreduce through the compiled op (SparkHvdAllreduce, no
              tf.numpy_function, no fallback warning), eagerly too

``--jobs`` defaults to numpy and every framework that environment imports. Prints one line per
job with the framework's version and exits 1 when one fails. tests/test_wheel.py uses these
pieces; the README's "The wheel" names the environments it was run against.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

COMPILERS = ("gcc", "g++", "cc", "c++", "clang", "clang++", "zig")

JOBS = {
    "numpy": """
        import numpy as np
        import spark_hvd.numpy as hvd
        hvd.init()
        got = hvd.allreduce(np.full(4, hvd.rank() + 1.0), op=hvd.Sum)
        assert (got == 3.0).all(), got
        print("OK", hvd.rank(), "numpy", np.__version__)
    """,
    "torch": """
        import os
        import torch
        import spark_hvd.torch as hvd
        from spark_hvd.common._native import lib as core
        from spark_hvd.torch import shared_gradients
        hvd.init()
        # The allocator built for this torch's minor must be in the wheel, load, and serve the
        # gradients, which the core then reduces in place (no silent fallback to copies).
        lib = shared_gradients.library_path()
        assert os.path.exists(lib), (lib, shared_gradients.built_minors())
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 512)  # large enough to be reduced in place, not fused
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 256) * (hvd.rank() + 1)).pow(2).mean().backward()
            opt.step()
        w = hvd.allgather(model.weight.detach().reshape(1, -1))
        assert torch.equal(w[0], w[1]), "weights differ across ranks"
        inplace = core.shvd_shared_inplace_allreduces()
        assert inplace > 0, "no gradient was reduced in place"
        print("OK", hvd.rank(), "torch", torch.__version__, os.path.basename(lib),
              f"({inplace} in-place allreduces)")
    """,
    "tensorflow": """
        import warnings
        warnings.simplefilter("error")  # a fallback warning fails the job
        warnings.simplefilter("ignore", ResourceWarning)
        import tensorflow as tf
        import spark_hvd.tensorflow as hvd
        hvd.init()
        f = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum))
        kinds = {op.type for op in f.get_concrete_function(
            tf.TensorSpec([3], tf.float32)).graph.get_operations()}
        assert "SparkHvdAllreduce" in kinds and "PyFunc" not in kinds, kinds
        for _ in range(20):
            got = f(tf.fill([3], float(hvd.rank() + 1)))
        assert got.numpy().tolist() == [3.0, 3.0, 3.0], got
        g = tf.function(lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Average))
        a, b = g(tf.fill([1000], float(hvd.rank())), tf.ones([5]))
        assert float(a[0]) == 0.5 and float(b[0]) == 1.0, (a, b)
        print("OK", hvd.rank(), "tensorflow", tf.__version__)
    """,
}


def make_venv(wheel: Path, root: Path, python: str = sys.executable) -> dict:
    """The venv (see the module docstring) under ``root``: its python, spark-hvd-run, the
    environment the jobs run with, where they run, and its site-packages."""
    venv = root / "venv"
    made = subprocess.run([python, "-m", "venv", str(venv)], capture_output=True, text=True,
                          timeout=300)
    pip = None  # the venv's own pip
    if made.returncode != 0:
        # An interpreter without ensurepip (Debian's python3 without python3-venv): a venv
        # without pip, into which the given interpreter's pip installs (pip --python).
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True,
                       timeout=300)
        pip = [python, "-m", "pip", "--python", str(venv / "bin" / "python")]
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True,
                          check=True).stdout.strip()
    # Every site-packages folder `python` sees, those that its own .pth files add included.
    deps = subprocess.run([python, "-c", "import sys; print('\\n'.join(p for p in sys.path "
                           "if p.endswith('site-packages')))"], capture_output=True, text=True,
                          check=True).stdout.split()
    Path(site, "deps_of_the_given_environment.pth").write_text(
        "\n".join(p for p in deps if p != site) + "\n")
    stubs = root / "stubs"
    stubs.mkdir()
    for name in COMPILERS:
        stub = stubs / name
        stub.write_text(f"#!/bin/sh\necho 'no compiler here ({name})' >&2\nexit 1\n")
        stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "CXX", "CC", "SPARK_HVD_TOOLCHAIN")
           and not k.startswith(("SPARK_HVD_", "HOROVOD_"))}
    env.update(PATH=f"{stubs}:{venv / 'bin'}:{env.get('PATH', '')}", TF_CPP_MIN_LOG_LEVEL="3")
    install = subprocess.run([*(pip or [str(py), "-m", "pip"]), "install", "--no-index",
                              "--no-deps", "--only-binary=:all:", str(wheel)],
                             capture_output=True, text=True, env=env, timeout=600, cwd=root)
    if install.returncode != 0:
        raise RuntimeError(f"pip install failed:\n{install.stdout}{install.stderr}")
    where = subprocess.run([str(py), "-c", "import spark_hvd; print(spark_hvd.__file__)"],
                           capture_output=True, text=True, env=env, cwd=root, timeout=120)
    if not where.stdout.startswith(site):
        raise RuntimeError(f"spark_hvd does not come from {site}: {where.stdout}{where.stderr}")
    return {"py": py, "run": venv / "bin" / "spark-hvd-run", "env": env, "cwd": root,
            "site": site}


def run_job(venv: dict, script: str, np_: int = 2, timeout: float = 600) -> str:
    """Runs ``script`` at ``np_`` ranks through the venv's launcher (0: one plain process);
    its output, or RuntimeError with it."""
    path = Path(venv["cwd"]) / "job.py"
    path.write_text(textwrap.dedent(script))
    cmd = ([str(venv["run"]), "-np", str(np_), str(venv["py"]), str(path)] if np_
           else [str(venv["py"]), str(path)])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=venv["env"],
                          cwd=venv["cwd"], timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


def importable(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import importlib.util as u, sys; "
                           f"sys.exit(u.find_spec('{module}') is None)"],
                          capture_output=True).returncode == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", type=Path)
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter of the environment whose frameworks to use")
    ap.add_argument("--jobs", default=None, help=f"comma-separated of {', '.join(JOBS)}")
    args = ap.parse_args(argv)
    jobs = args.jobs.split(",") if args.jobs else \
        ["numpy"] + [j for j in ("torch", "tensorflow") if importable(args.python, j)]
    failed = 0
    with tempfile.TemporaryDirectory(prefix="spark_hvd-wheel-smoke-") as tmp:
        venv = make_venv(args.wheel.resolve(), Path(tmp), args.python)
        print(f"{args.wheel.name} installed in a venv of {args.python} (compilers shadowed)")
        for job in jobs:
            try:
                out = run_job(venv, JOBS[job])
            except RuntimeError as e:
                print(f"FAIL {job}: {e}")
                failed += 1
                continue
            lines = [ln.split("OK 0 ", 1)[1] for ln in out.splitlines() if "OK 0 " in ln]
            ok = out.count("OK") == 2 and lines
            print(f"{'PASS' if ok else 'FAIL'} {job}: {lines[0] if lines else out[-2000:]}")
            failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
