#!/usr/bin/env python
"""Runs a Horovod test file, unchanged, against spark_hvd: each test as its own job.

    HOROVOD_SRC=~/horovod python tests/conformance/run.py test_torch.py -np 2

``HOROVOD_SRC`` (or ``--horovod-src``) is a Horovod source tree (the folder holding
``test/parallel``; use tag v0.28.1's test files). Each test of the file is collected in one
process, then run as ``spark-hvd-run -np N python _rank.py ... FILE::TEST``, with the
``horovod`` -> ``spark_hvd`` import alias of ``alias/`` on ``PYTHONPATH`` and Horovod's
test/utils and test/parallel beside it. A test that outlives ``--timeout`` is killed with
every process it started (each rank dumps its Python stacks into its output just before).

Files of ``test/single`` and ``test/integration`` (or any file with ``--single``) run as Horovod
runs them: each test in one plain ``python -m pytest`` process started in the file's folder
(``PYTHONPATH`` = alias, test/utils, test, the file's folder), no launcher: those tests start
jobs themselves (``horovod.run``, ``_run_elastic``).

A test PASSED only if every rank passed and SKIPPED if every rank skipped. It FAILED if a rank
failed (peers the launcher then stopped included); it CRASHED if a rank died on a signal or
without an outcome, or the job outlived the time limit. The last line is always
``N passed, N failed, N skipped, N crashed``; the exit code is 0 only when nothing failed or
crashed. Every test's output (the launcher's log, each rank's stdout/stderr and outcome) stays
in ``--out``; ``--json`` and ``--junit`` write the summary for triage.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from xml.etree import ElementTree

HERE = Path(__file__).resolve().parent
ALIAS_DIR = HERE / "alias"
RANK_SCRIPT = HERE / "_rank.py"
OUTCOMES = ("PASSED", "FAILED", "SKIPPED", "CRASHED")
# What the launcher logs for the first rank that ends the job (spark_hvd/launch/supervise.py).
_FIRST_EXIT = re.compile(r"rank (\d+)(?: on \S+)? (?:was killed by signal (\d+) \((\w+)\)|"
                         r"exited with code (\d+))")
# Seconds between SIGTERM and SIGKILL of a hung job; ranks dump their stacks this long before
# the time limit (a rank blocked in a wait may not run signal handlers, a watchdog thread does).
_TERM_SECONDS = 3.0
_DUMP_BEFORE_LIMIT = 3.0
_STALL_SHUTDOWN_FRACTION = 0.4  # of the per-test limit: the stall inspector's shutdown time


@dataclass
class TestResult:
    """The verdict on one test, with each rank's outcome and the first lines that explain it."""
    test_id: str
    outcome: str = "CRASHED"
    detail: str = ""
    seconds: float = 0.0
    ranks: dict = field(default_factory=dict)
    output_dir: str = ""

    def line(self) -> str:
        """Per-test line: ``OUTCOME id [detail] (seconds)``."""
        detail = f" [{self.detail}]" if self.detail else ""
        return f"{self.outcome:8s} {self.test_id}{detail} ({self.seconds:.1f} s)"


def horovod_paths(src: Path) -> tuple[Path, Path]:
    parallel, utils = src / "test" / "parallel", src / "test" / "utils"
    if not (parallel / "test_torch.py").is_file() or not (utils / "common.py").is_file():
        sys.exit(f"run.py: {src} is not a Horovod source tree (no test/parallel/test_torch.py "
                 f"or test/utils/common.py): set HOROVOD_SRC to a checkout of Horovod")
    return parallel, utils


def job_env(parallel: Path, utils: Path, tmpdir: str | None = None) -> dict[str, str]:
    """Environment of the collection run and of every job: the alias first on the path (for a
    single-process file, ``parallel`` is the file's folder and Horovod's test/ comes too)."""
    env = dict(os.environ)
    path = [str(ALIAS_DIR), str(parallel), str(utils)]
    if parallel.name != "parallel":
        path.append(str(utils.parent))
        env["CONFORMANCE_SINGLE"] = "1"
        # The jobs these tests start run `python ...`: this Python (the venv's), as in CI.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["PYTHONUNBUFFERED"] = "1"
    if tmpdir:
        env["TMPDIR"] = tmpdir  # TensorFlow's autograph leaves files behind in every job
    return env


def pytest_base(parallel: Path) -> list[str]:
    # Test ids relative to test/parallel, where the jobs run (as Horovod's CI does); no cache
    # written into Horovod's tree.
    return ["-p", "no:cacheprovider", "--rootdir", str(parallel), "-q", "-rN"]


