"""What every rank of an estimator's training run needs, whatever the framework: its shard
readers, per-epoch bookkeeping (history, rows/s, progress to the driver) and checkpoints in the
Store. Runs inside the rank processes that ``spark.run`` starts."""

from __future__ import annotations

import io
import os
import time

from ...common import _bootstrap_contract as contract
from . import _progress

KEEP_CHECKPOINTS = 2   # the newest ones: a crash while writing one still leaves the previous


class RankEntry:
    """What each rank runs: Horovod's per-rank setup (``mp_start_method``), then the
    framework's training function ``trainer(config, resume)``. The driver pickles it; it lives
    here so that unpickling it in a rank imports none of the driver's modules (PySpark ML)."""

    def __init__(self, trainer, mp_start_method=None):
        self.trainer, self.mp_start_method = trainer, mp_start_method

    def __call__(self, config, resume):
        if self.mp_start_method is not None:
            import multiprocessing
            multiprocessing.set_start_method(self.mp_start_method, force=True)
        return self.trainer(config, resume)


def make_readers(config: dict, rank: int, size: int):
    """(train reader, validation reader or None) of this rank."""
    from ..data._loader import ShardReader
    store, metadata = config["store"], config["metadata"]
    path = store.fs_path(store.get_data_path(metadata["data_key"]))
    columns = list(config["feature_cols"]) + list(config["label_cols"])
    if config["sample_weight_col"]:
        columns.append(config["sample_weight_col"])
    common = dict(columns=columns, seed=config["random_seed"], reader=config["reader"])
    train = ShardReader(store.filesystem, path, metadata, split="train", rank=rank, size=size,
                        batch_size=config["batch_size"],
                        steps_per_epoch=config["train_steps_per_epoch"],
                        shuffle=config["shuffle"],
                        shuffle_buffer_size=config["shuffle_buffer_size"],
                        inmemory_cache_all=config["inmemory_cache_all"],
                        num_workers=config["train_reader_num_workers"], **common)
    val = None
    if metadata["splits"].get("val"):
        val = ShardReader(store.filesystem, path, metadata, split="val", rank=rank, size=size,
                          batch_size=config["val_batch_size"],
                          steps_per_epoch=config["validation_steps_per_epoch"], shuffle=False,
                          inmemory_cache_all=config["inmemory_cache_all"],
                          num_workers=config["val_reader_num_workers"], **common)
    return train, val


def call_hooks(callbacks, hook: str, *args, **kwargs) -> None:
    """Calls ``hook`` on every callback that has it (callbacks run on every rank)."""
    for callback in callbacks or ():
        method = getattr(callback, hook, None)
        if method is not None:
            method(*args, **kwargs)


