"""The manylinux wheel build of tests/test_wheel.py, warmed up in the background.

Compiling the core, the framework libraries and the MPI plugins with zig's clang takes ~95 s of
both cores, which the suite used to spend in a row at its end. conftest.py starts that build
(`pip wheel`, as `make wheel` runs it) at the first test outside tests/multihost; in make test,
in the mostly_waiting tests' process beside the bed (scripts/run_tests.py), when the cores are
~75 % idle. It runs at the lowest CPU priority there is: in its own session, whose autogroup
gets nice 19, under SCHED_IDLE, so it only takes CPU time the tests leave idle (they wait a lot:
for JVMs, peers, timeouts). Its objects land in build/wheel/, where the build is incremental.

test_wheel.py's fixture then waits for it and runs the same build again in the foreground, at
normal priority: a relink and packaging of what is already compiled (a second or two), and the
build whose result the tests check. A background build that failed (its smoke test starved of
CPU, say) costs nothing but time: the foreground one redoes what is missing and reports its own
errors.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs in the child before pip: its own session (a new autogroup under CFS's autogroup
# scheduling, where nice alone would not count against other sessions' tests), that group's
# nice 19, and SCHED_IDLE, which the compilers it starts inherit. Each step is best effort.
_IDLE_THEN_EXEC = """
import os, sys
os.setsid()
try:
    with open("/proc/self/autogroup", "w") as f:
        f.write("19")
except OSError:
    pass
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    os.nice(19)
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""

_background: subprocess.Popen | None = None
_background_log: Path | None = None


def command(out_dir: Path) -> list[str]:
    """`pip wheel` of this repository into ``out_dir`` (the environment comes from ``env``)."""
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "-w", str(out_dir), str(REPO)]


def env() -> dict[str, str]:
    """The environment of `make wheel`'s build: zig's toolchain, no CXX override."""
    e = dict(os.environ, SPARK_HVD_TOOLCHAIN="zig")
    e.pop("CXX", None)
    return e


def start_in_background(work_dir: Path) -> None:
    """Starts the warm-up build (once per session), its wheel and log in ``work_dir``."""
    global _background, _background_log
    if _background is not None:
        return
    work_dir.mkdir(parents=True, exist_ok=True)
    _background_log = work_dir / "background-build.log"
    with open(_background_log, "w") as log:
        _background = subprocess.Popen(
            [sys.executable, "-c", _IDLE_THEN_EXEC] + command(work_dir / "warm-up")[1:],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env())


def wait_for_background(timeout: float) -> str:
    """Waits for the warm-up build, if one was started; returns what became of it (a line)."""
    if _background is None:
        return "no background build was started"
    try:
        rc = _background.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_background()
        return f"the background build was still running after {timeout:.0f} s: stopped"
    return f"the background build exited with {rc} (log: {_background_log})"


def stop_background() -> None:
    """Stops a warm-up build still running (the session ends early, or it took too long)."""
    if _background is not None and _background.poll() is None:
        try:
            os.killpg(_background.pid, 9)  # its session: pip and the compilers it started
        except ProcessLookupError:
            pass
        _background.wait()
