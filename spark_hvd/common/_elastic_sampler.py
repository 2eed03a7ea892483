"""The index arithmetic behind ``hvd.elastic.ElasticSampler``, framework-free (NumPy only).

Goal: within an epoch every sample is trained on exactly once with respect to the committed
model, however ranks come and go, and without any communication at commit time.

How: the ranks advance in lockstep (each calls ``record_batch`` once per step with the same
batch size), so every rank can compute what *every* rank has processed. A :class:`Partition`
splits the epoch's not yet processed samples over the ranks (rank ``r`` takes positions
``r, r + size, r + 2 * size, ...``), so the first ``cursor`` samples of every rank are exactly
the first ``cursor * size`` positions of the partition. At a reset the partition is folded: those
positions are marked processed in a bitmap, and the rest is split again over the new ranks.
A rank that is lost after a commit had its committed samples marked by every survivor too.

Padding: when the remaining samples do not divide evenly, the tail is filled with samples
*borrowed from the next epoch's permutation* (those already processed in this epoch first, so a
step rarely sees one sample twice) instead of repeating this epoch's samples; they are kept in
a second bitmap (``ahead``) and count as processed when the next epoch begins. Only when the
next epoch has no sample left to lend (a dataset about as small as the number of ranks) do
fillers repeat a sample (not counted anywhere).

A sync sends rank 0's bitmaps to everyone; a fingerprint of each rank's progress, compared
before, catches ranks that called ``record_batch`` unevenly (progress would otherwise be lost
silently) and datasets of different lengths.
"""

import hashlib

import numpy as np


