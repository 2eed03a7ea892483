"""Engine features, one mode per launch: fusion, re-init, timeline, stall inspector, join,
configuration aliases, shutdown while others still run.

Usage: features.py MODE [ARGS...]
"""

import json
import os
import sys
import time

import numpy as np

import spark_hvd.numpy as hvd
from _wutil import Checks, close, describe_diff, make_input, tolerance


def sum_of(xs):
    return np.sum([x.astype(np.float64) for x in xs], axis=0)


# -- fusion ---------------------------------------------------------------------------------

def fusion(c, rounds="3"):
    """Many small tensors submitted asynchronously (rank 1 in reverse order) give exactly the
    results of submitting them one at a time; repeated rounds exercise the response cache,
    and a shape change under a cached name must be renegotiated."""
    rank, size = hvd.rank(), hvd.size()
    dtypes = [np.float32, np.float64, np.int32, np.float16, np.int8, np.uint8, np.int64]
    specs = []
    for i in range(120):
        dtype = dtypes[i % len(dtypes)]
        shape = ((i * 7) % 50 + (i % 3),) if i % 5 else ((i % 4) + 1, 3)
        op = [hvd.Sum, hvd.Average, hvd.Max, hvd.Min][i % 4] if dtype != np.int8 else hvd.Max
        specs.append((f"t{i}", dtype, shape, op))
    for rnd in range(int(rounds)):
        if rnd == int(rounds) - 1:
            # Same names, new shapes: cached requests must not be reused.
            specs = [(n, d, (s[0] + 1,) + s[1:], o) for n, d, s, o in specs]
        xs = {n: [make_input(r, s, d, (n, rnd)) for r in range(size)] for n, d, s, o in specs}
        order = specs if rank % 2 == 0 else specs[::-1]
        handles = {n: hvd.allreduce_async(xs[n][rank], name=n, op=o) for n, d, s, o in order}
        fused = {n: hvd.synchronize(h) for n, h in handles.items()}
        one_by_one = {n: hvd.allreduce(xs[n][rank], name=n, op=o) for n, d, s, o in specs}
        for n, d, s, o in specs:
            c.check(np.array_equal(fused[n], one_by_one[n]),
                    f"round {rnd} {n}: fused != one by one: "
                    f"{describe_diff(fused[n], one_by_one[n])}")
            stack = np.stack([x.astype(np.float64) for x in xs[n]])
            if o == hvd.Max:
                want = stack.max(0).astype(d)
            elif o == hvd.Min:
                want = stack.min(0).astype(d)
            elif o == hvd.Sum:
                want = stack.sum(0).astype(d)
            else:
                want = stack.sum(0) / size
                want = want.astype(d) if np.dtype(d).kind == "f" else np.trunc(want).astype(d)
            rtol, atol = tolerance(d, size)
            c.check(close(fused[n], want, rtol, atol),
                    f"round {rnd} {n}: {describe_diff(fused[n], want)}")
    # Grouped ops of mixed dtypes in flight at once with single ones.
    hs = [hvd.grouped_allreduce_async([np.full(3, rank, np.float32), np.full(2, rank, np.int64)],
                                      name=f"g{k}", op=hvd.Sum) for k in range(5)]
    singles = [hvd.allreduce_async(np.full(4, rank, np.float64), name=f"s{k}", op=hvd.Sum)
               for k in range(5)]
    tot = size * (size - 1) // 2
    for k, h in enumerate(hs):
        a, b = hvd.synchronize(h)
        c.check(np.all(a == tot) and np.all(b == tot) and b.dtype == np.int64, f"g{k}: {a} {b}")
    for k, h in enumerate(singles):
        c.check(np.all(hvd.synchronize(h) == tot), f"s{k}")
    # Scaled ops in flight together (fused): prescale, Average's division, postscale.
    scaled = [(f"sc{i}", d) for i, d in enumerate([np.float32, np.float64] * 4)]
    xs = {n: [make_input(r, (33,), d, n) for r in range(size)] for n, d in scaled}
    hs = {n: hvd.allreduce_async(xs[n][rank], name=n, op=hvd.Average, prescale_factor=0.5,
                                 postscale_factor=3.0) for n, d in scaled}
    for n, d in scaled:
        got = hvd.synchronize(hs[n])
        want = np.sum([x.astype(np.float64) * 0.5 for x in xs[n]], axis=0) * 3.0 / size
        want = want.astype(d)
        rtol, atol = tolerance(d, size)
        c.check(close(got, want, rtol, atol), f"scaled {n}: {describe_diff(got, want)}")
    c.fields["threshold"] = hvd.config().fusion_threshold
    c.fields["cache"] = hvd.config().cache_capacity


