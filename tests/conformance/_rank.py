"""One rank of a conformance job: runs one Horovod test with pytest and records its outcome.

Started by ``spark-hvd-run`` for ``run.py``: ``python _rank.py RESULT_DIR PYTEST_ARGS...`` (or
directly, as the one process of a ``test/single`` or ``test/integration`` test, with
``CONFORMANCE_SINGLE=1``: then no rank variables are set).

Horovod's tests learn the job's rank and size from the launcher's variables: under
``horovodrun`` in Gloo mode ``HOROVOD_RANK``/``HOROVOD_SIZE``, under MPI ``PMI_*`` or
``OMPI_COMM_WORLD_*`` (``mpi_env_rank_and_size()`` in test/utils/common.py). A test that finds no
``HOROVOD_RANK`` takes the job for an MPI one: it skips what "only applies for Gloo" (shutdown and
re-init), asserts ``mpi_built()``, and skips the per-test ``barrier(); shutdown()`` of its
tearDown. spark_hvd's transport is the analogue of Horovod's Gloo one (``gloo_built()`` is True,
``mpi_built()`` False), so this wrapper copies spark-hvd-run's rank and size into
``HOROVOD_RANK``/``HOROVOD_SIZE``, the two variables the tests read, as horovodrun does: the
same job, and spark_hvd gives its own launcher's ``SPARK_HVD_*`` variables precedence.

The outcome goes to ``RESULT_DIR/rank.N.json`` after every test phase, so a rank the launcher
stops after a peer failed still leaves what it knew. ``faulthandler`` dumps every thread's stack
shortly before the runner's time limit (``CONFORMANCE_DUMP_STACKS_AFTER`` seconds): its watchdog
thread needs no signal, so it shows where a rank hangs even in a wait that blocks signals.
"""

import faulthandler
import json
import os
import sys

RANK = os.environ.get("SPARK_HVD_RANK", "0")
SIZE = os.environ.get("SPARK_HVD_SIZE", "1")


class OutcomeRecorder:
    """pytest plugin: keeps the worst outcome of the test's phases and its failure text."""

    def __init__(self, path):
        self.path = path
        self.result = {"rank": int(RANK), "outcome": None, "phase": None, "longrepr": ""}

    def pytest_runtest_logreport(self, report):
        if report.failed:
            if self.result["outcome"] != "failed":  # the first failure explains the rest
                self.result.update(outcome="failed", phase=report.when,
                                   longrepr=report.longreprtext)
        elif report.skipped and self.result["outcome"] is None:
            self.result.update(outcome="skipped", phase=report.when,
                               longrepr=report.longreprtext)
        elif report.when == "call" and report.passed and self.result["outcome"] is None:
            self.result.update(outcome="passed", phase="call")
        self.save()

    def pytest_collectreport(self, report):
        if report.failed:
            self.result.update(outcome="failed", phase="collect", longrepr=report.longreprtext)
            self.save()

    def save(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f)
        os.replace(tmp, self.path)


def main():
    result_dir, pytest_args = sys.argv[1], sys.argv[2:]
    if not os.environ.get("CONFORMANCE_SINGLE"):  # a single-process test is no job's rank
        os.environ["HOROVOD_RANK"] = RANK
        os.environ["HOROVOD_SIZE"] = SIZE
    dump_after = float(os.environ.get("CONFORMANCE_DUMP_STACKS_AFTER", "0"))
    if dump_after > 0:
        # To the real stderr: pytest's capture replaces fd 2 while the test runs.
        stderr = os.fdopen(os.dup(2), "w")
        faulthandler.dump_traceback_later(dump_after, exit=False, file=stderr)
    import pytest

    recorder = OutcomeRecorder(os.path.join(result_dir, f"rank.{RANK}.json"))
    code = pytest.main(pytest_args, plugins=[recorder])
    recorder.result["exit_code"] = int(code)
    recorder.save()
    sys.exit(int(code))


if __name__ == "__main__":
    main()
