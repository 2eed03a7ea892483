"""Elastic training's logic without processes: hosts and the blacklist, the round planner, the
failure policy, and the driver's state machine run by hand with a fake spawner, channel and
clock (every path ends, in training or in an error naming its cause)."""

from __future__ import annotations

import random

import pytest

from spark_hvd.common import _elastic_protocol as proto
from spark_hvd.common._elastic_protocol import HostUpdateResult
from spark_hvd.launch.elastic import driver as drv
from spark_hvd.launch.elastic import planner
from spark_hvd.launch.elastic.hosts import (HostManager, HostState, parse_discovery_output,
                                            validate_cooldown_range)
from spark_hvd.launch.elastic.policy import (FAILED_MESSAGE, RESET_LIMIT_EXCEEDED_MESSAGE,
                                             Failure, FailurePolicy)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


# -- hosts ------------------------------------------------------------------------------------

def test_cooldown_doubles_and_hosts_come_back():
    clock = Clock()
    hm = HostManager(cooldown_range=(10, 600), clock=clock, rng=lambda: 0.0)
    assert hm.update({"a": 2, "b": 2}) == HostUpdateResult.added
    assert hm.current_hosts.host_assignment_order == ["a", "b"]
    hm.blacklist("b")
    assert hm.current_hosts.host_assignment_order == ["a"]
    assert hm.cooldown_left("b") == 20  # lower * 2**1
    assert hm.update({"a": 2, "b": 2}) == HostUpdateResult.no_update
    clock.advance(20)
    # Back at the first discovery after its cooldown, as an added host, in its old place.
    assert hm.update({"a": 2, "b": 2}) == HostUpdateResult.added
    assert hm.current_hosts.host_assignment_order == ["a", "b"]
    hm.blacklist("b")
    assert hm.cooldown_left("b") == 40  # doubles with each failure
    for _ in range(10):
        clock.advance(700)
        hm.update({"a": 2, "b": 2})
        hm.blacklist("b")
    assert hm.cooldown_left("b") == 600  # never beyond the upper limit


def test_host_order_keeps_older_hosts_first_and_reports_changes():
    hm = HostManager(clock=Clock())
    hm.update({"b": 1, "a": 1})
    assert hm.update({"a": 1, "c": 1, "b": 1}) == HostUpdateResult.added
    assert hm.current_hosts.host_assignment_order == ["b", "a", "c"]
    assert hm.update({"a": 1, "c": 1}) == HostUpdateResult.removed
    assert hm.update({"a": 2, "d": 1}) == HostUpdateResult.mixed
    assert hm.current_hosts.host_assignment_order == ["a", "d"]
    assert hm.update({"a": 1, "d": 1}) == HostUpdateResult.removed  # fewer slots


def test_cooldown_range_is_validated():
    assert validate_cooldown_range([1, 2]) == (1, 2)
    for bad in ([0, 5], [5, 4000], [9, 3]):
        with pytest.raises(ValueError):
            validate_cooldown_range(bad)
    assert HostState().cooldown_end == 0  # on by default, but nothing blacklisted yet


def test_discovery_output():
    assert parse_discovery_output("a:2\nb:1\n\n") == {"a": 2, "b": 1}
    assert parse_discovery_output("a\nb:3", default_slots=4) == {"a": 4, "b": 3}
    with pytest.raises(RuntimeError, match="slots-per-host"):
        parse_discovery_output("a")


# -- planner --------------------------------------------------------------------------------

def C(wid, host, seq, **kw):
    return planner.Candidate(wid, host, seq, **kw)


