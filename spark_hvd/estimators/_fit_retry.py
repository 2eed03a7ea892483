"""A fit that survives lost ranks (issue 31): the retry policy of the estimators' ``fit``.

When ranks are lost during training (an executor or its machine went away, a rank's process
died, ranks lost their peers), ``fit`` goes on instead of failing, up to ``max_failures`` times:

- TorchEstimator on Spark (its default backend) trains in memory under ``hvd.elastic.run`` on
  ``spark_hvd.spark.run_elastic`` (``rank/_fit_elastic``): the surviving ranks go back to the last
  epoch's end and go on; Spark's re-run of a lost task joins at the next epoch's end. If the
  elastic run itself gives up (fewer than ``min_num_proc`` ranks left for the elastic timeout,
  every rank lost), the fit goes on as below.
- Otherwise (Keras, Lightning, custom backends) it restarts from the newest complete checkpoint
  in the Store (written atomically by rank 0 after every epoch), on as many ranks as the cluster
  has free task slots now (at most the ``num_proc`` asked for, at least ``min_num_proc``:
  it waits up to the start timeout for them).

Every reset is printed on the driver with its cause, e.g. ``spark_hvd: fit torch_2024...: reset 1
of 3: ranks [1] on host 10.0.0.2 were lost: ...; going on on 1 rank(s) from the checkpoint of
epoch 2/4``. An exception in user code (``RunError.kind == "user"``) is never retried. The
decisions are the elastic driver's policy (``launch/elastic/policy.py``): what a failure kind
costs, and the reset limit.
"""

from __future__ import annotations

import copy
import sys
import time

from pyspark.ml.param import TypeConverters

from spark_hvd.launch.elastic import policy as _policy

# The estimators' Params for it (declared with the others in _params).
RETRY_PARAMS = {
    "max_failures": ("how many times fit goes on after ranks were lost during training (an "
                     "executor or machine lost, a rank that died or lost its peers): in memory "
                     "for TorchEstimator on Spark, else from the last checkpoint; 0: the first "
                     "loss fails the fit. An exception in user code is never retried",
                     TypeConverters.toInt, 3),
    "min_num_proc": ("the fewest ranks fit goes on with after a loss; with fewer free task "
                     "slots it waits for them (up to the start timeout)", TypeConverters.toInt,
                     1),
}

# RunError.kind -> the elastic policy's failure kinds. A RunError of no kind (the job could not
# start, Spark itself failed) is not a lost rank: it is raised at once.
FAILURE_KINDS = {"user": _policy.USER_ERROR, "lost": _policy.HOST_LOST,
                 "crash": _policy.PROCESS_LOST, "internal": _policy.INTERNAL}
# How often the free task slots are looked at while waiting for min_num_proc of them.
_SLOTS_POLL_SECONDS = 1.0


