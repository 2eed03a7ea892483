"""The separate virtual environment ``benchmarks/estimator.py`` runs Petastorm in.

Petastorm 0.13.1 (its last release) cannot be imported next to spark_hvd's PyArrow >= 15 and
NumPy 2, so the benchmark runs Petastorm's side in its own venv, by default
``<repo>/.bench-petastorm/`` (git-ignored), with the newest versions it works with::

    petastorm==0.13.1  pyarrow==14.*  numpy<2  pyspark==4.0.5  pandas

(pip resolved them on 2026-11-22 to pyarrow 14.0.2, numpy 1.26.4, pyspark 4.0.5, pandas 3.0.6 on
Python 3.11; PySpark is only there because Petastorm requires it, the benchmark does not start
Spark in that venv). About 800 MB on disk, mostly PySpark; building it takes 1-3 minutes with
PyPI reachable. ``create`` builds it; ``find`` says whether a usable one exists.
"""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DIR = os.path.join(REPO, ".bench-petastorm")
REQUIREMENTS = ["petastorm==0.13.1", "pyarrow==14.*", "numpy<2", "pyspark==4.0.5", "pandas"]
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "petastorm_reader.py")

_PROBE = ("import petastorm, pyarrow, numpy; from petastorm import make_batch_reader; "
          "print(petastorm.__version__, pyarrow.__version__, numpy.__version__)")


def python_of(venv_dir: str) -> str:
    return os.path.join(venv_dir, "bin", "python")


def find(venv_dir: str = DEFAULT_DIR):
    """(python, versions) of a venv where Petastorm imports, or (None, why not)."""
    python = python_of(venv_dir)
    if not os.path.exists(python):
        return None, f"no venv at {venv_dir}"
    try:
        out = subprocess.run([python, "-W", "ignore", "-c", _PROBE], capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{python} does not run: {e}"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"Petastorm does not import in {venv_dir}: {last}"
    petastorm, pyarrow, numpy = out.stdout.split()
    return python, f"petastorm {petastorm}, pyarrow {pyarrow}, numpy {numpy}"


def create(venv_dir: str = DEFAULT_DIR, log=sys.stderr, timeout: float = 900):
    """Build the venv (``python -m venv`` + ``pip install``); returns ``find``'s answer.

    Uses the base interpreter of the running Python (3.11 here). Output of pip goes to
    ``<venv_dir>.log``."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    logfile = venv_dir.rstrip("/") + ".log"
    print(f"petastorm: building {venv_dir} ({' '.join(REQUIREMENTS)}); one-time, "
          f"1-3 minutes and ~800 MB (pip output in {logfile})", file=log, flush=True)
    steps = [[base, "-m", "venv", venv_dir],
             [python_of(venv_dir), "-m", "pip", "install", "--upgrade", "pip"],
             [python_of(venv_dir), "-m", "pip", "install", *REQUIREMENTS]]
    with open(logfile, "w") as out:
        for cmd in steps:
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            try:
                rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    timeout=timeout).returncode
            except (OSError, subprocess.TimeoutExpired) as e:
                return None, f"building the Petastorm venv failed ({' '.join(cmd[:3])}): {e}"
            if rc != 0:
                return None, (f"building the Petastorm venv failed: `{' '.join(cmd)}` exited "
                              f"{rc}; see {logfile}")
    return find(venv_dir)


def ensure(venv_dir: str = DEFAULT_DIR, build: bool = True, log=sys.stderr):
    """``find``, and ``create`` when that fails and ``build`` is true."""
    python, info = find(venv_dir)
    if python is not None or not build:
        return python, info
    print(f"petastorm: {info}", file=log, flush=True)
    return create(venv_dir, log=log)


if __name__ == "__main__":
    directory = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR
    python, info = ensure(directory)
    print(info if python else f"FAILED: {info}")
    sys.exit(0 if python else 1)