def cpu_threads_per_rank() -> int:
    """Cores of this machine shared fairly by the ranks on it (no oversubscription)."""
    local_size = int(os.environ.get(contract.LOCAL_SIZE, "1") or 1)
    return max(1, (os.cpu_count() or 1) // max(1, local_size))


# Why a rank given GPUs trains on the CPU, for :func:`note_cpu_fallback`.
TORCH_NO_CUDA = ("torch.cuda.is_available() is False (a CPU-only build of torch, or no CUDA "
                 "driver on the executors)")


_cpu_fallback_noted = False   # a process prints the note once, though an elastic fit asks each round


def note_cpu_fallback(hvd, use_gpu: bool, on_gpu: bool, why: str) -> None:
    """With ``use_gpu``, rank 0 prints one line (on its stderr, which reaches the driver) when
    ranks that were given GPUs (a non-empty ``CUDA_VISIBLE_DEVICES``, as ``spark.run`` sets
    from Spark's GPU scheduling) train on the CPU because ``why`` (the framework finds no
    usable GPU). ``use_gpu`` means "on the GPU when there is one": the fit goes on. Ranks
    without GPUs (a cluster without GPU scheduling or GPUs) are not mentioned. A collective:
    every rank calls it, with the same ``use_gpu`` (an elastic fit: at the start of each round,
    when the round's ranks, newcomers included, are together)."""
    global _cpu_fallback_noted
    if not use_gpu:
        return
    import sys
    seen = hvd.allgather_object((on_gpu, os.environ.get("CUDA_VISIBLE_DEVICES") or ""))
    fallen = [(r, visible) for r, (gpu, visible) in enumerate(seen) if not gpu and visible]
    if hvd.rank() == 0 and fallen and not _cpu_fallback_noted:
        _cpu_fallback_noted = True
        ranks = ", ".join(str(r) for r, _ in fallen)
        visible = "; ".join(f"rank {r}: {v}" for r, v in fallen)
        print(f"spark_hvd estimator: use_gpu=True but rank(s) {ranks} train on the CPU: they "
              f"were given GPUs (CUDA_VISIBLE_DEVICES {visible}) but {why}", file=sys.stderr,
              flush=True)


class MeanAccumulator:
    """Sums of per-step values, averaged at the end of an epoch."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.steps = 0

    def add(self, values: dict) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
        self.steps += 1

    def means(self) -> dict:
        return {k: v / max(1, self.steps) for k, v in self.sums.items()}


class EpochReporter:
    """Rank 0's account of training: progress events to the driver (the driver's
    ProgressSink prints them and passes them to tracking), the run's history, and the
    TensorBoard event files under ``runs/<run_id>/logs/`` when ``store`` is given."""

    def __init__(self, rank: int, epochs: int, verbose: int, history: dict | None = None,
                 store=None, run_id: str | None = None):
        self.rank, self.epochs, self.verbose = rank, epochs, verbose
        self.history = {k: list(v) for k, v in (history or {}).items()}
        self._started = time.monotonic()
        self.global_step = 0
        self.logs = None
        if rank == 0 and store is not None and store.saving_runs():
            from . import _tensorboard
            self.logs, problem = _tensorboard.open_run_logs(store, run_id)
            if problem and verbose:
                _progress.report("message", text=problem)

    @property
    def wants_step_loss(self) -> bool:
        """Whether ``step`` uses the loss (a framework may skip computing it otherwise)."""
        return self.rank == 0 and (self.logs is not None or self.verbose >= 2)

    def start(self, epoch: int, steps: int) -> None:
        self._started = time.monotonic()
        self.global_step = epoch * steps
        # Sent whatever the verbosity: the driver's tracking listens to the epochs.
        if self.rank == 0:
            _progress.report("epoch_start", epoch=epoch, epochs=self.epochs, steps=steps)

    def step(self, steps: int = 1, loss: float | None = None) -> None:
        self.global_step += steps
        if self.rank != 0:
            return
        if self.logs is not None and loss is not None:
            self.logs.step(self.global_step, loss)
        if self.verbose >= 2:
            fields = {"steps": steps}
            if loss is not None:
                fields["loss"] = float(loss)
            _progress.report("step", **fields)

    def end(self, epoch: int, metrics: dict, rows: int) -> None:
        """Records the epoch's (already rank-averaged) metrics; ``rows`` = rows trained by all
        ranks this epoch."""
        for k, v in metrics.items():
            self.history.setdefault(k, []).append(float(v))
        seconds = time.monotonic() - self._started
        if self.rank != 0:
            return
        metrics = {k: float(v) for k, v in metrics.items()}
        rate = rows / seconds if seconds > 0 else None
        if self.logs is not None:
            self.logs.epoch(epoch, metrics, rate)
        _progress.report("epoch_end", epoch=epoch, epochs=self.epochs, metrics=metrics,
                         rows_per_second=rate, seconds=seconds)

    def close(self) -> None:
        """Closes the TensorBoard files (and copies them to a remote Store)."""
        if self.logs is not None:
            self.logs.close()
            self.logs = None


def save_checkpoint(store, run_id: str, epoch: int, data: bytes, extension: str) -> str:
    """Writes the checkpoint of ``epoch`` atomically, then drops all but the newest
    ``KEEP_CHECKPOINTS``. Returns its path (None, writing nothing, for a Store made with
    Horovod's ``save_runs=False``)."""
    if not store.saving_runs():
        return None
    path = store.get_checkpoint_file(run_id, epoch, extension)
    with store.atomic_writer(path) as f:
        f.write(data)
    for _, old in store.list_checkpoints(run_id)[:-KEEP_CHECKPOINTS]:
        store.delete(old)
    return path


def write_log(store, run_id: str, name: str, text: str) -> None:
    """A small text file under ``runs/<run_id>/logs/`` (nothing with ``save_runs=False``)."""
    if not store.saving_runs():
        return
    store.write_text(store.join(store.get_logs_path(run_id), name), text)


def bytes_buffer(data: bytes | None = None) -> io.BytesIO:
    return io.BytesIO(data) if data is not None else io.BytesIO()
