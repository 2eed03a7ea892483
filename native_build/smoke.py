"""The smoke test a freshly linked core must pass before it is installed: two processes
(smoke_worker.py) that load it next to the system's C++ runtime, as torch and TensorFlow do,
init, allreduce and shut down over 127.0.0.1 (a fraction of a second). When that fails the build
fails, naming the compiler and what to do.

It loads the library the way a job does after `import torch` or `import tensorflow`: with the
system's C++ runtime already loaded and its locales initialised. A core that exports its
own copy of the runtime (or part of it) then shares some of its objects with that copy (the
locale facets' ids are STB_GNU_UNIQUE symbols, unified across the process whatever the load
order), and the two copies disagree: the peer list's ports read as 0 and ranks never connect."""

from __future__ import annotations

import contextlib
import os
import selectors
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .layout import API_SOURCES, EXPORTS_MAP
from .smoke_worker import SMOKE_MISSING_EXPORTS
from .toolchain import BuildError, compiler, compiler_version

SKIP_SMOKE_TEST_ENV = "SPARK_HVD_SKIP_SMOKE_TEST"
SMOKE_TIMEOUT_S = 40.0  # the whole test, processes included, before they are killed
_WORKER = Path(__file__).resolve().with_name("smoke_worker.py")


def run_smoke_test(library: Path, header: Path, asan: bool = False) -> float:
    """Runs two processes that load ``library`` next to the system's C++ runtime, as a framework
    does, and init, allreduce (two sizes) and shut down over 127.0.0.1 through its C API
    (``header``). Returns the seconds it took; raises BuildError naming the compiler and what to
    do when either process fails, crashes or hangs."""
    t0 = time.monotonic()
    env = dict(os.environ)
    if asan:  # an ASan library loads only into a process that starts with the ASan runtime
        asan_rt = subprocess.run(compiler() + ["-print-file-name=libasan.so"],
                                 capture_output=True, text=True).stdout.strip()
        env.update(LD_PRELOAD=asan_rt, ASAN_OPTIONS="detect_leaks=0")
    boot = ("import importlib.util as u, sys; s = u.spec_from_file_location('_shvd_smoke', "
            "sys.argv[1]); m = u.module_from_spec(s); s.loader.exec_module(m); "
            "sys.exit(m.main(*sys.argv[2:]))")
    procs, logs = [], []
    failures: list[str] = []
    try:
        for rank in range(2):
            log = tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-c", boot, str(_WORKER), str(rank), str(library), str(header)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env))
        deadline = t0 + SMOKE_TIMEOUT_S
        ports = [_read_line(p, deadline) for p in procs]
        # Without both ports the peer list stays empty: the other process then fails at once.
        peers = "".join(f"127.0.0.1 {port.split()[1]} smoke-host\n" for port in ports) \
            if all(port.startswith("PORT ") for port in ports) else ""
        for p in procs:
            with contextlib.suppress(OSError):
                p.stdin.write(peers)
            with contextlib.suppress(OSError):
                p.stdin.close()
        for rank, p in enumerate(procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                failures.append(f"rank {rank}: no result after {SMOKE_TIMEOUT_S:.0f} s (killed)")
                continue
            out = p.stdout.read()
            if p.returncode != 0:
                logs[rank].seek(0)
                first = "" if ports[rank].startswith("PORT ") else ports[rank]
                detail = "\n".join(x for x in (first, out.strip(), logs[rank].read().strip()[-1500:])
                                   if x)
                failures.append(f"rank {rank}: {_exit_status(p.returncode)}"
                                + ("\n" + detail).replace("\n", "\n    "))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if failures:
        missing_exports = any(p.returncode == SMOKE_MISSING_EXPORTS for p in procs)
        raise BuildError(_smoke_failure_message(library, failures, missing_exports))
    return time.monotonic() - t0


def _read_line(proc: subprocess.Popen, deadline: float) -> str:
    """The first line ``proc`` prints, or "" when it exits or the deadline passes first."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(max(0.0, deadline - time.monotonic())):
            return ""
    return proc.stdout.readline().strip()


def _exit_status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit status {code}"


def _smoke_failure_message(library: Path, failures: list[str], missing_exports: bool) -> str:
    cxx = compiler()
    ldflags = os.environ.get("LDFLAGS", "")
    if missing_exports:
        advice = (f"define every function that include/spark_hvd.h declares in "
                  f"{' or '.join(API_SOURCES)} (the only source compiled with default "
                  f"visibility; the others are -fvisibility=hidden), and name it shvd_* "
                  f"({EXPORTS_MAP} exports nothing else)")
    else:
        static_runtime = [f for f in shlex.split(ldflags) if f.startswith("-static")]
        advice = "build with the distribution's compiler: CXX=g++ python build.py"
        if static_runtime:
            advice = (f"drop {' '.join(static_runtime)} from LDFLAGS (the C++ runtime must be "
                      f"the one torch and TensorFlow load), or {advice}")
        advice += ". If a build with the distribution's g++ fails too, report this output"
    return (
        f"the smoke test of {library.name.split('.tmp')[0]} failed: two processes could not "
        f"init, allreduce and shut down over 127.0.0.1 with it, so it was not installed (every "
        f"multi-rank job would fail the same way).\n  " + "\n  ".join(failures) + "\n"
        f"Compiler: {compiler_version(tuple(cxx))} (CXX={' '.join(cxx)}"
        + (f", LDFLAGS={ldflags}" if ldflags else "") + ").\n"
        f"What to do: {advice}. Only for a cross build whose library cannot run here: "
        f"--no-smoke-test or {SKIP_SMOKE_TEST_ENV}=1.")