def test_planner_ranks_host_major_older_first_root_has_state():
    cands = [C("n1", "c", 5), C("s1", "b", 2, in_run=True, new=False),
             C("s0", "a", 1, in_run=True, new=False), C("s2", "b", 3, in_run=True, new=False)]
    plan = planner.plan_round(4, cands, ["a", "b", "c"])
    assert [m.wid for m in plan.members] == ["s0", "s1", "s2", "n1"]
    assert [(s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
            for s in plan.slots] == [("a", 0, 1, 0, 3), ("b", 0, 2, 1, 3), ("b", 1, 2, 0, 1),
                                     ("c", 0, 1, 2, 3)]
    assert plan.sync and plan.hosts() == [("a", 1), ("b", 2), ("c", 1)]
    # The first host's workers are all new: the host of the oldest one with state goes first.
    plan = planner.plan_round(5, [C("n", "a", 9), C("s", "b", 2, in_run=True, new=False)],
                              ["a", "b"])
    assert [m.wid for m in plan.members] == ["s", "n"]


def test_planner_sync_is_one_flag():
    same = dict(reason=proto.REASON_INTERRUPT, in_run=True, new=False, commit=(1, 7))
    assert not planner.needs_sync([C("a", "a", 1, **same), C("b", "b", 2, **same)])
    assert planner.needs_sync([C("a", "a", 1, **same), C("b", "b", 2, **{**same,
                                                                        "commit": (1, 6)})])
    assert planner.needs_sync([C("a", "a", 1, **same), C("n", "c", 3)])
    assert planner.needs_sync([C("a", "a", 1, **{**same, "reason": proto.REASON_FAILURE})])


def test_desired_slots_caps_at_max_np():
    assert planner.desired_slots(["a", "b", "c"], {"a": 2, "b": 2, "c": 2}, 3) == [
        ("a", 2), ("b", 1)]
    assert planner.desired_slots(["a", "b"], {"a": 2, "b": 2}) == [("a", 2), ("b", 2)]


# -- policy ---------------------------------------------------------------------------------

def test_policy_table():
    p = FailurePolicy(reset_limit=2, min_np=2, elastic_timeout=60)
    assert p.decide(Failure("user_error", "a", "boom")).action == "raise"
    assert FAILED_MESSAGE in p.decide(Failure("user_error", "a", "boom")).why
    assert p.decide(Failure("process_lost", "a", "x")).blacklist == ("a",)
    assert p.decide(Failure("internal", "a", "x")).blacklist == ()
    horovods = FailurePolicy(on_user_error="blacklist")
    assert horovods.decide(Failure("user_error", "a", "boom")).blacklist == ("a",)
    assert p.check_reset(2) is None
    assert p.check_reset(3).why == RESET_LIMIT_EXCEEDED_MESSAGE.format(2)
    assert p.check_capacity(2, None, 0, "") is None
    assert p.check_capacity(1, None, 0, "").action == "wait_for_hosts"
    assert p.check_capacity(1, 0, 60, "b lost").action == "raise"
    with pytest.raises(ValueError):
        p.decide(Failure("cosmic_ray", "a", ""))


# -- the driver, by hand ----------------------------------------------------------------------

class Spawner(drv.Spawner):
    def __init__(self):
        self.spawned, self.stopped = [], []

    def spawn(self, spec):
        self.spawned.append(spec)

    def stop(self, wid):
        self.stopped.append(wid)


class Channel(drv.Channel):
    def __init__(self):
        self.puts = {}

    def put(self, key, value):
        self.puts[key] = value

    def notices(self, wid):
        out, k = [], 0
        while proto.notice_key(wid, k) in self.puts:
            out.append(self.puts[proto.notice_key(wid, k)])
            k += 1
        return out


class Job:
    """A driver with fake parts, and the workers' side of the protocol as helpers."""

    def __init__(self, hosts, num_proc=2, min_np=None, max_np=None, reset_limit=None,
                 elastic_timeout=60.0, on_user_error="raise"):
        self.clock = Clock()
        self.hm = HostManager(cooldown_range=(10, 600), clock=self.clock, rng=lambda: 0.0)
        self.spawner, self.channel = Spawner(), Channel()
        self.log = []
        policy = FailurePolicy(on_user_error=on_user_error, reset_limit=reset_limit,
                               min_np=min_np or num_proc, elastic_timeout=elastic_timeout)
        self.d = drv.ElasticDriver(
            self.hm, self.spawner, self.channel, num_proc=num_proc, min_np=min_np or num_proc,
            max_np=max_np, policy=policy, elastic_timeout=elastic_timeout, start_timeout=30,
            join_grace=10, clock=self.clock, wall=self.clock,
            log=lambda m, level="INFO": self.log.append((level, m)))
        self.seqs = {}
        self.d.handle(("discovered", hosts))

    def wids(self):
        return [s.wid for s in self.spawner.spawned]

    def join(self, wid, reason="start", in_run=False, commit=(0, 0)):
        seq = self.seqs.get(wid, 0) + 1
        self.seqs[wid] = seq
        self.d.handle(("joined", wid, seq, {"addr": f"{wid} 1 h h", "reason": reason,
                                            "in_run": in_run, "commit": list(commit)}))
        self.d.tick()

    def answer(self, wid):
        return self.channel.puts.get(proto.assign_key(wid, self.seqs[wid]))

    def exit(self, wid, code=0):
        self.d.handle(("exited", wid, code, "exit"))
        self.d.tick()

    def finish(self, wids):
        for wid in wids:
            self.d.handle(("done", wid, {}))
        for wid in wids:
            self.exit(wid, 0)

    def start(self):
        for wid in self.wids():
            self.join(wid)
        assert self.d.state == drv.RUNNING, self.log
        return list(self.d.members)

    def elapse(self, seconds, step=1.0):
        end = self.clock.t + seconds
        while self.clock.t < end and self.d.state not in (drv.FINISHED, drv.ERRORED):
            self.clock.advance(step)
            self.d.tick()


def test_driver_happy_path_and_function_results():
    job = Job({"a": 1, "b": 1})
    assert [(s.host, s.planned.rank, s.planned.size) for s in job.spawner.spawned] == [
        ("a", 0, 2), ("b", 1, 2)]
    members = job.start()
    plan = job.channel.puts[proto.plan_key(1)]
    assert plan["size"] == 2 and plan["sync"] and plan["peers"] == [f"{w} 1 h h" for w in members]
    assert job.answer(members[1]) == {"round": 1, "rank": 1, "sync": True}
    job.finish(members)
    out = job.d.outcome()
    assert out.ok and out.members == members and out.resets == 0


def test_workers_that_never_join_finish_the_job():
    """spark_hvd.run's functions that never call init(): every process exits 0."""
    job = Job({"a": 2})
    for wid in job.wids():
        job.exit(wid, 0)
    out = job.d.outcome()
    assert out.ok and out.members == [] and sorted(out.spawn_ranks.values()) == [0, 1]


def test_lost_process_blacklists_its_host_and_survivors_reform():
    job = Job({"a": 1, "b": 1, "c": 1}, num_proc=3, min_np=2)
    a, b, c = job.start()
    job.exit(b, -9)
    assert job.d.state == drv.RESETTING and job.hm.is_blacklisted("b")
    for wid in (a, c):  # the survivors' core fails at once: abort pushed
        assert job.channel.notices(wid)[-1]["kind"] == "abort"
    job.join(a, "failure", in_run=True, commit=(1, 5))
    job.join(c, "failure", in_run=True, commit=(1, 5))
    assert job.d.state == drv.RUNNING and job.d.round == 2
    assert job.d.members == [a, c] and job.channel.puts[proto.plan_key(2)]["sync"]
    assert any("reset 1 (round 2): lost rank 1 on b was killed by signal 9" in m
               for _, m in job.log), job.log
    job.finish([a, c])
    assert job.d.outcome().ok and job.d.outcome().resets == 1


def test_user_error_ends_the_job_without_blacklisting():
    job = Job({"a": 1, "b": 1})
    a, b = job.start()
    job.d.handle(("error", b, {"kind": "user", "type": "ValueError", "message": "bad input",
                               "traceback": "Traceback ...\nValueError: bad input"}))
    assert job.d.state == drv.ERRORED
    assert FAILED_MESSAGE in job.d.error and "ValueError: bad input" in job.d.error
    assert "Traceback" in job.d.error and not job.hm.is_blacklisted("b")


def test_discovered_host_joins_at_the_next_reset_with_higher_ranks():
    job = Job({"a": 1, "b": 1}, num_proc=2, max_np=4)
    a, b = job.start()
    job.d.handle(("discovered", {"a": 1, "b": 1, "c": 2}))
    new = job.wids()[2:]
    assert [(s.host, s.planned.rank, s.planned.size) for s in job.spawner.spawned[2:]] == [
        ("c", 2, 4), ("c", 3, 4)]
    for wid in (a, b):
        notice = job.channel.notices(wid)[-1]
        assert notice["kind"] == "hosts_updated" and notice["update"] == HostUpdateResult.added
    for wid in new:
        job.join(wid)  # the newcomers wait for the members' interrupt
    assert job.d.state == drv.RUNNING and job.d.round == 1
    job.join(a, "interrupt", in_run=True, commit=(1, 3))
    job.join(b, "interrupt", in_run=True, commit=(1, 3))
    assert job.d.round == 2 and job.d.members == [a, b] + new
    plan = job.channel.puts[proto.plan_key(2)]
    assert plan["sync"] and plan["notice"] == 1  # newcomers: everybody syncs


def test_removed_host_leaves_and_the_rest_skips_the_sync():
    job = Job({"a": 1, "b": 1, "c": 1}, num_proc=3, min_np=2)
    a, b, c = job.start()
    job.d.handle(("discovered", {"a": 1, "c": 1}))
    assert job.channel.notices(b)[-1]["update"] == HostUpdateResult.removed
    for wid in (a, b, c):
        job.join(wid, "interrupt", in_run=True, commit=(1, 9))
    assert job.answer(b) == {"removed": "host b was removed by discovery"}
    job.exit(b, 0)
    assert job.d.round == 2 and job.d.members == [a, c]
    assert not job.channel.puts[proto.plan_key(2)]["sync"]
    assert not job.hm.is_blacklisted("b")


def test_below_min_np_waits_for_a_host_then_continues():
    job = Job({"a": 1, "b": 1}, num_proc=2, min_np=2, elastic_timeout=60)
    a, b = job.start()
    job.exit(b, -9)
    job.join(a, "failure", in_run=True)
    job.elapse(15)
    assert job.d.state == drv.RESETTING  # waiting, b in its 20 s cooldown
    job.elapse(6)
    job.d.handle(("discovered", {"a": 1, "b": 1}))  # b is back after its cooldown
    new = job.wids()[-1]
    assert new.startswith("b/") and new != b
    job.join(new)
    assert job.d.state == drv.RUNNING and job.d.members == [a, new]


def test_below_min_np_for_the_elastic_timeout_is_an_error_naming_the_loss():
    job = Job({"a": 1, "b": 1}, num_proc=2, min_np=2, elastic_timeout=60)
    a, b = job.start()
    job.exit(b, -9)
    job.join(a, "failure", in_run=True)
    job.elapse(120)
    assert job.d.state == drv.ERRORED
    assert "fewer than the minimum of 2" in job.d.error
    assert "rank 1 on b was killed by signal 9" in job.d.error
    assert job.d.error.startswith(FAILED_MESSAGE)


def test_reset_limit():
    job = Job({"a": 1, "b": 1, "c": 1}, num_proc=3, min_np=1, reset_limit=1)
    a, b, c = job.start()
    job.exit(c, -9)
    job.join(a, "failure", in_run=True)
    job.join(b, "failure", in_run=True)
    assert job.d.state == drv.RUNNING
    job.exit(b, -9)
    assert job.d.state == drv.ERRORED
    assert RESET_LIMIT_EXCEEDED_MESSAGE.format(1) in job.d.error


def test_a_worker_that_never_starts_is_dropped_after_the_start_timeout():
    job = Job({"a": 1, "b": 1}, num_proc=1, min_np=1, max_np=4)
    a, = [w for w in job.wids() if w.startswith("a/")]
    b, = [w for w in job.wids() if w.startswith("b/")]
    job.join(a)
    job.elapse(31)
    assert b in job.spawner.stopped and job.hm.is_blacklisted("b")
    assert job.d.state == drv.RUNNING and job.d.members == [a]


def test_frozen_member_gets_abort_then_is_declared_lost():
    """A member that does not rejoin gets the abort after the join grace (10 s) and is
    declared frozen at the rejoin timeout (60 s by default), long before the elastic
    timeout."""
    job = Job({"a": 1, "b": 1, "c": 1}, num_proc=3, min_np=2, elastic_timeout=600)
    a, b, c = job.start()
    job.join(a, "failure", in_run=True)  # a's core failed; b and c are told at once
    job.join(b, "failure", in_run=True)
    job.elapse(11)
    assert job.channel.notices(c)[-1]["kind"] == "abort"
    job.elapse(47)
    assert c not in job.spawner.stopped and job.d.state == drv.RESETTING
    job.elapse(3)
    assert c in job.spawner.stopped and job.hm.is_blacklisted("c")
    assert job.d.state == drv.RUNNING and job.d.members == [a, b]


def test_every_process_lost_is_an_error():
    job = Job({"a": 1, "b": 1}, num_proc=2, min_np=1, elastic_timeout=60)
    a, b = job.start()
    job.exit(a, -9)
    job.exit(b, -9)
    job.elapse(200)
    assert job.d.state == drv.ERRORED
    assert "a" in job.d.error and "b" in job.d.error


def test_loss_after_others_finished_is_an_error():
    job = Job({"a": 1, "b": 1})
    a, b = job.start()
    job.finish([a])
    job.exit(b, -9)
    assert job.d.state == drv.ERRORED and "had finished" in job.d.error


def test_first_discovery_failure_is_fatal_later_ones_are_retried():
    job = Job({"a": 1})
    job.d.handle(("discovery_failed", "boom"))
    assert job.d.state != drv.ERRORED
    fresh = drv.ElasticDriver(HostManager(), Spawner(), Channel(), num_proc=1, min_np=1,
                              max_np=None, policy=FailurePolicy(), elastic_timeout=60,
                              start_timeout=30)
    fresh.handle(("discovery_failed", "exit code 3"))
    assert fresh.state == drv.ERRORED and "exit code 3" in fresh.error


def test_too_few_slots_at_start_is_an_error_within_the_elastic_timeout():
    job = Job({"a": 1}, num_proc=2, elastic_timeout=60)
    job.elapse(61)
    assert job.d.state == drv.ERRORED and "fewer than the 2 requested" in job.d.error


@pytest.mark.parametrize("seed", range(60))
def test_every_path_ends(seed):
    """Random failures, discoveries and delays, then well-behaved workers: the driver always
    ends (FINISHED or ERRORED) within a bound of the fake clock."""
    rnd = random.Random(seed)
    hosts = ["a", "b", "c", "d"]
    job = Job({h: rnd.randint(1, 2) for h in hosts[:3]}, num_proc=2, min_np=rnd.randint(1, 2),
              max_np=rnd.choice([None, 3, 4]), reset_limit=rnd.choice([None, 3]),
              elastic_timeout=60)
    d = job.d
    exited, acted = set(), {}

    def behave(chaos):
        for spec in list(job.spawner.spawned):
            wid = spec.wid
            if wid in exited:
                continue
            if wid in job.spawner.stopped or (chaos and rnd.random() < 0.02):
                exited.add(wid)
                job.exit(wid, -15 if wid in job.spawner.stopped else rnd.choice([-9, 1]))
                continue
            answer = job.answer(wid) if wid in job.seqs else None
            if answer and ("removed" in answer or "finished" in answer or "error" in answer):
                exited.add(wid)
                job.exit(wid, 0 if "error" not in answer else 1)
                continue
            w = d.workers[wid]
            pending = w.join is not None
            notices = job.channel.notices(wid)
            if not pending and wid not in job.seqs:
                if not chaos or rnd.random() < 0.7:
                    job.join(wid)
            elif not pending and d.state == drv.RESETTING and w.member_round == d.round:
                if not chaos or rnd.random() < 0.7:
                    job.join(wid, "failure", in_run=True)
            elif not pending and len(notices) > acted.get(wid, 0) and d.state == drv.RUNNING:
                acted[wid] = len(notices)
                job.join(wid, "interrupt", in_run=True, commit=(d.round, 1))
            elif not chaos and d.state in (drv.RUNNING, drv.FINISHING) and \
                    w.member_round == d.round and not w.done:
                d.handle(("done", wid, {}))
                exited.add(wid)
                job.exit(wid, 0)

    for _ in range(60):  # chaos
        job.clock.advance(rnd.choice([0.1, 1, 5, 15]))
        if rnd.random() < 0.1:
            d.handle(("discovered", {h: rnd.randint(1, 2) for h in rnd.sample(hosts, 3)}))
        behave(chaos=True)
        d.tick()
        if d.state in (drv.FINISHED, drv.ERRORED):
            break
    limit = job.clock.t + 4 * 60 + 60
    while d.state not in (drv.FINISHED, drv.ERRORED):
        assert job.clock.t < limit, (d.state, job.log[-10:])
        job.clock.advance(1)
        if rnd.random() < 0.2:
            d.handle(("discovered", {h: 2 for h in hosts}))
        behave(chaos=False)
        d.tick()
    if d.state == drv.ERRORED:
        assert d.error  # it says why