# -- re-init --------------------------------------------------------------------------------

def reinit(c, cycles="3"):
    """init -> ops -> shutdown, several times in one process; static process sets are given
    afresh each time."""
    for cycle in range(int(cycles)):
        c.check(not hvd.is_initialized(), f"cycle {cycle}: initialized before init()")
        ps = hvd.ProcessSet([0, hvd_size_env() - 1])
        hvd.init(process_sets=[ps])
        c.check(hvd.is_initialized(), f"cycle {cycle}: not initialized after init()")
        rank, size = hvd.rank(), hvd.size()
        c.check(rank == int(os.environ["SPARK_HVD_RANK"]), f"cycle {cycle}: rank {rank}")
        got = hvd.allreduce(np.full(4, rank + cycle, np.float32), name="same_name", op=hvd.Sum)
        want = sum(r + cycle for r in range(size))
        c.check(np.all(got == want), f"cycle {cycle}: allreduce {got} != {want}")
        got = hvd.allgather(np.array([rank, cycle]), name="gather")
        c.check(got.tolist() == [v for r in range(size) for v in (r, cycle)],
                f"cycle {cycle}: allgather {got}")
        got = hvd.broadcast(np.array([rank]), size - 1, name="bcast")
        c.check(got.tolist() == [size - 1], f"cycle {cycle}: broadcast {got}")
        if rank in ps.ranks:
            got = hvd.allreduce(np.ones(2), name="in_set", op=hvd.Sum, process_set=ps)
            c.check(np.all(got == len(ps.ranks)), f"cycle {cycle}: set allreduce {got}")
        # Unnamed ops restart their numbering consistently on every rank.
        got = hvd.allreduce(np.ones(2), op=hvd.Sum)
        c.check(np.all(got == size), f"cycle {cycle}: unnamed allreduce")
        hvd.barrier()
        hvd.shutdown()
        c.check(not hvd.is_initialized(), f"cycle {cycle}: initialized after shutdown()")
        c.check(ps.process_set_id is None, f"cycle {cycle}: set still registered after shutdown")
    hvd.shutdown()  # a second shutdown is harmless


def hvd_size_env():
    return int(os.environ["SPARK_HVD_SIZE"])


# -- timeline -------------------------------------------------------------------------------

def timeline(c, api_path=""):
    """Named ops of every kind, some fused; with ``api_path`` also a second trace recorded
    through start_timeline/stop_timeline with cycle marks."""
    rank, size = hvd.rank(), hvd.size()

    def ops(prefix):
        hvd.allreduce(np.ones(8, np.float32), name=f"{prefix}allreduce_one", op=hvd.Sum)
        hvd.grouped_allreduce([np.ones(4, np.float32) for _ in range(3)],
                              name=f"{prefix}fused", op=hvd.Sum)
        hvd.allgather(np.ones((rank + 1, 2), np.float32), name=f"{prefix}allgather_one")
        hvd.broadcast(np.ones(3, np.int32), 0, name=f"{prefix}broadcast_one")
        hvd.alltoall(np.ones(size * 2, np.float32), name=f"{prefix}alltoall_one")
        hvd.reducescatter(np.ones((size, 2), np.float32), op=hvd.Sum,
                          name=f"{prefix}reducescatter_one")
        hvd.barrier()

    ops("env.")
    if api_path:
        hvd.start_timeline(api_path, mark_cycles=True)
        ops("api.")
        hvd.stop_timeline()
        ops("after_stop.")
    hvd.shutdown()


# -- stall inspector ------------------------------------------------------------------------

def stall_warning(c, delay="3"):
    """The last rank submits 'late_tensor' ``delay`` seconds after the others. The tensor ran
    on time before, so the late round is one whose requests are response-cache ids."""
    rank, size = hvd.rank(), hvd.size()
    for _ in range(3):
        got = hvd.allreduce(np.ones(3, np.float32), name="late_tensor", op=hvd.Sum)
    if rank == size - 1:
        time.sleep(float(delay))
    got = hvd.allreduce(np.ones(3, np.float32), name="late_tensor", op=hvd.Sum)
    c.check(np.all(got == size), f"late_tensor: {got}")
    hvd.shutdown()