def collect(test_file: Path, parallel: Path, utils: Path, keyword: str | None,
            out_dir: Path) -> tuple[list[str], str]:
    """Test ids of ``test_file`` (after ``-k``), or ([], error text) when collection fails."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", *pytest_base(parallel),
           str(test_file)]
    if keyword:
        cmd += ["-k", keyword]
    with tempfile.TemporaryDirectory(prefix="conformance-collect-") as tmp:
        proc = subprocess.run(cmd, cwd=parallel, env=job_env(parallel, utils, tmp),
                              capture_output=True, text=True, timeout=600)
    (out_dir / "collect.log").write_text(proc.stdout + proc.stderr)
    ids = [line.strip() for line in proc.stdout.splitlines() if "::" in line]
    if proc.returncode == 5:  # pytest's "nothing collected": -k matched nothing
        return [], ""
    if proc.returncode != 0 or not ids:
        return [], error_lines(proc.stdout + proc.stderr) or f"exit code {proc.returncode}"
    return ids, ""


def error_lines(text: str, limit: int = 3) -> str:
    """The lines that say what went wrong: pytest's ``E`` lines, else the last exception line."""
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    lines = [ln for ln in lines if ln]
    if not lines:
        lines = [ln.strip() for ln in text.splitlines()
                 if re.match(r"\s*([\w.]+(Error|Exception|Interrupt|Exit)\b|ERROR:)", ln)][-1:]
    return " | ".join(lines[:limit])[:600]


_THREAD_HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+.*\(most recent call first\):",
                            re.M)
_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)', re.M)
_FATAL = re.compile(r"^(Fatal Python error: .*|terminate called.*|.*(?:double free|free\(\)|"
                    r"corrupted|stack smashing).*)$", re.M)


def stack_hint(text: str) -> str:
    """Where a rank crashed or hung, from the last faulthandler dump in its stderr: the fatal
    message, the innermost spark_hvd frame and the test's frame of the thread running the test."""
    starts = [m.start() for m in _THREAD_HEADER.finditer(text)]
    if not starts:
        return ""
    # The last dump's threads: headers after the last gap between consecutive dumps.
    blocks = [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]
    fatal = _FATAL.findall(text)

    def short(frame):
        path, line, func = frame
        for root in ("/spark_hvd/", "/test/parallel/", "/test/utils/"):
            if root in path:
                path = root.strip("/").split("/")[-1] + "/" + path.split(root, 1)[1]
                break
        else:
            path = os.path.basename(path)
        return f"{path}:{line} {func}"

    def frames(block):
        return _FRAME.findall(block)

    test_blocks = [b for b in blocks if any("/test/parallel/" in f[0] for f in frames(b))]
    block = (test_blocks or blocks)[-1]
    found = frames(block)
    ours = [f for f in found if "/spark_hvd/" in f[0]][:1]
    test = [f for f in found if "/test/parallel/" in f[0]][:1]
    where = " <- ".join(short(f) for f in ours + test) or (short(found[0]) if found else "")
    return "; ".join(x for x in (fatal[-1].strip() if fatal else "", f"at {where}") if x)


def _descendants(pid: int) -> list[int]:
    try:
        import psutil
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except Exception:  # psutil missing or the process is gone
        return []


def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_job(proc: subprocess.Popen) -> None:
    """Stops a hung job: SIGTERM, then SIGKILL, to the launcher's group and every process under
    it (ranks run in sessions of their own)."""
    everyone = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    _signal_all(everyone, signal.SIGTERM)
    try:
        proc.wait(timeout=_TERM_SECONDS)
    except subprocess.TimeoutExpired:
        pass
    everyone = set(everyone) | set(_descendants(proc.pid))
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _signal_all(everyone, signal.SIGKILL)
    proc.wait()


def slug(test_id: str) -> str:
    return re.sub(r"[^\w.-]+", "_", test_id.split("::", 1)[-1])[:150]


