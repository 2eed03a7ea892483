"""The elastic sampler's index arithmetic (spark_hvd.common._elastic_sampler), framework-free:
a simulated job of in-process "ranks" that lose and gain members at random, fail mid-step
(before or after the step's allreduce completed on some survivors), restore and sync, over
several epochs. Every epoch, rank 0's committed model must hold every sample exactly once
(samples borrowed as padding count for the next epoch), the samples a lost rank committed
included; the ranks' shards are disjoint and complete; processed_num counts as Horovod's.
And TorchState / ObjectState commit, restore and sync at size 1 (one real rank through the
launcher). The states on 2-3 ranks and in elastic jobs: test_elastic_states.py."""

import random
from collections import Counter

import numpy as np
import pytest

from conftest import run_job
from spark_hvd.common._elastic_sampler import ElasticSamplerCore, check_fingerprints


class Worker:
    """One simulated process: its sampler, and its model as the samples trained on."""

    seq = 0

    def __init__(self, dataset_size, shuffle, seed):
        Worker.seq += 1
        self.wid = Worker.seq
        self.rank, self.size = 0, 1
        self.sampler = ElasticSamplerCore(dataset_size, shuffle, seed,
                                          placement=lambda: (self.rank, self.size))
        self.model, self.saved_model = Counter(), Counter()
        self.batch = 0  # batches of the current shard taken

    def shard(self, batch_size):
        """This rank's next batch, without fillers (repeats that pad the shards of a dataset
        smaller than the number of ranks: trained on, but outside the guarantee)."""
        part = self.sampler._partition
        first = self.batch * batch_size
        batch = part.indices(self.rank)[first:first + batch_size]
        positions = np.arange(first, first + len(batch)) * part.size + self.rank
        return batch[positions < part.real + part.borrowed]

    def commit(self):
        self.saved_model = Counter(self.model)
        self.sampler.save()

    def restore(self):
        self.model = Counter(self.saved_model)
        self.sampler.restore()
        self.batch = 0


def sync(workers):
    """What SamplerStateHandler.sync does, with the collectives done by hand: every rank's
    fingerprint checked (the same problems on every rank), then rank 0's progress loaded by
    all. The model comes from rank 0 too (as TorchState's sync broadcasts it)."""
    problems = check_fingerprints([w.sampler.fingerprint() for w in workers])
    if problems:
        raise ValueError("; ".join(problems))
    payload = workers[0].sampler.sync_payload()
    for w in workers:
        w.sampler.load_synced(payload)
        w.model = Counter(workers[0].model)
        w.batch = 0
    for w in workers:  # TorchState's sync counts as a commit
        w.commit()


def form(workers):
    """A new round: ranks in order, every sampler split again (State.reset)."""
    for r, w in enumerate(workers):
        w.rank, w.size = r, len(workers)
        w.sampler.reset()
        w.batch = 0


def check_shards(workers, dataset_size):
    """The ranks' shards: every rank computed the same split, of equal lengths, holding this
    epoch's unprocessed samples each exactly once, padded with distinct samples of the next
    epoch (fillers only when the next epoch has none left to lend: a dataset about as small as
    the number of ranks)."""
    part = workers[0].sampler._partition
    for w in workers:
        assert np.array_equal(w.sampler._partition.order, part.order)
    shards = [w.sampler.shard() for w in workers]
    assert len({len(s) for s in shards}) == 1
    assert sorted(np.concatenate(shards).tolist()) == sorted(part.order.tolist())
    unprocessed = set(range(dataset_size)) - set(np.flatnonzero(part.done).tolist())
    assert sorted(workers[0].sampler.remaining_indices) == sorted(unprocessed)
    borrowed = part.order[part.real:part.real + part.borrowed]
    assert len(set(borrowed.tolist())) == len(borrowed)
    assert not part.ahead[borrowed].any()
    if part.real + part.borrowed < len(part.order):  # fillers only once nothing is left to lend
        assert part.borrowed == dataset_size - np.count_nonzero(part.ahead), "needless fillers"


def committed_counts(worker, dataset_size):
    return np.array([worker.saved_model[i] for i in range(dataset_size)])