def stall_shutdown(c):
    """Rank 0 submits 'only_on_zero', the others 'never_on_zero': nobody can proceed, and the
    stall inspector must end the job with HorovodInternalError on every rank."""
    rank = hvd.rank()
    t0 = time.time()
    name = "only_on_zero" if rank == 0 else "never_on_zero"
    e = c.raises("stalled op", hvd.HorovodInternalError, hvd.allreduce, np.ones(2), name=name,
                 match=["stall inspector", "SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS"])
    elapsed = time.time() - t0
    c.check(elapsed < 15, f"the stall took {elapsed:.1f} s to end the job")
    c.raises("op after the stall shutdown", hvd.HorovodInternalError, hvd.allreduce, np.ones(2),
             name="later")
    hvd.shutdown()
    c.fields["elapsed"] = f"{elapsed:.1f}"
    c.fields["msg"] = repr(str(e))[:160].replace(" ", "_")


# -- deadlock check -------------------------------------------------------------------------

def deadlock(c, case="order"):
    """Ranks blocked in collectives that can never match must end with HorovodInternalError on
    every rank, naming what each rank waits for, well before the stall inspector's 60 s.

    order:   rank 0 runs allreduce 'a' then 'b', the others 'b' then 'a' (fresh names: the
             coordinator negotiates them)
    cached:  the same after three rounds in one order (cached names: on one host the shared-
             memory board agrees on them, unseen by the coordinator)
    sets:    rank 0 waits in a process set {0, 1} op that rank 1 never submits, rank 1 and the
             rest in a global op rank 0 never submits
    skipped: every rank but the last runs allreduce 'step.1'; the last skipped it and waits in
             'step.2'
    """
    rank, size = hvd.rank(), hvd.size()
    x = np.ones(4, np.float32)
    pair = None
    if case == "cached":
        for _ in range(3):
            for name in ("a", "b"):
                c.check(np.all(hvd.allreduce(x, name=name, op=hvd.Sum) == size), name)
    if case == "sets":
        pair = hvd.add_process_set([0, 1])
    t0 = time.time()
    match = ["deadlock", "SPARK_HVD_DEADLOCK_CHECK_SECONDS"]
    if case in ("order", "cached"):
        first, then = ("a", "b") if rank == 0 else ("b", "a")
        e = c.raises("mismatched order", hvd.HorovodInternalError, hvd.allreduce, x,
                     name=first, op=hvd.Sum,
                     match=match + ["rank 0", "waits for allreduce 'a' (not submitted by rank"])
        del then
    elif case == "sets":
        if rank == 0:
            e = c.raises("set op", hvd.HorovodInternalError, hvd.allreduce, x, name="in_pair",
                         process_set=pair, match=match + ["allreduce 'in_pair"])
        else:
            e = c.raises("global op", hvd.HorovodInternalError, hvd.allreduce, x,
                         name="global", match=match + ["allreduce 'global' (not submitted by "
                                                       "rank 0"])
    else:
        name = "step.2" if rank == size - 1 else "step.1"
        e = c.raises("skipped op", hvd.HorovodInternalError, hvd.allreduce, x, name=name,
                     match=match + [f"allreduce 'step.1' (not submitted by rank {size - 1}"])
    elapsed = time.time() - t0
    c.check(elapsed < 20, f"the deadlock took {elapsed:.1f} s to end the job")
    c.raises("op after the deadlock", hvd.HorovodInternalError, hvd.allreduce, x, name="later")
    hvd.shutdown()
    c.fields["elapsed"] = f"{elapsed:.1f}"
    c.fields["msg"] = repr(str(e))[:400].replace(" ", "_")