def run_test(test_id: str, np_: int, timeout: float, launcher: list[str], parallel: Path,
             utils: Path, out_root: Path) -> TestResult:
    """Runs one test as one job (or, with no ``launcher``, one process) and judges it."""
    out = out_root / slug(test_id)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rank = [sys.executable, str(RANK_SCRIPT), str(out), *pytest_base(parallel), test_id]
    if launcher:
        cmd = [*launcher, "-np", str(np_), "--output-filename", str(out), *rank]
    else:
        cmd, np_ = [*rank], 1
    start = time.monotonic()
    timed_out = False
    with tempfile.TemporaryDirectory(prefix="conformance-") as tmp, \
            open(out / "launcher.log", "wb") as log:
        env = job_env(parallel, utils, tmp)
        env["CONFORMANCE_DUMP_STACKS_AFTER"] = str(max(1.0, timeout - _DUMP_BEFORE_LIMIT))
        # A rank whose assertion failed goes on to the test's tearDown (barrier, shutdown)
        # while the others wait in the test's next collective: the stall inspector ends that
        # with an error on every rank (Horovod's HOROVOD_STALL_SHUTDOWN_TIME_SECONDS), well
        # within the limit, so the test fails instead of hanging. Off by default, as in Horovod.
        stall = max(5.0, timeout * _STALL_SHUTDOWN_FRACTION)
        env.setdefault("SPARK_HVD_STALL_CHECK_TIME_SECONDS", str(int(stall // 2)))
        env.setdefault("SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS", str(int(stall)))
        proc = subprocess.Popen(cmd, cwd=parallel, env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_job(proc)
    result = judge(test_id, np_, out, proc.returncode, timed_out, timeout,
                   single=not launcher)
    result.seconds = time.monotonic() - start
    result.output_dir = str(out)
    return result


def _rank_text(out: Path, rank: int, stream: str) -> str:
    try:
        return (out / f"rank.{rank}" / stream).read_text(errors="replace")
    except OSError:
        pass
    if rank == 0 and stream == "stderr":  # a single process: its output is the log
        try:
            return (out / "launcher.log").read_text(errors="replace")
        except OSError:
            pass
    return ""


def judge(test_id: str, np_: int, out: Path, returncode: int, timed_out: bool,
          timeout: float, single: bool = False) -> TestResult:
    """The test's outcome from each rank's recorded outcome and the launcher's verdict (a
    single-process test has no launcher: its log holds the jobs it started itself)."""
    result = TestResult(test_id)
    for rank in range(np_):
        try:
            rec = json.loads((out / f"rank.{rank}.json").read_text())
        except (OSError, ValueError):
            rec = {"outcome": None, "longrepr": ""}
        outcome, text = rec.get("outcome"), rec.get("longrepr") or ""
        if outcome == "skipped":
            # pytest's skip longrepr is "(file, line, 'Skipped: reason')"
            m = re.search(r"Skipped:? ?(.*?)['\"]\)$", text)
            error = (m.group(1) or "(no reason given)") if m else text[-200:]
        elif outcome == "failed":
            error = error_lines(text)
        else:  # passed, or no outcome: what the rank's own output says
            stderr = _rank_text(out, rank, "stderr")
            error = stack_hint(stderr) if outcome is None or timed_out else ""
            if outcome is None:
                error = error or error_lines(stderr + _rank_text(out, rank, "stdout"))
        result.ranks[rank] = {"outcome": outcome, "phase": rec.get("phase"), "error": error}
    log = (out / "launcher.log").read_text(errors="replace")
    first = None if single else _FIRST_EXIT.search(log)
    outcomes = {r: v["outcome"] for r, v in result.ranks.items()}
    failed = [r for r, o in outcomes.items() if o == "failed"]
    missing = [r for r, o in outcomes.items() if o is None]

    def first_error(ranks):
        """The error texts of ``ranks`` (in that order), each said once."""
        said = {}
        for r in dict.fromkeys(ranks):
            said.setdefault(result.ranks[r]["error"], r)
        return " / ".join(f"rank {r}: {e}" for e, r in said.items() if e)

    if timed_out:
        result.outcome = "CRASHED"
        result.detail = (f"timeout {timeout:g} s; outcomes {outcomes}; "
                         + first_error(failed + missing + list(outcomes)))
    elif first and first.group(2):
        rank = int(first.group(1))
        result.outcome = "CRASHED"
        result.detail = (f"rank {rank} signal {first.group(3)}, outcome {outcomes[rank]}; "
                         + first_error([rank] + failed))
    elif first and int(first.group(1)) not in failed:
        rank = int(first.group(1))
        result.outcome = "CRASHED"
        result.detail = (f"rank {rank} exited with code {first.group(4)}, outcome "
                         f"{outcomes[rank]}; " + first_error([rank]))
    elif failed:
        result.outcome = "FAILED"
        stopped = f"; ranks {missing} stopped by the launcher" if missing else ""
        result.detail = first_error(failed) + stopped
    elif missing:
        result.outcome = "CRASHED"
        result.detail = f"ranks {missing} ended without an outcome (launcher exit {returncode})"
    elif set(outcomes.values()) == {"passed"}:
        result.outcome = "PASSED"
    elif set(outcomes.values()) == {"skipped"}:
        result.outcome = "SKIPPED"
        result.detail = first_error(list(outcomes))
    else:
        result.outcome = "FAILED"
        result.detail = f"ranks disagree: {outcomes}"
    return result


def summary_line(results) -> str:
    counts = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    return (f"{counts['PASSED']} passed, {counts['FAILED']} failed, {counts['SKIPPED']} skipped, "
            f"{counts['CRASHED']} crashed")


def write_junit(path: Path, name: str, results) -> None:
    suite = ElementTree.Element("testsuite", name=name, tests=str(len(results)))
    for r in results:
        case = ElementTree.SubElement(suite, "testcase", name=r.test_id, time=f"{r.seconds:.2f}")
        if r.outcome == "SKIPPED":
            ElementTree.SubElement(case, "skipped", message=r.detail)
        elif r.outcome == "FAILED":
            ElementTree.SubElement(case, "failure", message=r.detail)
        elif r.outcome == "CRASHED":
            ElementTree.SubElement(case, "error", message=r.detail)
        ElementTree.SubElement(case, "system-out").text = r.output_dir
    ElementTree.ElementTree(suite).write(path, encoding="unicode", xml_declaration=True)


def find_launcher() -> list[str]:
    """The venv's spark-hvd-run (beside this Python), else the module."""
    exe = Path(sys.executable).parent / "spark-hvd-run"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "spark_hvd.runner"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("test_file", help="a file of Horovod's test/parallel (test_torch.py, or a "
                   "path relative to HOROVOD_SRC or absolute)")
    p.add_argument("-np", "--num-proc", type=int, default=2, dest="np", help="ranks (default 2)")
    p.add_argument("--timeout", type=float, default=90.0,
                   help="seconds one test's job may run (default 90)")
    p.add_argument("-k", dest="keyword", help="pytest -k expression selecting tests")
    p.add_argument("--jobs", type=int, default=1, help="tests run at once (default 1)")
    p.add_argument("--horovod-src", default=os.environ.get("HOROVOD_SRC"),
                   help="Horovod source tree (default: $HOROVOD_SRC)")
    p.add_argument("--out", help="folder for every test's output (default: a new folder "
                   "under the temporary directory)")
    p.add_argument("--single", action="store_true",
                   help="run each test in one plain pytest process, without the launcher "
                   "(the default for files of test/single and test/integration)")
    p.add_argument("--json", help="write the results as JSON to this file")
    p.add_argument("--junit", help="write the results as JUnit XML to this file")
    args = p.parse_args(argv)
    if not args.horovod_src:
        p.error("set HOROVOD_SRC or --horovod-src to a Horovod source tree")
    return args


def resolve_test_file(name: str, src: Path, parallel: Path) -> Path:
    for candidate in (Path(name), src / name, parallel / name, src / "test" / "single" / name,
                      src / "test" / "integration" / name):
        if candidate.is_file():
            return candidate.resolve()
    sys.exit(f"run.py: no test file {name!r} in {parallel}")


def main(argv=None) -> int:
    args = parse_args(argv)
    src = Path(args.horovod_src).expanduser().resolve()
    parallel, utils = horovod_paths(src)
    test_file = resolve_test_file(args.test_file, src, parallel)
    single = args.single or test_file.parent.name in ("single", "integration")
    if single:
        parallel = test_file.parent  # tests run from the file's folder, as Horovod runs them
    out_root = Path(args.out or tempfile.mkdtemp(
        prefix=f"spark_hvd-conformance-{test_file.stem}.np{args.np}-")).resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    how = "one process per test" if single else f"{args.np} ranks"
    print(f"conformance: {test_file} on {how}, {args.timeout:g} s per test, "
          f"output in {out_root}", flush=True)

    ids, error = collect(test_file, parallel, utils, args.keyword, out_root)
    if error:
        # The whole file is one failure: usually an import the alias cannot satisfy.
        results = [TestResult(f"{test_file.name}::<collection>", "FAILED", error)]
        print(results[0].line())
    else:
        print(f"collected {len(ids)} tests", flush=True)
        results = run_all(ids, args, parallel, utils, out_root, single)
    line = summary_line(results)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"file": test_file.name, "np": args.np, "summary": line,
             "results": [asdict(r) for r in results]}, indent=1))
    if args.junit:
        write_junit(Path(args.junit), f"{test_file.name}.np{args.np}", results)
    print(line, flush=True)
    return 0 if all(r.outcome in ("PASSED", "SKIPPED") for r in results) else 1


def run_all(ids, args, parallel: Path, utils: Path, out_root: Path,
            single: bool = False) -> list[TestResult]:
    """Runs every test (``--jobs`` at once), printing each verdict as it comes; results in
    collection order."""
    launcher = [] if single else find_launcher()
    results: dict[str, TestResult] = {}
    lock = threading.Lock()
    width = len(str(len(ids)))

    def one(test_id):
        result = run_test(test_id, args.np, args.timeout, launcher, parallel, utils, out_root)
        with lock:
            results[test_id] = result
            print(f"[{len(results):{width}d}/{len(ids)}] {result.line()}", flush=True)

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for future in [pool.submit(one, test_id) for test_id in ids]:
            future.result()
    return [results[i] for i in ids]


if __name__ == "__main__":
    sys.exit(main())
