"""Builds and runs C++ programs of native/tests/: controller_test.cc (the response cache, the
mismatch diagnosis, the stall inspector, the shared-memory negotiation board and the
coordinator), hierarchy_test.cc (how sets spanning hosts split for hierarchical collectives),
autotune_test.cc (the Gaussian process, Bayesian optimisation and the autotuner's sampling)
and wakeup_bench.cc (what a cross-process hand-off costs here; printed with -s).

Each program is compiled by native_build.build_test_program with the library's release flags and
cached under build/native/tests/ by a hash of its sources, so reruns only pay for the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import native_build  # noqa: E402  (the repository's native build, as build.py runs it)

CONTROLLER_TEST = [
    "tests/controller_test.cc",
    "controller/coordinator.cc",
    "controller/deadlock.cc",
    "controller/message.cc",
    "controller/mismatch.cc",
    "controller/negotiation_board.cc",
    "controller/process_sets.cc",
    "controller/response_cache.cc",
    "controller/stall_inspector.cc",
    "common/types.cc",
    "common/hmac.cc",
]
HIERARCHY_TEST = [
    "tests/hierarchy_test.cc",
    "algorithms/hierarchical.cc",
    "algorithms/allreduce_ring.cc",
    "algorithms/allreduce_recursive_doubling.cc",
    "algorithms/reducescatter_ring.cc",
    "algorithms/allgather_ring.cc",
    "algorithms/collective_helpers.cc",
    # the within-host group hierarchical.cc reduces through (links only; never run here)
    "algorithms/shared_memory_group.cc",
    "algorithms/allreduce_shm_arena.cc",
    "algorithms/shared_arenas.cc",
    "algorithms/cpu_placement.cc",
    "transport/shm_segment.cc",
    "transport/peer_memory.cc",
    "kernels/reduce_kernels.cc",
    "transport/link.cc",
    "common/types.cc",
    "common/hmac.cc",
]
AUTOTUNE_TEST = [
    "tests/autotune_test.cc",
    "controller/autotune.cc",
    "controller/bayes_opt.cc",
    "controller/message.cc",
    "common/logging.cc",
    "common/types.cc",
]
RUN_TIMEOUT_S = 120

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the native core is Linux-only")


def _run(name: str, sources: list[str], args: tuple[str, ...] = ()) -> None:
    try:
        binary = native_build.build_test_program(name, sources)
    except native_build.BuildError as e:
        pytest.fail(f"compiling {name} failed: {e}")
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    report = proc.stdout + ("\n--- stderr ---\n" + proc.stderr if proc.stderr else "")
    print(report)
    assert proc.returncode == 0, report
    assert " 0 failed" in proc.stdout and "PASS" in proc.stdout, report


def test_controller_units() -> None:
    _run("controller_test", CONTROLLER_TEST)


def test_hierarchy_units() -> None:
    _run("hierarchy_test", HIERARCHY_TEST)


def test_autotune_units() -> None:
    _run("autotune_test", AUTOTUNE_TEST)


def test_wakeup_costs() -> None:
    """Measures what one cross-process hand-off costs here (spin, yield, futex, socket): the
    floor under the shared-memory negotiation's latency (benchmarks/README.md quotes it). The
    suite runs 300 hand-offs per mode, enough to see each mechanism work; the numbers quoted
    come from the full count (`build/native/tests/wakeup_bench`, or `-s` here with
    WAKEUP_ROUNDS=0)."""
    rounds = os.environ.get("WAKEUP_ROUNDS", "300")
    _run("wakeup_bench", ["tests/wakeup_bench.cc"], ("", rounds))