def run_simulation(rng, dataset_size, batch_size, epochs, start_size, max_size, shuffle=True,
                   commit_every=2, p_event=0.15):
    """Trains ``epochs`` epochs with random failures, removals and additions; returns the
    number of events of each kind."""
    workers = [Worker(dataset_size, shuffle, seed=7) for _ in range(start_size)]
    form(workers)
    sync(workers)
    events = Counter()
    epoch = 0
    while epoch < epochs:
        check_shards(workers, dataset_size)
        steps = -(-len(workers[0].sampler) // batch_size)
        while workers[0].batch < steps:
            event = rng.random()
            if event < p_event and len(workers) > 1:
                workers = fail(rng, workers, batch_size, commit_every, max_size, events)
                check_shards(workers, dataset_size)
                steps = -(-len(workers[0].sampler) // batch_size)
                continue
            if event < 2 * p_event:
                workers = interrupt(rng, workers, dataset_size, shuffle, max_size, events)
                check_shards(workers, dataset_size)
                steps = -(-len(workers[0].sampler) // batch_size)
                continue
            step(workers, batch_size)
            if workers[0].batch % commit_every == 0:
                for w in workers:
                    w.commit()
        # End of the epoch, as Horovod's examples: set_epoch(epoch + 1) then commit.
        epoch += 1
        for w in workers:
            w.sampler.set_epoch(epoch)
            w.batch = 0
            w.commit()
        borrowed = np.unpackbits(workers[0].sampler.state_dict()["done"],
                                 count=dataset_size).astype(int)
        counts = committed_counts(workers[0], dataset_size)
        assert np.array_equal(counts, epoch + borrowed), (
            f"after epoch {epoch - 1}: samples trained on other than once: "
            f"{np.flatnonzero(counts != epoch + borrowed)[:20]} "
            f"counts {counts[counts != epoch + borrowed][:20]}")
        assert workers[0].sampler.processed_num == int(borrowed.sum())
    return events


def step(workers, batch_size):
    """Every rank trains on its next batch; the update (all ranks' samples) reaches every
    model (the allreduce); processed_num grows by batch_size * size as Horovod's until the
    epoch's samples run out."""
    update = Counter()
    before = workers[0].sampler.processed_num
    for w in workers:
        update.update(w.shard(batch_size).tolist())
    for w in workers:
        w.model.update(update)
        w.sampler.record_batch(w.batch, batch_size)
        w.batch += 1
    part = workers[0].sampler._partition
    expected = min(before + batch_size * len(workers), part.done_count + part.real)
    assert all(w.sampler.processed_num == expected for w in workers)


def fail(rng, workers, batch_size, commit_every, max_size, events):
    """A rank dies during a step. Either no survivor completed that step (the allreduce
    failed everywhere), or some completed it and committed before the failure reached them,
    so survivors restore different commits and rank 0's wins at sync."""
    victim = rng.randrange(len(workers))
    survivors = [w for i, w in enumerate(workers) if i != victim]
    if rng.random() < 0.5:
        events["fail_before_allreduce"] += 1
    else:
        events["fail_after_allreduce"] += 1
        update = Counter()
        for w in workers:  # the victim's samples are in this step's update too
            update.update(w.shard(batch_size).tolist())
        ahead = [w for w in survivors if rng.random() < 0.5]
        for w in ahead:
            w.model.update(update)
            w.sampler.record_batch(w.batch, batch_size)
            w.batch += 1
            w.commit()
    for w in survivors:
        w.restore()
    newcomers = [Worker(workers[0].sampler.dataset_size, workers[0].sampler.shuffle, 7)
                 for _ in range(rng.randrange(0, max_size - len(survivors) + 1))]
    events["added"] += len(newcomers)
    workers = survivors + newcomers
    form(workers)
    sync(workers)  # after a failure every round syncs
    return workers


def interrupt(rng, workers, dataset_size, shuffle, max_size, events):
    """Hosts changed: every rank commits and leaves at the same commit (no restore); some
    ranks are removed, some added. Without newcomers the driver may skip the sync."""
    for w in workers:
        w.commit()
    removed = rng.randrange(0, len(workers)) if rng.random() < 0.5 else 0
    keep = sorted(rng.sample(range(len(workers)), len(workers) - removed))
    survivors = [workers[i] for i in keep]
    room = max_size - len(survivors)
    newcomers = [Worker(dataset_size, shuffle, 7) for _ in range(rng.randrange(0, room + 1))]
    events["removed"] += removed
    events["added"] += len(newcomers)
    workers = survivors + newcomers
    form(workers)
    if newcomers or rng.random() < 0.5:
        sync(workers)
        events["interrupt_sync"] += 1
    else:
        events["interrupt_no_sync"] += 1
    return workers


@pytest.mark.parametrize("seed", range(12))
def test_every_sample_once_per_epoch_across_resets(seed):
    rng = random.Random(seed)
    dataset_size = rng.choice([37, 64, 101, 250])
    events = run_simulation(rng, dataset_size, batch_size=rng.choice([1, 3, 4]), epochs=4,
                            start_size=rng.randrange(1, 6), max_size=6,
                            shuffle=seed % 3 != 0)
    assert sum(events.values()) > 0


def test_events_all_happen():
    """Across the simulations every kind of event occurs (the test exercises what it says)."""
    total = Counter()
    for seed in range(12):
        rng = random.Random(seed)
        total += run_simulation(rng, 101, batch_size=3, epochs=3, start_size=3, max_size=5)
    for kind in ("fail_before_allreduce", "fail_after_allreduce", "added", "removed",
                 "interrupt_sync", "interrupt_no_sync"):
        assert total[kind] > 0, total


def test_tiny_dataset_more_ranks_than_samples():
    """Fewer samples than ranks: the shards stay equal by repeating samples (fillers, the one
    exception to "no duplicates"); every sample is still processed once apart from them."""
    run_simulation(random.Random(5), dataset_size=3, batch_size=1, epochs=3, start_size=5,
                   max_size=6)


def test_lost_rank_committed_samples_are_not_repeated():
    """Rank 2 of 3 dies after a commit: its committed samples are in the survivors' progress
    without any message from it, and the survivors' new shards exclude them."""
    workers = [Worker(30, True, 1) for _ in range(3)]
    form(workers)
    sync(workers)
    for _ in range(2):
        step(workers, 2)
    for w in workers:
        w.commit()
    lost_samples = set(workers[2].sampler.shard()[:4].tolist())
    step(workers, 2)  # not committed: redone
    survivors = workers[:2]
    for w in survivors:
        w.restore()
    form(survivors)
    left = set(np.concatenate([w.sampler.shard() for w in survivors]).tolist())
    assert not lost_samples & left
    assert survivors[0].sampler.processed_num == 12
    assert len(left) == 30 - 12


def test_padding_borrows_from_the_next_epoch():
    """10 samples on 3 ranks: 2 borrowed from the next epoch's order (not a repeat of this
    epoch's), and the next epoch starts with them processed."""
    workers = [Worker(10, True, 3) for _ in range(3)]
    form(workers)
    part = workers[0].sampler._partition
    assert (part.real, part.borrowed, part.per_rank) == (10, 2, 4)
    borrowed = part.order[10:].tolist()
    assert len(set(borrowed)) == 2
    for _ in range(4):
        step(workers, 1)
    for w in workers:
        w.sampler.set_epoch(1)
    assert workers[0].sampler.processed_num == 2
    assert sorted(workers[0].sampler.remaining_indices) == sorted(set(range(10)) - set(borrowed))


def test_uneven_record_batch_raises_on_every_rank():
    """Rank 1 records a batch more than the others: the sync's check names it, on every
    rank (each computes the same problems from the same fingerprints)."""
    workers = [Worker(40, True, 0) for _ in range(3)]
    form(workers)
    sync(workers)
    step(workers, 2)
    workers[1].sampler.record_batch(9, 2)
    for w in workers:
        w.commit()
    fingerprints = [w.sampler.fingerprint() for w in workers]
    problems = check_fingerprints(fingerprints)
    assert problems and "rank 1 recorded other progress" in problems[0]
    assert "record_batch" in problems[-1]


def test_newcomer_and_lagging_survivor_are_not_flagged():
    """A fresh newcomer, or a survivor one commit ahead of rank 0, is not an error."""
    workers = [Worker(40, True, 0) for _ in range(2)]
    form(workers)
    sync(workers)
    step(workers, 2)
    workers[1].commit()
    fresh = Worker(40, True, 0)
    assert check_fingerprints([w.sampler.fingerprint() for w in workers + [fresh]]) == []


def test_other_dataset_or_seed_raises():
    a, b = ElasticSamplerCore(10, True, 0, lambda: (0, 2)), ElasticSamplerCore(
        11, True, 0, lambda: (1, 2))
    assert "dataset of 11 samples" in check_fingerprints([a.fingerprint(), b.fingerprint()])[0]
    c = ElasticSamplerCore(10, True, 1, lambda: (1, 2))
    assert "seed=1" in check_fingerprints([a.fingerprint(), c.fingerprint()])[0]


def test_horovod_counts_at_size_one():
    """The sequence Horovod's test_torch_elastic.py asserts, on the core."""
    s = ElasticSamplerCore(8, True, 0, lambda: (0, 1))
    for epoch in range(2):
        s.set_epoch(epoch)
        for i in range(4):
            s.record_batch(i, 2)
            assert s.processed_num == 2 * (i + 1)
    assert list(s) == list(s) and len(list(s)) == 8  # iterating again: the same shard
    assert s.processed_num == len(s)
    s.set_epoch(2)
    assert s.processed_num == 0
    s.record_batch(0, 2), s.record_batch(1, 2)
    s.save()
    s.record_batch(2, 2), s.record_batch(3, 2)
    assert s.processed_num == 8
    s.restore()
    assert s.processed_num == 4
    s.record_batch(2, 2)
    s.save()
    s.load_synced(s.sync_payload())
    assert s.processed_num == 6 and len(s) == 2
    s.set_epoch(3)
    assert len(s) == 8


def test_set_epoch_same_epoch_keeps_progress():
    s = ElasticSamplerCore(20, True, 0, lambda: (0, 2))
    s.record_batch(0, 3)
    s.set_epoch(0)
    assert s.processed_num == 6 and len(s) == 7


def test_state_dict_round_trip_and_horovod_form():
    s = ElasticSamplerCore(50, True, 4, lambda: (1, 3))
    s.set_epoch(2)
    s.record_batch(0, 5)
    d = s.state_dict()
    assert d["epoch"] == 2 and d["processed_num"] == 15
    t = ElasticSamplerCore(50, True, 4, lambda: (0, 2))
    t.load_state_dict(d)
    assert t.processed_num == 15 and len(t) == 18
    assert not set(t.indices) & set(s.indices[:5])
    h = ElasticSamplerCore(50, True, 4, lambda: (0, 1))
    h.load_state_dict({"epoch": 2, "processed_num": 10})  # a Horovod checkpoint
    assert h.processed_num == 10 and h.remaining_indices == s.remaining_indices[10:]
    with pytest.raises(ValueError, match="dataset of 50 samples"):
        ElasticSamplerCore(40, True, 4, lambda: (0, 1)).load_state_dict(d)


def test_commit_copies_nothing():
    """record_batch and save() allocate no per-sample memory: 50 commits of a 1M-sample
    sampler allocate less than one bitmap would (NumPy reports its buffers to tracemalloc)."""
    import tracemalloc
    s = ElasticSamplerCore(1_000_000, True, 0, lambda: (0, 4))
    tracemalloc.start()
    try:
        for i in range(50):
            s.record_batch(i, 32)
            s.save()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000, peak
    s.restore()  # the fold happens here, once
    assert s.processed_num == 50 * 32 * 4


@pytest.mark.timeout(60)
def test_torch_and_object_state_at_size_one():
    """TorchState (model, optimizer, LR scheduler, grad scaler, plain values changed in place,
    a handler written for Horovod) and ObjectState: commit, restore and sync at size 1
    (tests/workers/elastic_states.py, mode size1)."""
    run_job(1, "elastic_states", "size1", timeout=50).assert_ok(1)
