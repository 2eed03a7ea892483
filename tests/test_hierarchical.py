"""Hierarchical allreduce and allgather (native/algorithms/hierarchical.h) on two simulated
hosts (ranks on 127.0.0.1 and 127.0.0.2: distinct host ids, TCP between them, shared memory
within each), through the real launcher: exact results, bitwise equal on every rank, with the
setting forced on, off or left automatic, also where hosts hold different numbers of ranks.
Rank 0's timeline names the path and its steps."""

import pytest

from conftest import load_timeline, run_job

HIERARCHICAL = ("HIERARCHICAL_ALLREDUCE", "HIERARCHICAL_ALLGATHER")
ALLREDUCE_STEPS = ["INTRA_HOST_REDUCESCATTER", "CROSS_HOST_ALLREDUCE", "INTRA_HOST_ALLGATHER"]
ALLGATHER_STEPS = ["INTRA_HOST_ALLGATHER", "CROSS_HOST_ALLGATHER", "INTRA_HOST_SHARE"]


def _begun(timeline):
    """{"<op>.<tensor>": [phase begun, ...]} in the order rank 0 recorded them."""
    return {t: [p for ph, p in seq if ph == "B"] for t, seq in load_timeline(timeline).items()}


def _path(phases):
    """The algorithm that ran: the engine names it after the op's steps."""
    names = [p for p in phases if p.endswith(("_ALLREDUCE", "_ALLGATHER"))
             and p not in ALLREDUCE_STEPS + ALLGATHER_STEPS and not p.startswith("NEGOTIATE_")]
    return names[-1] if names else None


@pytest.mark.timeout(300)
def test_every_collective_forced_on(tmp_path):
    """The whole collectives matrix (every dtype, op, prescale/postscale, fused groups,
    uneven allgather, 8M-element cases, static subsets) on 2 hosts x 2 ranks with both settings
    forced on: correct and bitwise identical everywhere (the worker compares digests); the
    global set's allreduces and allgathers ran hierarchical with their three steps in order,
    and so did the subsets' (2 + 1 ranks: one lane)."""
    timeline = tmp_path / "timeline.json"
    r = run_job(4, "collectives", "--sets", "static", "--large", transport="hosts",
                env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "SPARK_HVD_HIERARCHICAL_ALLGATHER": "1",
                     "SPARK_HVD_TIMELINE": timeline}, timeout=280)
    r.assert_ok(4)
    begun = _begun(timeline)
    ar = begun["allreduce.global/large/ar_f32"]
    assert _path(ar) == "HIERARCHICAL_ALLREDUCE", ar
    assert [p for p in ar if p in ALLREDUCE_STEPS] == ALLREDUCE_STEPS, ar
    ag = begun["allgather.global/large/ag"]
    assert _path(ag) == "HIERARCHICAL_ALLGATHER", ag
    assert [p for p in ag if p in ALLGATHER_STEPS] == ALLGATHER_STEPS, ag
    subset = {_path(seq) for t, seq in begun.items()
              if isinstance(t, str) and t.split(".", 1)[1].startswith("set0/")}
    assert set(HIERARCHICAL) <= subset, subset


# How each setting is given: launcher flags, Horovod's variables, nothing.
MODES = {"on": ({}, ["--hierarchical-allreduce", "--hierarchical-allgather"]),
         "off": ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0", "HOROVOD_HIERARCHICAL_ALLGATHER": "0"},
                 []),
         "auto": ({}, [])}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", list(MODES))
def test_settings(tmp_path, mode):
    """Sum, Max and Average with prescale/postscale from 1 element to 16 MiB, 20 fused small
    tensors and an allgather, exact and bitwise equal on 4 ranks over 2 hosts, under each
    setting. On: every allreduce and the allgather hierarchical. Off: none. Automatic: the
    latency-bound allreduces by recursive doubling, the rest and the allgather
    hierarchical."""
    env, flags = MODES[mode]
    timeline = tmp_path / "timeline.json"
    r = run_job(4, "hierarchical", "check", transport="hosts", launcher_args=flags,
                env={**env, "SPARK_HVD_TIMELINE": timeline}, timeout=180)
    r.assert_ok(4)
    paths = {t: _path(seq) for t, seq in _begun(timeline).items()}
    small, large = paths["allreduce.sum_3"], paths["allreduce.sum_4194305"]
    fused, gather = paths["allreduce.fused_0"], paths["allgather.gather"]
    if mode == "on":
        assert (small, large, fused, gather) == ("HIERARCHICAL_ALLREDUCE",) * 3 + (
            "HIERARCHICAL_ALLGATHER",), paths
        assert paths["allgather.gather_big"] == "HIERARCHICAL_ALLGATHER", paths
    elif mode == "off":
        assert not set(paths.values()) & set(HIERARCHICAL), paths
        assert large == "RING_ALLREDUCE" and gather == "RING_ALLGATHER", paths
    else:
        assert (small, large, gather) == ("RECURSIVE_DOUBLING_ALLREDUCE",
                                          "HIERARCHICAL_ALLREDUCE",
                                          "HIERARCHICAL_ALLGATHER"), paths