def no_deadlock(c):
    """Waits that end are not deadlocks: a rank that computes for longer than the check's
    delay before submitting (the others wait meanwhile), and a rank whose main thread waits
    for an op that a second thread of its submits later."""
    import threading
    rank, size = hvd.rank(), hvd.size()
    x = np.ones(4, np.float32)
    if rank == size - 1:
        time.sleep(3.5)
    c.check(np.all(hvd.allreduce(x, name="slow", op=hvd.Sum) == size), "slow")
    # Rank 0's main thread waits for 'late' at once; its second thread submits 'early', which
    # the others wait for first, 1 s later.
    if rank == 0:
        got = {}
        t = threading.Timer(1.0, lambda: got.update(early=hvd.allreduce(x, name="early")))
        t.start()
        late = hvd.allreduce(x, name="late", op=hvd.Sum)
        t.join()
        c.check(np.all(got["early"] == 1), "early")
    else:
        c.check(np.all(hvd.allreduce(x, name="early") == 1), "early")
        late = hvd.allreduce(x, name="late", op=hvd.Sum)
    c.check(np.all(late == size), "late")
    hvd.shutdown()


# -- elastic primitives ----------------------------------------------------------------------

def notices(c, steps="300"):
    """Rank 0's second thread posts host-change notices at random times while every rank runs
    allreduces; each rank records after which step each notice became visible among its
    released ops (shvd_released_notice). The test compares the steps across ranks: they must
    be equal, whenever the notice arrived."""
    import random
    import threading
    from spark_hvd.common import _native
    rank = hvd.rank()
    posted = []
    if rank == 0:
        def post():
            rnd = random.Random(7)
            for k in (1, 2, 3):
                time.sleep(rnd.uniform(0.05, 0.4))
                _native.lib.shvd_post_notice(k)
                posted.append(k)
        poster = threading.Thread(target=post)
        poster.start()
    seen, first_step = 0, {}
    for step in range(int(steps)):
        hvd.allreduce(np.ones(8, np.float32), name=f"n{step % 5}", op=hvd.Sum)
        now = _native.lib.shvd_released_notice()
        for k in range(seen + 1, now + 1):
            first_step[k] = step
        seen = now
        time.sleep(0.003)
    if rank == 0:
        poster.join()
    hvd.barrier()
    hvd.allreduce(np.ones(1), name="last")
    now = _native.lib.shvd_released_notice()
    for k in range(seen + 1, now + 1):
        first_step[k] = "end"
    c.check(now == 3, f"notices seen at the end: {now}")
    c.fields["steps"] = ",".join(str(first_step.get(k)) for k in (1, 2, 3))
    hvd.shutdown()


def abort_then_reinit(c):
    """A second thread of rank 0 calls shvd_abort (as the elastic launcher's notice listener
    does) while every rank waits in a collective: every rank's op fails at once with the reason
    (no timeout), and after shutdown() the same processes init() again and work."""
    import threading
    from spark_hvd.common import _native
    rank = hvd.rank()
    if rank == 0:
        threading.Timer(0.5, _native.lib.shvd_abort, args=(b"rank 3 on node-x exited",)).start()
    t0 = time.time()
    name = "only_on_zero" if rank == 0 else "never_on_zero"
    c.raises("op during the abort", hvd.HorovodInternalError, hvd.allreduce, np.ones(2),
             name=name, match="rank 3 on node-x exited")
    elapsed = time.time() - t0
    c.check(elapsed < 5, f"the abort took {elapsed:.1f} s to reach rank {rank}")
    hvd.shutdown()
    hvd.init()
    got = hvd.allreduce(np.full(3, rank + 1, np.float32), name="after", op=hvd.Sum)
    c.check(np.all(got == sum(range(1, hvd.size() + 1))), f"after re-init: {got}")
    c.check(_native.lib.shvd_released_notice() == 0, "a new engine starts with no notice")
    c.fields["elapsed"] = f"{elapsed:.1f}"
    hvd.shutdown()


# -- the calling-thread path ---------------------------------------------------------------

def calling_thread(c, threads="1"):
    """Synchronous allreduces and barriers, with a second thread submitting asynchronous
    allreduces (and synchronous ones, 'threads' 2) at the same time: every result exact, and
    the number of ops that ran on their caller's thread reported."""
    import threading
    from spark_hvd.common import _native
    rank, size = hvd.rank(), hvd.size()
    want = size * (size + 1) / 2
    errors = []

    def other():
        try:
            for i in range(300):
                x = np.full(1000, rank + 1.0, np.float32)
                if threads == "2":
                    got = hvd.allreduce(x, name=f"other.{i % 4}", op=hvd.Sum)
                else:
                    got = hvd.synchronize(hvd.allreduce_async(x, name=f"other.{i % 4}",
                                                              op=hvd.Sum))
                if not np.all(got == want):
                    errors.append(f"other {i}: {got[:3]}")
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
    t = threading.Thread(target=other)
    t.start()
    a = np.zeros(4, np.float32)
    for i in range(500):
        a[:] = rank + 1
        hvd.allreduce_(a, name="main", op=hvd.Sum)
        c.check(np.all(a == want), f"main {i}: {a}")
        if i % 50 == 0:
            hvd.barrier()
    t.join()
    c.check(not errors, f"second thread: {errors[:3]}")
    hvd.barrier()
    c.fields["here"] = _native.lib.shvd_calling_thread_ops()
    hvd.shutdown()


