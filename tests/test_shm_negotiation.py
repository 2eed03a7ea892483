"""Negotiation through shared memory (native/controller/negotiation_board.h) against the TCP
coordinator alone: the same workload, exact results, on 3 ranks of one host with
SPARK_HVD_SHM_NEGOTIATION on (the default) and off. Join, stalls and process sets through the
board are covered by test_engine_features.py and test_process_sets.py, which run on one host."""

from __future__ import annotations

import pytest

from conftest import run_job


@pytest.mark.timeout(120)
@pytest.mark.parametrize("negotiation", ["1", "0"])
def test_steady_state_with_and_without_board(negotiation: str) -> None:
    r = run_job(3, "negotiation", "steady", transport="shm", timeout=110,
                env={"SPARK_HVD_SHM_NEGOTIATION": negotiation,
                     "SPARK_HVD_DYNAMIC_PROCESS_SETS": "1", "SPARK_HVD_LOG_LEVEL": "DEBUG"})
    r.assert_ok(3)
    # Rank 0 says so when the board is on (and only then).
    on = "negotiated through shared memory" in r.stdout + r.stderr
    assert on == (negotiation == "1"), r.describe()
