"""The conformance runner (tests/conformance/run.py) and Horovod's own torch tests through it.

``test_runner_verdicts`` checks the runner itself on a small Horovod-shaped tree written here:
each verdict (pass, skip, failure on one rank, a rank's segfault, a hang, a module spark_hvd does
not have) must come out as the runner documents, through the real launcher.

``test_horovod_torch_suite`` runs Horovod's test/parallel/test_torch.py unchanged on 2 ranks and
checks issue 20's target: everything passes except GPU-only skips, the three tests that fail
on Horovod itself with torch >= 2.13 (they meet the Muon optimizer) and the Adasum test that
skips itself without MPI. It needs a Horovod source
tree in ``HOROVOD_SRC`` (nothing of Horovod's is in this repository) and is skipped without one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parent / "conformance" / "run.py"

# Fail on Horovod 0.28.1 itself with torch 2.13: they iterate over every torch optimizer and
# meet Muon, which takes 2-D parameters only.
TORCH_FAILING_ON_HOROVOD = {"test_broadcast_state", "test_broadcast_state_options",
                            "test_force_allreduce"}
# Skipped by the test itself unless Horovod runs over MPI (`if not hvd.mpi_enabled()`): Horovod
# built with Gloo only skips it as well, and spark_hvd has no MPI transport.
TORCH_SKIPPED_WITHOUT_MPI = {"test_delta_optimizer": "Adasum requires MPI"}


def run_runner(src, test_file, out_dir: Path, *args, timeout=600):
    """Runs the conformance runner; returns (its stdout, the parsed --json results)."""
    results = out_dir / "results.json"
    cmd = [sys.executable, str(RUNNER), test_file, "--horovod-src", str(src),
           "--out", str(out_dir), "--json", str(results), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return proc.stdout, json.loads(results.read_text())


FAKE_TESTS = '''
import os
import signal
import time
import unittest

from common import mpi_env_rank_and_size


class FakeTests(unittest.TestCase):
    def test_pass_with_alias(self):
        import horovod.torch as hvd
        import spark_hvd.torch
        assert hvd is spark_hvd.torch
        hvd.init()
        rank, size = mpi_env_rank_and_size()
        assert (hvd.rank(), hvd.size()) == (rank, size) == (rank, 2)
        assert hvd.allreduce(hvd_ones(), op=hvd.Sum).tolist() == [2.0]

    def test_skip(self):
        self.skipTest("skipped on purpose")

    def test_fail_on_rank_1(self):
        assert mpi_env_rank_and_size()[0] != 1, "rank 1 fails"

    def test_segfault_on_rank_1(self):
        if mpi_env_rank_and_size()[0] == 1:
            os.kill(os.getpid(), signal.SIGSEGV)

    def test_hang_on_rank_0(self):
        if mpi_env_rank_and_size()[0] == 0:
            time.sleep(600)

    def test_missing_module(self):
        import horovod.no_such_module  # noqa: F401


def hvd_ones():
    import torch
    return torch.ones(1)
'''


@pytest.mark.timeout(300)
def test_runner_verdicts(tmp_path):
    parallel = tmp_path / "test" / "parallel"
    utils = tmp_path / "test" / "utils"
    parallel.mkdir(parents=True)
    utils.mkdir()
    # The runner only checks that the tree looks like Horovod's: these two names must exist.
    (parallel / "test_torch.py").write_text("")
    # Horovod's tests read rank and size as horovodrun (Gloo mode) exports them.
    (utils / "common.py").write_text(textwrap.dedent('''
        import os
        def mpi_env_rank_and_size():
            return int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    '''))
    (parallel / "test_fake.py").write_text(FAKE_TESTS)
    stdout, results = run_runner(tmp_path, "test_fake.py", tmp_path / "out", "-np", "2",
                                 "--timeout", "25", "--jobs", "2")
    verdicts = {r["test_id"].rsplit("::", 1)[1]: r for r in results["results"]}
    outcomes = {name: r["outcome"] for name, r in verdicts.items()}
    assert outcomes == {
        "test_pass_with_alias": "PASSED", "test_skip": "SKIPPED",
        "test_fail_on_rank_1": "FAILED", "test_segfault_on_rank_1": "CRASHED",
        "test_hang_on_rank_0": "CRASHED", "test_missing_module": "FAILED",
    }, stdout
    assert "rank 1 fails" in verdicts["test_fail_on_rank_1"]["detail"]
    assert "SIGSEGV" in verdicts["test_segfault_on_rank_1"]["detail"]
    # The hung rank's stack, dumped before the kill, says where it waited.
    hang = verdicts["test_hang_on_rank_0"]["detail"]
    assert "timeout 25 s" in hang and "test_fake.py" in hang, hang
    assert "spark_hvd has no 'spark_hvd.no_such_module'" in \
        verdicts["test_missing_module"]["detail"]
    assert stdout.strip().splitlines()[-1] == "1 passed, 2 failed, 1 skipped, 2 crashed"
    # Each rank's output is kept for triage.
    assert (Path(verdicts["test_fail_on_rank_1"]["output_dir"]) / "rank.1" / "stdout").exists()


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(not os.environ.get("HOROVOD_SRC"),
                    reason="HOROVOD_SRC is not set: point it at a Horovod source tree (tag "
                           "v0.28.1) to run Horovod's own tests through tests/conformance/run.py")
def test_horovod_torch_suite(tmp_path):
    stdout, results = run_runner(os.environ["HOROVOD_SRC"], "test_torch.py", tmp_path,
                                 "-np", "2", "--jobs", "2", timeout=3500)
    unexpected = []
    for r in results["results"]:
        name = r["test_id"].rsplit("::", 1)[1]
        if r["outcome"] == "PASSED" or name in TORCH_FAILING_ON_HOROVOD:
            continue
        # GPU-only tests skip on this CPU host (test_broadcast_state_gpu unconditionally).
        if r["outcome"] == "SKIPPED" and any(w in (r["detail"] + name).upper()
                                             for w in ("GPU", "CUDA")):
            continue
        if r["outcome"] == "SKIPPED" and TORCH_SKIPPED_WITHOUT_MPI.get(name, "?") in r["detail"]:
            continue
        unexpected.append(f"{r['outcome']} {name}: {r['detail']}")
    assert not unexpected, "\n".join(unexpected) + "\n" + stdout.splitlines()[-1]
