"""Timing a call in a loop, as the latency breakdowns do. Shared by the scripts of
``benchmarks/``."""

import statistics
import time


def median_per_call(fn, calls, rounds, warmup):
    """Median over ``rounds`` of the mean seconds per call of ``calls`` calls of ``fn``, after
    ``warmup`` calls (``fn`` is called as it is: nothing wraps it inside the timed loop)."""
    for _ in range(warmup):
        fn()
    means = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter_ns() - t0) / calls / 1e9)
    return statistics.median(means)