def permutation(num_samples, shuffle, seed, epoch):
    """The order of an epoch's samples (the same on every rank)."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    order = np.random.default_rng(seed + epoch).permutation(num_samples)
    return order.astype(np.int64, copy=False)


class Partition:
    """One split of an epoch's unprocessed samples over ``size`` ranks; never modified.

    ``order`` holds ``per_rank * size`` sample indices: ``real`` samples of the epoch, then
    ``borrowed`` samples of the next epoch, then fillers. ``done`` and ``ahead`` are the
    bitmaps (over the dataset) of the epoch's processed samples and of the next epoch's
    borrowed ones when the partition was made.
    """

    __slots__ = ("epoch", "size", "rank", "order", "real", "borrowed", "per_rank", "done",
                 "ahead", "done_count")

    def __init__(self, epoch, size, rank, done, ahead, order, real, borrowed):
        self.epoch, self.size, self.rank = epoch, size, rank
        self.done, self.ahead = done, ahead
        self.done_count = int(np.count_nonzero(done))
        self.order, self.real, self.borrowed = order, real, borrowed
        self.per_rank = len(order) // size if size else 0

    @classmethod
    def make(cls, epoch, size, rank, done, ahead, perms):
        """Splits the samples not in ``done`` (in the epoch's order) over ``size`` ranks,
        padding from the next epoch; ``perms(epoch)`` gives an epoch's permutation."""
        this = perms(epoch)
        remaining = this[~done[this]]
        per_rank = -(-len(remaining) // size)
        pad = per_rank * size - len(remaining)
        borrowed = np.empty(0, np.int64)
        if pad:
            following = perms(epoch + 1)
            free = following[~ahead[following]]
            # Samples this epoch already processed first: a step then rarely holds one sample
            # twice (as this epoch's and as the next one's).
            free = np.concatenate([free[done[free]], free[~done[free]]])
            borrowed = free[:pad]
        filler = np.resize(remaining, pad - len(borrowed))  # only when the dataset is tiny
        order = np.concatenate([remaining, borrowed, filler]).astype(np.int64, copy=False)
        return cls(epoch, size, rank, done, ahead, order, len(remaining), len(borrowed))

    def indices(self, rank=None):
        """The samples of ``rank`` (default: this rank), in the order it processes them."""
        return self.order[self.rank if rank is None else rank::self.size]

    def processed(self, cursor):
        """How many of the epoch's samples are processed once every rank has processed its
        first ``cursor`` samples."""
        return self.done_count + min(min(cursor, self.per_rank) * self.size, self.real)

    def fold(self, cursor):
        """``(done, ahead)`` bitmaps once every rank has processed its first ``cursor``
        samples (new arrays: a partition is never modified)."""
        seen = min(cursor, self.per_rank) * self.size
        done, ahead = self.done.copy(), self.ahead.copy()
        done[self.order[:min(seen, self.real)]] = True
        ahead[self.order[self.real:min(seen, self.real + self.borrowed)]] = True
        return done, ahead


def _digest(*arrays):
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        h.update(np.packbits(a).tobytes())
    return h.hexdigest()


class ElasticSamplerCore:
    """Horovod's ``ElasticSampler`` semantics, made exact (see the module docstring).

    Args:
        num_samples: the dataset's length (the same on every rank).
        shuffle: a new permutation every epoch (seeded by ``seed + epoch``).
        seed: the same on every rank.
        placement: ``() -> (rank, size)`` of this process now.
    """

    def __init__(self, num_samples, shuffle=True, seed=0, placement=None):
        self.dataset_size = int(num_samples)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self._placement = placement
        self._perms = {}
        self.epoch = 0
        self._cursor = 0        # samples per rank recorded since the partition was made
        self._commits = 0       # save() calls: ranks compared at sync must agree on it
        self._has_state = False  # synced or loaded once: a fresh newcomer is not compared
        empty = np.zeros(self.dataset_size, bool)
        self._partition = self._split(0, empty, empty)
        self._saved = self._snapshot()

    # -- what the user calls -------------------------------------------------------------

    @property
    def processed_num(self):
        """Samples of this epoch processed so far by all ranks together (Horovod's counter:
        ``record_batch`` adds ``batch_size * size`` until the epoch's samples run out)."""
        return self._partition.processed(self._cursor)

    @property
    def num_replicas(self):
        return self._partition.size

    @property
    def rank(self):
        return self._partition.rank

    @property
    def num_samples(self):
        """Samples per rank in the current partition (``len(sampler)``)."""
        return self._partition.per_rank

    @property
    def total_size(self):
        return self._partition.per_rank * self._partition.size

    @property
    def remaining_indices(self):
        """This epoch's samples not processed when the current partition was made, in order."""
        return self._partition.order[:self._partition.real].tolist()

    def record_batch(self, batch_idx, batch_size):
        """Records that every rank processed ``batch_size`` more samples (call it once per step
        on every rank, with the same ``batch_size``). ``batch_idx`` is unused, as in Horovod."""
        del batch_idx
        self._cursor += int(batch_size)

    def set_epoch(self, epoch):
        """Moves to ``epoch``: the next epoch starts with the samples the previous one borrowed
        as padding already processed; any other epoch starts from scratch. Setting the current
        epoch again keeps its progress, so calling ``set_epoch(epoch)`` at the start of every
        epoch (as with ``DistributedSampler``) is safe after a reset."""
        epoch = int(epoch)
        if epoch == self.epoch:
            self.reset()
            return
        _, ahead = self._partition.fold(self._cursor)
        done = ahead if epoch == self.epoch + 1 else np.zeros(self.dataset_size, bool)
        self.epoch = epoch
        self._repartition(done, np.zeros(self.dataset_size, bool))

    def reset(self):
        """Splits what is left of the epoch over the current ranks (after every reset)."""
        self._repartition(*self._partition.fold(self._cursor))

    def shard(self):
        """This rank's samples in the current split (a NumPy array)."""
        return self._partition.indices()

    @property
    def indices(self):
        """This rank's samples in the current split, as a list (Horovod's attribute)."""
        return self.shard().tolist()

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return self._partition.per_rank

    # -- commit / restore / sync (the state handlers call these) -------------------------

    def save(self):
        """Keeps the current progress (O(1): a partition is never modified)."""
        self._commits += 1
        self._saved = self._snapshot()

    def restore(self):
        """Back to the last saved progress, split again over the same ranks (no collective:
        this runs after a peer was lost)."""
        (self.epoch, self._partition, self._cursor, self._commits,
         self._has_state) = self._saved
        done, ahead = self._partition.fold(self._cursor)
        p = self._partition
        self._partition = self._split(self.epoch, done, ahead, rank=p.rank, size=p.size)
        self._cursor = 0

    def fingerprint(self):
        """What :func:`check_fingerprints` compares across the ranks before a sync."""
        done, ahead = self._partition.fold(self._cursor)
        return {"config": (self.dataset_size, self.shuffle, self.seed),
                "has_state": self._has_state, "commits": self._commits, "epoch": self.epoch,
                "progress": _digest(done, ahead), "processed": self.processed_num}

    def sync_payload(self):
        """Rank 0's progress as every rank loads it (:meth:`load_synced`)."""
        done, ahead = self._partition.fold(self._cursor)
        return {"epoch": self.epoch, "commits": self._commits, "done": np.packbits(done),
                "ahead": np.packbits(ahead)}

    def load_synced(self, payload):
        """Takes rank 0's progress (:meth:`sync_payload`) and splits it over the ranks."""
        self.epoch = int(payload["epoch"])
        self._commits = int(payload["commits"])
        self._has_state = True
        self._repartition(self._unpack(payload["done"]), self._unpack(payload["ahead"]))

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self):
        """Horovod's keys (``epoch``, ``processed_num``) plus the exact progress."""
        payload = self.sync_payload()
        return {"epoch": self.epoch, "processed_num": self.processed_num,
                "dataset_size": self.dataset_size, "done": payload["done"],
                "ahead": payload["ahead"]}

    def load_state_dict(self, state_dict):
        """Loads :meth:`state_dict`; a Horovod state dict (``epoch`` and ``processed_num``
        only) marks the first ``processed_num`` samples of the epoch's order processed, as
        Horovod did."""
        self.epoch = int(state_dict["epoch"])
        self._has_state = True
        if "done" in state_dict:
            if int(state_dict.get("dataset_size", self.dataset_size)) != self.dataset_size:
                raise ValueError(f"ElasticSampler.load_state_dict: the state is of a dataset of "
                                 f"{state_dict['dataset_size']} samples, this sampler's has "
                                 f"{self.dataset_size}")
            done, ahead = self._unpack(state_dict["done"]), self._unpack(state_dict["ahead"])
        else:
            done = np.zeros(self.dataset_size, bool)
            done[self._perm(self.epoch)[:int(state_dict["processed_num"])]] = True
            ahead = np.zeros(self.dataset_size, bool)
        self._repartition(done, ahead)

    # -- internals -------------------------------------------------------------------------

    def _snapshot(self):
        return (self.epoch, self._partition, self._cursor, self._commits, self._has_state)

    def _unpack(self, packed):
        return np.unpackbits(np.asarray(packed, np.uint8), count=self.dataset_size).astype(bool)

    def _perm(self, epoch):
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # this epoch's and the next one's are what is asked for
                self._perms.pop(min(self._perms))
            self._perms[epoch] = permutation(self.dataset_size, self.shuffle, self.seed, epoch)
        return self._perms[epoch]

    def _split(self, epoch, done, ahead, rank=None, size=None):
        if size is None:
            rank, size = self._placement()
        return Partition.make(epoch, size, rank, done, ahead, self._perm)

    def _repartition(self, done, ahead):
        self._partition = self._split(self.epoch, done, ahead)
        self._cursor = 0


def check_fingerprints(fingerprints):
    """Problems (strings) in every rank's :meth:`ElasticSamplerCore.fingerprint`, rank 0's
    first: the same on every rank, so every rank raises together. A rank with no state yet (a
    newcomer) or a different commit count (a survivor that committed one step more than rank 0
    before a peer was lost) only needs the same dataset and seed."""
    root = fingerprints[0]
    problems = []
    for r, fp in enumerate(fingerprints[1:], start=1):
        if fp["config"] != root["config"]:
            problems.append(f"rank {r} samples a dataset of {fp['config'][0]} samples "
                            f"(shuffle={fp['config'][1]}, seed={fp['config'][2]}), rank 0 "
                            f"one of {root['config'][0]} (shuffle={root['config'][1]}, "
                            f"seed={root['config'][2]})")
        elif (root["has_state"] and fp["has_state"] and fp["commits"] == root["commits"]
              and (fp["epoch"], fp["progress"]) != (root["epoch"], root["progress"])):
            problems.append(f"rank {r} recorded other progress than rank 0 after the same "
                            f"number of commits (epoch {fp['epoch']}, {fp['processed']} samples "
                            f"processed; rank 0: epoch {root['epoch']}, {root['processed']})")
    if problems:
        problems.append("every rank must call record_batch(batch_idx, batch_size) once per step "
                        "with the same batch_size, and set_epoch at the same points")
    return problems