# -- join -----------------------------------------------------------------------------------

def join(c, order="ascending"):
    """Uneven numbers of steps: rank r runs steps[r] allreduces, then join()s. Joined ranks
    contribute zeros; join() returns the last rank to join on every rank."""
    rank, size = hvd.rank(), hvd.size()
    steps = [3 + 2 * r for r in range(size)]
    if order == "descending":
        steps = steps[::-1]
    elif order == "equal":
        steps = [4] * size
    for s in range(steps[rank]):
        active = [r for r in range(size) if steps[r] > s]
        x = np.full(5, rank + 1, np.float32)
        want = float(sum(r + 1 for r in active))
        # The same name every step, first: answered from the response cache, and what the
        # ranks still running wait on when the others join.
        got = hvd.allreduce(x, name="every_step", op=hvd.Sum)
        c.check(np.all(got == want), f"step {s}: every_step sum {got[0]} != {want}")
        got = hvd.allreduce(x, name=f"step{s}", op=hvd.Sum)
        c.check(np.all(got == want), f"step {s}: sum {got[0]} != {want}")
        got = hvd.allreduce(x, name=f"avg{s}", op=hvd.Average)
        c.check(np.allclose(got, want / size), f"step {s}: average {got[0]} != {want / size}")
        # Several tensors in flight at once (fused while some ranks have joined).
        hs = [hvd.allreduce_async(np.full(k + 1, rank + 1, np.int32), name=f"multi{s}.{k}",
                                  op=hvd.Sum) for k in range(4)]
        for k, h in enumerate(hs):
            got = hvd.synchronize(h)
            c.check(np.all(got == int(want)), f"step {s} multi {k}: {got} != {want}")
    if steps[rank] < max(steps):
        # Join late enough that the others' next requests (cached ids among them) already
        # wait for this rank: the join must release them.
        time.sleep(0.3)
    last = hvd.join()
    want_last = max(range(size), key=lambda r: (steps[r], r)) if order != "equal" else None
    if want_last is not None:
        c.check(last == want_last, f"join() returned {last}, expected {want_last}")
    else:
        c.check(0 <= last < size, f"join() returned {last}")
    lasts = hvd.allgather(np.array([last]), name="lasts")
    c.check(len(set(lasts.tolist())) == 1, f"join() results differ across ranks: {lasts}")
    # The job goes on normally after everyone joined, and join works a second time.
    got = hvd.allreduce(np.ones(2), name="after_join", op=hvd.Sum)
    c.check(np.all(got == size), f"after join: {got}")
    if rank == 0:
        time.sleep(0.5)
    last2 = hvd.join()
    c.check(0 <= last2 < size, f"second join() returned {last2}")
    # Only allreduce goes on while a rank has joined: the others' allgather, broadcast,
    # alltoall and reducescatter fail at once (RuntimeError, as Horovod's), never wait for it.
    for first in range(size):
        if rank != first:
            time.sleep(0.2)  # let `first` join before the others submit
            for what, fn in (("allgather", lambda: hvd.allgather(np.ones(2), name="j.ag")),
                             ("broadcast", lambda: hvd.broadcast(np.ones(2), 0, name="j.bc")),
                             ("alltoall", lambda: hvd.alltoall(np.ones(size), name="j.a2a")),
                             ("reducescatter",
                              lambda: hvd.reducescatter(np.ones(size), name="j.rs"))):
                c.raises(f"{what} while rank {first} joined", RuntimeError, fn,
                         match="joined")
        last_now = hvd.join()
        c.check(last_now != first and 0 <= last_now < size,
                f"join() returned {last_now}; rank {first} joined first")
    hvd.shutdown()
    c.fields["last"] = last