@pytest.mark.timeout(200)
@pytest.mark.parametrize("hosts", ["127.0.0.1:3,127.0.0.2:1", "127.0.0.1:2,127.0.0.2:1"])
def test_uneven_hosts(tmp_path, hosts):
    """Hosts with different numbers of ranks (3 + 1, 2 + 1), setting automatic: one lane (the
    first rank of each host crosses; the others reduce and share within their host), the same
    exact, bitwise equal results, hierarchical where bandwidth-bound."""
    np_ = sum(int(h.rsplit(":", 1)[1]) for h in hosts.split(","))
    timeline = tmp_path / "timeline.json"
    r = run_job(np_, "hierarchical", "check", hosts=hosts,
                env={"SPARK_HVD_TIMELINE": timeline}, timeout=180)
    r.assert_ok(np_)
    paths = {t: _path(seq) for t, seq in _begun(timeline).items()}
    assert paths["allreduce.sum_4194305"] == "HIERARCHICAL_ALLREDUCE", paths
    assert paths["allreduce.sum_3"] == "RECURSIVE_DOUBLING_ALLREDUCE", paths
    assert paths["allgather.gather"] == "HIERARCHICAL_ALLGATHER", paths


@pytest.mark.timeout(240)
@pytest.mark.parametrize("hosts,arena_ranks", [
    ("127.0.0.1:2,127.0.0.2:2", None),       # every host in place
    ("127.0.0.1:2,127.0.0.2:2", "0,1,2"),    # host 2 has a rank in ordinary memory: it packs
    ("127.0.0.1:3,127.0.0.2:1", None),       # one lane; ranks 1, 2 only share; host 2 alone
])
def test_within_hosts_in_shared_arenas(tmp_path, hosts, arena_ranks):
    """Arrays in the core's shared arenas on 2 hosts: every dtype and op, fused and alone, in
    place and not, 4 KiB chunks; the hosts whose ranks all have them there reduce and share
    within the host in place (every rank of such a host counts in-place allreduces), a host
    with a rank in ordinary memory (or a host of one) packs them and pipes them, and the
    results are the same exact, bitwise equal ones either way (the same bytes cross between
    hosts)."""
    np_ = sum(int(h.rsplit(":", 1)[1]) for h in hosts.split(","))
    timeline = tmp_path / "timeline.json"
    env = {"SPARK_HVD_SHM_CHUNK_BYTES": 4096, "SPARK_HVD_TIMELINE": timeline}
    if arena_ranks:
        env["ARENA_RANKS"] = arena_ranks
    r = run_job(np_, "shared_arenas", "--mode", "numpy", hosts=hosts, env=env, timeout=220)
    r.assert_ok(np_)
    paths = {_path(seq) for t, seq in _begun(timeline).items() if t.startswith("allreduce.")}
    assert "HIERARCHICAL_ALLREDUCE" in paths, paths
    in_place = [int(r.field(rank, "inplace")) > 0 for rank in range(np_)]
    host_of = [i for i, h in enumerate(hosts.split(",")) for _ in range(int(h.split(":")[1]))]
    for rank in range(np_):
        host_ranks = [q for q in range(np_) if host_of[q] == host_of[rank]]
        expect = len(host_ranks) > 1 and (
            arena_ranks is None or all(str(q) in arena_ranks.split(",") for q in host_ranks))
        assert in_place[rank] == expect, (rank, in_place, r.describe())


@pytest.mark.timeout(200)
def test_gradients_in_shared_arenas_across_hosts(tmp_path):
    """DistributedOptimizer on 2 hosts x 2 ranks: its gradients (in the arenas) are reduced in
    place within each host, and the trained weights are bitwise equal on every rank and to the
    same job with SPARK_HVD_SHARED_GRADIENTS=0 (gradients packed and piped)."""
    runs = {}
    for shared in ("1", "0"):
        r = run_job(4, "shared_arenas", "--mode", "torch", transport="hosts",
                    env={"SPARK_HVD_SHARED_GRADIENTS": shared,
                         "SPARK_HVD_HIERARCHICAL_ALLREDUCE": "1"}, timeout=90)
        r.assert_ok(4)
        runs[shared] = r
    for rank in range(4):
        assert int(runs["1"].field(rank, "inplace")) > 0, runs["1"].describe()
        assert int(runs["0"].field(rank, "inplace")) == 0, runs["0"].describe()
        assert runs["1"].field(rank, "weights") == runs["0"].field(rank, "weights")
