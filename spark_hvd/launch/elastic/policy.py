"""What to do when something fails in an elastic job: one small, pure policy.

The driver (``launch/elastic/driver.py``), and later the Spark controller and ``fit``'s retries,
describe a :class:`Failure` and execute the :class:`Decision`; the table lives here only.

===================  ==========================================================================
failure              decision
===================  ==========================================================================
``user_error``       RAISE: the job ends with the traceback; the host is not blamed (with
                     ``on_user_error="blacklist"``, Horovod's behaviour: RESET, blacklisting it)
``internal``         RESET without blacklisting: the process ended on a ``HorovodInternalError``
                     outside ``hvd.elastic.run`` (it only suffered another rank's loss)
``process_lost``     RESET, blacklisting its host: it exited without a report, or was killed
                     (``process_lost_blacklists=False``: not the host; on Spark the executor
                     of a killed process lives on and runs the next worker)
``host_lost``        RESET, blacklisting the host: silent for the peer timeout, or ssh exit 255
``host_frozen``      RESET, blacklisting the host: it did not rejoin within the elastic timeout
``start_failed``     RESET, blacklisting the host: a new worker did not join within the start
                     timeout
===================  ==========================================================================

Resets beyond ``reset_limit`` are RAISE with Horovod's message; too few processes for
``min_np`` means WAIT for hosts until the elastic timeout, then RAISE.
"""

from __future__ import annotations

import dataclasses

# Horovod's horovod.runner.elastic.constants.RESET_LIMIT_EXCEEDED_MESSAGE.
RESET_LIMIT_EXCEEDED_MESSAGE = ('Horovod was shutdown because number of resets during elastic '
                                'job exceeded limit: {}')
# The start of Horovod's error for a failed job (its integration tests match it).
FAILED_MESSAGE = 'Horovod detected that one or more processes exited with non-zero status'

USER_ERROR, INTERNAL, PROCESS_LOST, HOST_LOST, HOST_FROZEN, START_FAILED = (
    "user_error", "internal", "process_lost", "host_lost", "host_frozen", "start_failed")
KINDS = (USER_ERROR, INTERNAL, PROCESS_LOST, HOST_LOST, HOST_FROZEN, START_FAILED)

RAISE, RESET, WAIT_FOR_HOSTS = "raise", "reset", "wait_for_hosts"


@dataclasses.dataclass(frozen=True)
class Failure:
    kind: str
    host: str
    why: str


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str
    why: str = ""
    blacklist: tuple = ()
    deadline: float | None = None


class FailurePolicy:
    """The decision table (see the module's docstring)."""

    def __init__(self, on_user_error="raise", reset_limit=None, min_np=1, elastic_timeout=600.0,
                 process_lost_blacklists=True):
        if on_user_error not in ("raise", "blacklist"):
            raise ValueError(f"on_user_error={on_user_error!r}: use 'raise' or 'blacklist'")
        self.on_user_error = on_user_error
        self.reset_limit = reset_limit
        self.min_np = max(1, int(min_np or 1))
        self.elastic_timeout = float(elastic_timeout)
        self.process_lost_blacklists = process_lost_blacklists

    def decide(self, failure: Failure) -> Decision:
        if failure.kind not in KINDS:
            raise ValueError(f"unknown failure kind {failure.kind!r}")
        if failure.kind == USER_ERROR and self.on_user_error == "raise":
            return Decision(RAISE, f"{FAILED_MESSAGE}: {failure.why}")
        if failure.kind == INTERNAL or (failure.kind == PROCESS_LOST
                                        and not self.process_lost_blacklists):
            return Decision(RESET, failure.why)
        return Decision(RESET, failure.why, blacklist=(failure.host,))

    def check_reset(self, resets: int) -> Decision | None:
        """RAISE when ``resets`` (counting the one about to start) exceeds the limit."""
        if self.reset_limit is not None and resets > self.reset_limit:
            return Decision(RAISE, RESET_LIMIT_EXCEEDED_MESSAGE.format(self.reset_limit))
        return None

    def check_capacity(self, available: int, short_since: float | None, now: float,
                       why_short: str) -> Decision | None:
        """None when ``available`` processes are enough; else WAIT until the elastic timeout
        since ``short_since``, then RAISE naming ``why_short``."""
        if available >= self.min_np:
            return None
        deadline = (now if short_since is None else short_since) + self.elastic_timeout
        if now >= deadline:
            return Decision(RAISE, f"{FAILED_MESSAGE}: only {available} process(es) available, "
                                   f"fewer than the minimum of {self.min_np}, for "
                                   f"{self.elastic_timeout:g} s (--elastic-timeout): "
                                   f"{why_short}")
        return Decision(WAIT_FOR_HOSTS, why_short, deadline=deadline)