# -- configuration --------------------------------------------------------------------------

def config(c, fusion="", cycle="", cache="", timeline_expected=""):
    cfg = hvd.config()
    if fusion:
        c.check(cfg.fusion_threshold == int(fusion), f"fusion_threshold {cfg.fusion_threshold}")
    if cycle:
        c.check(cfg.cycle_time_ms == float(cycle), f"cycle_time_ms {cfg.cycle_time_ms}")
    if cache:
        c.check(cfg.cache_capacity == int(cache), f"cache_capacity {cfg.cache_capacity}")
    if timeline_expected:
        c.check(cfg.timeline == timeline_expected, f"timeline {cfg.timeline!r}")
    rank = hvd.rank()
    # Grouped tensors are fused unless the threshold forbids it (visible in the timeline).
    hvd.grouped_allreduce([np.ones(4, np.float32) for _ in range(4)], name="cfg_group", op=hvd.Sum)
    t0 = time.perf_counter()
    for i in range(20):
        hvd.allreduce(np.ones(1, np.float32), name="cfg_tick", op=hvd.Sum)
    c.fields["ms_per_op"] = f"{(time.perf_counter() - t0) * 50:.2f}"
    hvd.shutdown()
    c.fields["rank"] = rank


# -- shutdown while others still run ---------------------------------------------------------

def early_shutdown(c, who="0"):
    """Rank ``who`` shuts down right after the first op while the others continue: their later
    ops must fail (not hang), and every rank's shutdown returns."""
    who = int(who)
    rank, size = hvd.rank(), hvd.size()
    hvd.allreduce(np.ones(2), name="first", op=hvd.Sum)
    if rank == who:
        t0 = time.time()
        hvd.shutdown()
        c.check(time.time() - t0 < 20, f"shutdown took {time.time() - t0:.1f} s")
        c.raises("op after own shutdown", ValueError, hvd.allreduce, np.ones(2), name="x",
                 match="init")
        return
    time.sleep(0.5)
    h = hvd.allreduce_async(np.ones(2), name="late_async", op=hvd.Sum)
    e = c.raises("op while a rank has shut down", (hvd.HorovodInternalError, ValueError),
                 hvd.allreduce, np.ones(2), name="late", op=hvd.Sum,
                 match=[f"ranks [{who}]", "shut down", "late"])
    c.raises("async op while a rank has shut down", (hvd.HorovodInternalError, ValueError),
             hvd.synchronize, h, match=["shut down"])
    t0 = time.time()
    hvd.shutdown()
    c.check(time.time() - t0 < 20, f"shutdown took {time.time() - t0:.1f} s")
    c.fields["error"] = type(e).__name__ if e else None


def exit_without_shutdown(c):
    """Ranks that simply exit (atexit shuts down) while another is still working."""
    rank = hvd.rank()
    hvd.allreduce(np.ones(2), name="first", op=hvd.Sum)
    if rank != 0:
        c.finish()
        sys.exit(0)  # atexit calls shutdown()
    time.sleep(0.5)
    c.raises("op after the others exited", (hvd.HorovodInternalError, ValueError),
             hvd.allreduce, np.ones(2), name="late", op=hvd.Sum)
    hvd.shutdown()


# -- progress without waiting ----------------------------------------------------------------

def progress(c):
    """Asynchronous ops complete while nobody waits or polls: the engine's burst ends after at
    most 100 cycle times (50 ms), so results land during the sleep (read before any poll/wait, which
    would themselves end the burst). Ranks submit at different times, one op and many."""
    rank, size = hvd.rank(), hvd.size()
    want = sum(range(1, size + 1))
    for trial, count in enumerate((1, 50)):
        time.sleep(0.05 * rank)
        bufs = [np.full(256, rank + 1, np.float32) for _ in range(count)]
        handles = [hvd.allreduce_async_(b, op=hvd.Sum, name=f"progress.{trial}.{i}")
                   for i, b in enumerate(bufs)]
        time.sleep(0.5)
        done = sum(bool((b == want).all()) for b in bufs)
        c.check(done == count, f"trial {trial}: {done} of {count} results arrived without a "
                f"wait or poll")
        for h in handles:
            hvd.synchronize(h)
    # Inputs only the handle keeps alive survive until the op ran (a deferred burst runs them
    # at the wait): memory is churned before waiting.
    handles = [hvd.allreduce_async(np.full(999, rank + 1.0), op=hvd.Sum, name="tmp.ar"),
               hvd.allreduce_async_(np.full(999, rank + 1.0), op=hvd.Sum, name="tmp.ar_"),
               hvd.broadcast_async(np.full(999, rank + 1.0), 0, name="tmp.bc")]
    churn = [np.full(999, -7.0) for _ in range(200)]
    got = [hvd.synchronize(h) for h in handles]
    del churn
    c.check((got[0] == want).all() and (got[1] == want).all(), f"allreduce of temporaries: {got[:2]}")
    c.check((got[2] == 1.0).all(), f"broadcast of a temporary: {got[2]}")
    c.fields["overlap"] = os.environ.get("SPARK_HVD_OVERLAP", "auto")


