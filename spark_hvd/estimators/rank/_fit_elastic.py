"""The rank side of a fit that survives lost ranks in memory (TorchEstimator on
``spark_hvd.spark.run_elastic``): the epochs under ``hvd.elastic.run``, and what depends on a
rank's place in the job. Kept free of PySpark imports, like the rest of the rank's code.

The state (``TorchState``: the model, the optimizer, the next epoch, the history) is committed
at the end of every epoch. When ranks are lost, the others go back to the last epoch's end and
run the interrupted epoch again, whole, on the new set of ranks; a worker that joins (Spark ran
a lost task again) gets rank 0's state. So every epoch is trained once in the model that comes
back, and its history has one entry per epoch. After a reset each rank reads the shards of its
new (rank, size) (rank ``r`` of ``n`` reads the files ``i % n == r``, which works for any
``n``), steps per epoch follow the new size, and rank 0 (the oldest survivor) reports progress
and writes the checkpoints.
"""

from __future__ import annotations

from . import _training


class RankView:
    """The parts of a rank's training that depend on its (rank, size): its shard readers and
    the epoch reporter (progress, history, TensorBoard on rank 0). ``on_place(size)`` is
    called whenever :meth:`place` runs in an elastic fit (the learning rate follows the
    size)."""

    def __init__(self, config: dict, rank: int, size: int, history: dict, on_place=None):
        self.config = config
        self.on_place = on_place
        self.rank = self.size = None
        self.train = self.val = self.reporter = None
        self.place(rank, size, history)

    def place(self, rank: int, size: int, history: dict) -> None:
        """Be rank ``rank`` of ``size``, with the committed ``history``."""
        if (rank, size) != (self.rank, self.size):
            self.close()
            config = self.config
            self.train, self.val = _training.make_readers(config, rank, size)
            self.reporter = _training.EpochReporter(rank, config["epochs"], config["verbose"],
                                                    history, store=config["store"],
                                                    run_id=config["run_id"])
            self.rank, self.size = rank, size
        else:
            self.reporter.history = {k: list(v) for k, v in history.items()}
        if self.on_place is not None:
            self.on_place(size)

    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.close()
        for reader in (self.train, self.val):
            if reader is not None:
                reader.close()


def train_epochs(hvd, model, optimizer, view: RankView, start_epoch: int, epochs: int,
                 train_epoch, on_round=None) -> None:
    """``train_epoch(epoch)`` for the epochs ``start_epoch`` to ``epochs - 1`` under
    ``hvd.elastic.run`` (see the module's docstring). ``on_round()``, if given, runs when a
    round's ranks start together (after the state's sync): collectives are safe there."""
    state = hvd.elastic.TorchState(model, optimizer, epoch=start_epoch,
                                   history=view.reporter.history)

    @hvd.elastic.run
    def train(state):
        if on_round is not None:
            on_round()
        while state.epoch < epochs:
            view.place(hvd.rank(), hvd.size(), state.history)
            train_epoch(state.epoch)
            state.history = {k: list(v) for k, v in view.reporter.history.items()}
            state.epoch += 1
            state.commit()

    train(state)
    # A reset at the last commit leaves the epochs done but the ranks changed: the history is
    # the state's, the same on every rank.
    view.reporter.history = {k: list(v) for k, v in state.history.items()}