class GaveUp(Exception):
    """The policy's answer: raise the fit's error (``why``: the reason, for the message)."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class FitRetryPolicy:
    """Whether a failed training run is retried (pure; the table is ``FailurePolicy``'s)."""

    def __init__(self, max_failures: int, min_num_proc: int):
        if max_failures < 0:
            raise ValueError(f"max_failures must be >= 0, got {max_failures}")
        if min_num_proc < 1:
            raise ValueError(f"min_num_proc must be >= 1, got {min_num_proc}")
        self.max_failures = int(max_failures)
        self.min_num_proc = int(min_num_proc)
        self.policy = _policy.FailurePolicy(reset_limit=self.max_failures,
                                            min_np=self.min_num_proc)
        self.failures = 0

    def failed(self, kind, host, why) -> None:
        """Counts one failure of ``kind`` (a ``RunError.kind``); raises :class:`GaveUp` unless
        training may go on."""
        failure = FAILURE_KINDS.get(kind)
        if failure is None:
            raise GaveUp("not a lost rank")
        if self.policy.decide(_policy.Failure(failure, host or "?", why)).action == \
                _policy.RAISE:
            raise GaveUp("an exception in user code is never retried")
        self.failures += 1
        if self.policy.check_reset(self.failures) is not None:
            raise GaveUp(f"ranks were lost {self.failures} times, more than max_failures="
                         f"{self.max_failures}")

    def ranks(self, requested: int, free_slots: int | None) -> int | None:
        """Ranks for the next run: ``requested``, or the free task slots when fewer; None
        while fewer than ``min_num_proc`` slots are free (None: cannot tell)."""
        if free_slots is None:
            return requested
        n = min(requested, free_slots)
        return n if n >= min(self.min_num_proc, requested) else None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class FitRetry:
    """Runs one fit's training through its backend under the retry policy (see the module's
    docstring)."""

    def __init__(self, estimator, backend, spark, sink, run_id: str, config: dict):
        self.estimator = estimator
        self.backend = backend
        self.spark = spark
        self.sink = sink
        self.run_id = run_id
        self.config = config
        self.policy = FitRetryPolicy(estimator.getMaxFailures(), estimator.getMinNumProc())
        self.resets: list[dict] = []

    def say(self, message: str) -> None:
        print(f"spark_hvd: fit {self.run_id}: {message}", file=sys.stdout, flush=True)

    def run(self, trainer, resume, env):
        from spark_hvd.spark import RunError
        from ._base import SparkBackend, run_on
        config, backend = self.config, self.backend
        in_memory = (getattr(self.estimator, "_fit_in_memory", False)
                     and isinstance(backend, SparkBackend) and self.policy.max_failures > 0)
        if in_memory:
            try:
                return self._run_elastic(trainer, config, resume, env)
            except RunError as error:
                resume, config, backend = self._after(error, config, backend)
        while True:
            try:
                return run_on(backend, trainer, (config, resume), env, self.spark, self.sink)
            except RunError as error:
                resume, config, backend = self._after(error, config, backend)

    def _after(self, error, config, backend):
        """A failed run: decide, and what the next one starts from."""
        try:
            self.policy.failed(error.kind, error.host, _first_line(error))
        except GaveUp as stop:
            if self.policy.failures or error.kind not in (None, "user"):
                self.say(f"not going on: {stop.why}")
            raise error
        store = config["store"]
        checkpoints = store.list_checkpoints(self.run_id)
        resume = checkpoints[-1][1] if checkpoints else None
        requested = self._requested()
        n = self._wait_for_ranks(requested)
        config = dict(config, num_proc=n, elastic=False)
        backend = self._with_ranks(backend, n)
        where = (f"the checkpoint of epoch {checkpoints[-1][0] + 1}/{config['epochs']}"
                 if checkpoints else "the start (no checkpoint was written yet)")
        self.resets.append({"cause": _first_line(error), "num_proc": n, "resume": resume,
                            "in_memory": False})
        self.say(f"reset {self.policy.failures} of {self.policy.max_failures}: "
                 f"{_first_line(error)}; going on on {n} rank(s) from {where}")
        return resume, config, backend

    def _requested(self) -> int:
        from ._base import num_processes_of
        return num_processes_of(self.backend, self.spark)

    def _wait_for_ranks(self, requested: int) -> int:
        from ._base import SparkBackend
        if not isinstance(self.backend, SparkBackend):
            return requested   # a custom backend runs its own number of ranks
        from spark_hvd.spark import RunError, _controller, _session
        session = _session.active_session(self.backend.spark or self.spark)
        timeout = _controller._start_timeout(self.backend.start_timeout)
        deadline = time.monotonic() + timeout
        while True:
            free = _session.total_slots(session)
            n = self.policy.ranks(requested, free)
            if n is not None:
                return n
            if time.monotonic() >= deadline:
                raise RunError(f"fit {self.run_id}: only {free} task slot(s) free after "
                               f"{timeout:g} s, fewer than min_num_proc="
                               f"{self.policy.min_num_proc}")
            time.sleep(_SLOTS_POLL_SECONDS)

    @staticmethod
    def _with_ranks(backend, n: int):
        from ._base import SparkBackend
        if not isinstance(backend, SparkBackend) or backend.num_proc == n:
            return backend
        resized = copy.copy(backend)
        resized.num_proc = n
        return resized

    def _run_elastic(self, trainer, config, resume, env):
        """TorchEstimator in memory: the training function on ``run_elastic``."""
        from spark_hvd.spark._elastic import ElasticRunController
        backend = self.backend
        n = self._requested()
        merged = dict(backend.env or {})
        merged.update(env or {})
        extra = {k: v for k, v in backend.run_kwargs.items()
                 if k in ("prefix_output_with_timestamp", "executable")}
        controller = ElasticRunController(
            trainer, args=(dict(config, elastic=True), resume), num_proc=n,
            min_np=min(self.policy.min_num_proc, n), max_np=n,
            start_timeout=backend.start_timeout, env=merged, stdout=self.sink,
            stderr=backend.stderr, verbose=backend.verbose, nics=backend.nics,
            spark=backend.spark or self.spark, on_reset=None, **extra)

        def on_reset(number, cause, size, seconds):
            grew = cause.startswith("hosts changed")
            if not grew:
                try:
                    self.policy.failed("lost", None, cause)
                except GaveUp as stop:
                    self.say(f"not going on: {stop.why}")
                    controller.driver.post(("fail", f"fit {self.run_id}: {stop.why}"))
                    return
            self.resets.append({"cause": cause, "num_proc": size, "in_memory": True})
            what = "grew back" if grew else (f"reset {self.policy.failures} of "
                                             f"{self.policy.max_failures}")
            self.say(f"{what} in memory: {cause}; going on on {size} rank(s) from the last "
                     f"epoch's end (re-formed in {seconds:.1f} s)")

        controller.on_reset = on_reset
        return controller.run()
