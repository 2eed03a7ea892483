"""``make test``'s runner: the whole suite, with the waiting-bound tests beside the bed's.

    python scripts/run_tests.py [pytest arguments...]

On a 2-core machine most of the suite is CPU-bound (training steps, JVMs, compiling). Two parts
of it mostly wait: the network-namespace bed (``tests/multihost``: links cut, hosts killed,
heartbeats timing out; about a third of the two cores) and the files marked ``mostly_waiting``
(peer timeouts, stall checks, signals, sleeps; a fifth of the two cores or less). So the suite
runs in two phases:

1. the bed, and in a second pytest process beside it, the ``mostly_waiting`` tests, which also
   warm up the wheel's build when phase 2 will run test_wheel.py (tests/wheel_build.py: ~95 s
   of both cores at SCHED_IDLE, so it takes only CPU time nothing else wants);
2. everything else, in one process.

Nothing else runs beside the bed, whose failure bounds are seconds of wall time.

Every argument goes to every pytest process; ``-m EXPR`` is combined with each process's own
selection, and ``--junitxml=PATH`` gives one file per process (``PATH`` for phase 2, ``-bed`` and
``-waiting`` inserted before the suffix for the others). The second process's output goes to a
log file, printed whole when the bed is done. The exit status is 0 when every process passed or
had nothing selected, else the first failing one's. ``SPARK_HVD_TESTS_SERIAL=1`` runs the suite
in one pytest process instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BED = "tests/multihost"
NO_TESTS_COLLECTED = 5   # pytest's exit status when the selection is empty
PYTEST = [sys.executable, "-m", "pytest"]


def split_args(args: list[str]) -> tuple[list[str], str | None, str | None]:
    """(the arguments without ``-m`` and ``--junitxml``, the ``-m`` expression, the path)."""
    rest, marks, junit = [], None, None
    it = iter(args)
    for a in it:
        if a == "-m":
            marks = next(it)
        elif a.startswith("-m") and not a.startswith("--"):
            marks = a[2:]
        elif a in ("--junitxml", "--junit-xml"):
            junit = next(it)
        elif a.startswith(("--junitxml=", "--junit-xml=")):
            junit = a.split("=", 1)[1]
        else:
            rest.append(a)
    return rest, marks, junit


def selection(marks: str | None, own: str | None) -> list[str]:
    expr = " and ".join(f"({m})" for m in (marks, own) if m)
    return ["-m", expr] if expr else []


def junit_file(junit: str | None, tag: str) -> list[str]:
    if not junit:
        return []
    if tag:
        p = Path(junit)
        junit = str(p.with_name(f"{p.stem}-{tag}{p.suffix}"))
    return [f"--junitxml={junit}"]


def runs_test_wheel(args: list[str], phase2_selection: list[str]) -> bool:
    """Whether phase 2 will run any of test_wheel.py (then phase 1 warms its build up)."""
    return subprocess.call(PYTEST + ["tests/test_wheel.py", "--collect-only", "-q"] + args
                           + phase2_selection, cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL) == 0


def main(argv: list[str]) -> int:
    if os.environ.get("SPARK_HVD_TESTS_SERIAL") == "1":
        return subprocess.call(PYTEST + ["tests"] + argv, cwd=REPO)
    args, marks, junit = split_args(argv)
    t0 = time.monotonic()
    codes: dict[str, int] = {}

    log = tempfile.NamedTemporaryFile(prefix="spark_hvd-tests-waiting-", suffix=".log",
                                      delete=False)
    print(f"== phase 1: {BED} (the network-namespace bed), and beside it the mostly_waiting "
          f"tests in a second pytest process (its output: {log.name}, printed after the bed's)",
          flush=True)
    waiting_env = dict(os.environ)
    if runs_test_wheel(args, selection(marks, "not mostly_waiting")):
        waiting_env["SPARK_HVD_TESTS_WARM_UP_WHEEL"] = "1"
    waiting = subprocess.Popen(
        PYTEST + ["tests", f"--ignore={BED}"] + args + selection(marks, "mostly_waiting")
        + junit_file(junit, "waiting"), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        env=waiting_env)
    try:
        codes["the bed"] = subprocess.call(PYTEST + [BED] + args + selection(marks, None)
                                           + junit_file(junit, "bed"), cwd=REPO)
        codes["the mostly_waiting tests"] = waiting.wait()
    finally:
        if waiting.poll() is None:   # interrupted: the second process goes too
            waiting.kill()
            waiting.wait()
        log.close()
        print(f"\n== the mostly_waiting tests (second pytest process, {log.name}):",
              flush=True)
        sys.stdout.write(Path(log.name).read_text(errors="replace"))
        sys.stdout.flush()
        os.unlink(log.name)

    print(f"\n== phase 2: the other tests ({time.monotonic() - t0:.0f} s so far)", flush=True)
    codes["the other tests"] = subprocess.call(
        PYTEST + ["tests", f"--ignore={BED}"] + args + selection(marks, "not mostly_waiting")
        + junit_file(junit, ""), cwd=REPO)

    print(f"\n== {'; '.join(f'{name}: exit {code}' for name, code in codes.items())}; "
          f"{time.monotonic() - t0:.0f} s in all", flush=True)
    if all(code == NO_TESTS_COLLECTED for code in codes.values()):
        return NO_TESTS_COLLECTED
    failed = [code for code in codes.values() if code not in (0, NO_TESTS_COLLECTED)]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