def _engine_thread():
    deadline = time.monotonic() + 5  # the thread names itself once it runs
    while time.monotonic() < deadline:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "shvd-engine":
                    return int(tid)
        time.sleep(0.01)
    raise AssertionError("no shvd-engine thread")


def _last_cpu(tid):
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])  # field 39, "processor"


def shared_cpu(c, widen="1"):
    """Both ranks' engine threads start a large shared-memory allreduce on one CPU, as the
    scheduler's wake-up placement sometimes puts them. Rank 1's engine is pinned there; rank 0's
    may run anywhere (``widen=1``) and then moves off the shared CPU, leaving its affinity mask
    as it was. With both pinned (``widen=0``) they stay, and the allreduce still completes."""
    rank, size = hvd.rank(), hvd.size()
    cpus = sorted(os.sched_getaffinity(0))
    engine = _engine_thread()
    allowed = set(cpus) if widen == "1" and rank == 0 else {cpus[0]}
    last = []
    for trial in range(5):
        os.sched_setaffinity(engine, {cpus[0]})
        hvd.allreduce(np.zeros(1, np.float32), name=f"shared_cpu.settle.{trial}")  # runs there
        os.sched_setaffinity(engine, allowed)
        x = np.full(1 << 21, rank + 1, np.float32)  # 8 MiB: 16 pipeline chunks
        got = hvd.allreduce(x, op=hvd.Sum, name=f"shared_cpu.big.{trial}")
        last.append(_last_cpu(engine))
        c.check((got == sum(range(1, size + 1))).all(), f"allreduce result {got[:4]}")
        c.check(os.sched_getaffinity(engine) == allowed,
                f"engine affinity {sorted(os.sched_getaffinity(engine))}, want {sorted(allowed)}")
    c.fields["cpu"] = ",".join(map(str, last))
    c.fields["shared"] = cpus[0]
    c.fields["cpus"] = len(cpus)


# -- response cache -------------------------------------------------------------------------

def scoped_name_clash(c, rounds="3"):
    """A global tensor named like a process set's scoped name ('x (process set N)') shares its
    negotiation name with that set's 'x': every round must still be answered for the set it
    runs on, also when the response cache last answered the name for the other set. Ranks 0
    and 1 (the set) come late to each global round, so the others' cache ids arrive first."""
    rank, size = hvd.rank(), hvd.size()
    pair = hvd.add_process_set([0, 1])
    clash = f"x (process set {pair.process_set_id})"
    for rnd in range(int(rounds)):
        if rank < 2:
            time.sleep(0.3)
        got = hvd.allreduce(np.full(4, rank + 1, np.float32), name=clash, op=hvd.Sum)
        c.check(got.shape == (4,) and np.all(got == size * (size + 1) / 2),
                f"round {rnd}: global '{clash}' gave {got}")
        if rank < 2:
            got = hvd.allreduce(np.full(6, rank + 1, np.float32), name="x", op=hvd.Sum,
                                process_set=pair)
            c.check(got.shape == (6,) and np.all(got == 3), f"round {rnd}: set 'x' gave {got}")
        hvd.barrier()  # one name in flight on one set at a time: rounds do not overlap
    hvd.shutdown()


class FieldChecks(Checks):
    def __init__(self, rank):
        super().__init__(rank)
        self.fields = {}


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    c = FieldChecks(int(os.environ.get("SPARK_HVD_RANK", "0")))
    if mode != "reinit":
        hvd.init()
    globals()[mode](c, *args)
    c.finish(**c.fields)


if __name__ == "__main__":
    main()
