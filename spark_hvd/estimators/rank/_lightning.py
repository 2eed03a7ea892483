"""The rank side of LightningEstimator: every rank builds a Lightning ``Trainer`` with
spark_hvd's strategy and runs ``trainer.fit`` on its shards, so Lightning's own loop, callbacks,
checkpointing and loggers run on every rank. Kept free of PySpark imports so that a rank starts
fast.

What the estimator adds to the user's Trainer, through one checkpoint-type callback of its own
(``StoreCheckpoint``): per-epoch progress to the driver and the run's history (the epoch's
``trainer.callback_metrics`` averaged over the ranks), and after every epoch Lightning's full
checkpoint (weights, optimizers, loops, callbacks' states) written into the Store's
``runs/<run_id>/checkpoints/``, from which a fit with the same ``run_id`` resumes. The default
logger (TensorBoard, else CSV) writes on rank 0 to a local directory copied into the Store's
``runs/<run_id>/logs/lightning_logs/`` every epoch.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import sys
import tempfile
import threading
import types
import warnings

import cloudpickle

from ._torch import _import_dynamo, as_tensor, bytes_io

CHECKPOINT_EXTENSION = "ckpt"
LOG_DIR_NAME = "lightning_logs"

# Lightning's advice for torch DataLoaders; the shard reader has its own reader threads.
_IGNORED_WARNINGS = (r".*does not have many workers.*",
                     r".*smaller than the logging interval.*")


class ShardBatches:
    """One split's batches for Lightning: a sized iterable of dicts ``{column: tensor}`` (what
    Horovod's Lightning estimator gave ``training_step``), read by the rank's ``ShardReader``
    for the Trainer's current epoch, with ``input_shapes`` / ``label_shapes`` applied."""

    def __init__(self, reader, config, current_epoch):
        from ..data._arrays import reshape_batch
        self.reader = reader
        self.current_epoch = current_epoch
        self.transformation_fn = config["transformation_fn"]
        shapes = {}
        for cols, key in (("feature_cols", "input_shapes"), ("label_cols", "label_shapes")):
            for col, shape in zip(config[cols], config[key] or [None] * len(config[cols])):
                shapes[col] = shape
        self.shapes = shapes
        self.reshape = reshape_batch

    def __len__(self) -> int:
        return self.reader.steps_per_epoch

    def __iter__(self):
        with self.reader.epoch(self.current_epoch()) as batches:
            for batch in batches:
                if self.transformation_fn is not None:
                    batch = self.transformation_fn(batch)
                yield {name: as_tensor(self.reshape(values, self.shapes.get(name)))
                       for name, values in batch.items()}


def data_module_kwargs(config, rank, size, train_steps, val_steps):
    """The keywords a ``data_module`` class is built with: Horovod's (``train_dir``,
    ``val_dir``, ``cur_shard``, ``shard_count``, ``schema_fields``, ...) and spark_hvd's
    (``store``, ``metadata``, ``config``)."""
    store, metadata = config["store"], config["metadata"]
    schema_fields = list(config["feature_cols"]) + list(config["label_cols"])
    if config["sample_weight_col"]:
        schema_fields.append(config["sample_weight_col"])
    return {
        "train_dir": store.get_train_data_path(metadata["data_key"]),
        "val_dir": store.get_val_data_path(metadata["data_key"]),
        "num_train_epochs": config["epochs"], "has_val": bool(metadata["splits"].get("val")),
        "train_batch_size": config["batch_size"], "val_batch_size": config["val_batch_size"],
        "shuffle": config["shuffle"], "num_reader_epochs": config["loader_num_epochs"],
        "reader_pool_type": config["reader_pool_type"],
        "reader_worker_count": config["train_reader_num_workers"],
        "transformation": config["user_transformation_fn"],
        "transformation_edit_fields": config["transformation_edit_fields"],
        "transformation_removed_fields": config["transformation_removed_fields"],
        "inmemory_cache_all": config["inmemory_cache_all"], "cur_shard": rank,
        "shard_count": size, "schema_fields": schema_fields,
        "storage_options": getattr(store, "storage_options", None),
        "steps_per_epoch_train": train_steps, "steps_per_epoch_val": val_steps,
        "verbose": bool(config["verbose"]), "seed": config["random_seed"],
        "debug_data_loader": config["debug_data_loader"],
        "train_async_data_loader_queue_size": config["train_async_data_loader_queue_size"],
        "val_async_data_loader_queue_size": config["val_async_data_loader_queue_size"],
        "store": store, "metadata": metadata, "config": config,
    }


def _callback_classes(pl):
    """The estimator's callbacks, subclassing the model's own Lightning package."""
    import torch

    class StoreCheckpoint(pl.callbacks.Checkpoint):
        """Per epoch: progress and history (rank-averaged ``callback_metrics``), Lightning's
        checkpoint into the Store and the local logs copied there (rank 0). A ``Checkpoint``,
        so Lightning runs it after the other callbacks and saves their latest states."""

        def __init__(self, hvd, reporter, config, workdir, sync_logs):
            self.hvd, self.reporter, self.config = hvd, reporter, config
            self.workdir, self.sync_logs = workdir, sync_logs
            self.verbose = config["verbose"]

        def state_dict(self):
            return {"history": self.reporter.history}

        def load_state_dict(self, state_dict):
            self.reporter.history = {k: list(v) for k, v in state_dict["history"].items()}

        def on_train_epoch_start(self, trainer, pl_module):
            steps = trainer.num_training_batches
            self.reporter.start(trainer.current_epoch,
                                steps if math.isfinite(steps) else None)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.verbose >= 2:
                loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
                self.reporter.step(1, float(loss) if isinstance(loss, torch.Tensor) else None)

        def on_train_epoch_end(self, trainer, pl_module):
            epoch = trainer.current_epoch
            metrics = self._rank_averaged(trainer.callback_metrics)
            steps = trainer.num_training_batches
            rows = (int(steps) if math.isfinite(steps) else 0) * self.config["batch_size"] * \
                self.hvd.size()
            self.reporter.end(epoch, metrics, rows)
            store = self.config["store"]
            if not store.saving_runs():
                return
            path = os.path.join(self.workdir, f"epoch-{epoch}.{CHECKPOINT_EXTENSION}")
            trainer.save_checkpoint(path)   # every rank: it synchronises them
            if trainer.is_global_zero:
                with open(path, "rb") as f:
                    data = f.read()
                os.remove(path)
                from . import _training
                _training.save_checkpoint(store, self.config["run_id"], epoch, data,
                                          CHECKPOINT_EXTENSION)
                self.sync_logs()

        def _rank_averaged(self, callback_metrics):
            """The epoch's scalar metrics, averaged over the ranks (metrics logged without
            ``sync_dist`` differ per rank), under rank 0's names."""
            local = {k: float(v) for k, v in callback_metrics.items()
                     if isinstance(v, (int, float)) or
                     (isinstance(v, torch.Tensor) and v.numel() == 1)}
            names = self.hvd.broadcast_object(sorted(local), root_rank=0,
                                              name="spark_hvd.lightning.metric_names")
            if not names:
                return {}
            values = torch.tensor([local.get(n, math.nan) for n in names],
                                  dtype=torch.float64)
            averaged = self.hvd.allreduce(values, op=self.hvd.Average,
                                          name="spark_hvd.lightning.epoch_metrics")
            return dict(zip(names, averaged.tolist()))

    class TerminateOnNan(pl.callbacks.Callback):
        """Horovod's ``terminate_on_nan``: a non-finite training loss stops the run with an
        error naming the epoch and batch."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all():
                raise ValueError(f"terminate_on_nan: the training loss is {loss.item()} at "
                                 f"epoch {trainer.current_epoch}, batch {batch_idx} on rank "
                                 f"{trainer.global_rank}")

    return StoreCheckpoint, TerminateOnNan


def _upload_dir(local_dir: str, store, remote_dir: str) -> None:
    """Copies every file under ``local_dir`` to ``remote_dir`` in the Store (the logs: event
    files are small and grow, so each copy replaces the last)."""
    for root, _, files in os.walk(local_dir):
        for name in files:
            path = os.path.join(root, name)
            parts = os.path.relpath(path, local_dir).split(os.sep)
            with open(path, "rb") as f:
                store.write_bytes(store.join(remote_dir, *parts), f.read())


def _default_logger(pl, save_dir: str, version: str):
    if "tensorflow" not in sys.modules:
        # TensorBoard's writer imports TensorFlow when it is installed (16 s of a loaded
        # 2-core host, and its memory, on rank 0) unless this marker module exists; its own
        # stub writes the same local event files.
        sys.modules.setdefault("tensorboard.compat.notf",
                               types.ModuleType("tensorboard.compat.notf"))
    try:
        return pl.loggers.TensorBoardLogger(save_dir=save_dir, name=LOG_DIR_NAME,
                                            version=version)
    except ModuleNotFoundError:   # neither tensorboard nor tensorboardX
        return pl.loggers.CSVLogger(save_dir=save_dir, name=LOG_DIR_NAME, version=version)


def _next_log_version(store, logs_path) -> str:
    """``version_<n>``: one directory per fit of the run (a resumed fit adds one)."""
    directory = store.join(logs_path, LOG_DIR_NAME)
    existing = store.listdir(directory) if store.exists(directory) else []
    return f"version_{sum(1 for n in existing if n.startswith('version_'))}"


def _model_checkpoints(pl, callbacks):
    return [c for c in callbacks if isinstance(c, pl.callbacks.ModelCheckpoint)]


def train_on_rank(config, resume):
    """What each rank runs (through ``spark.run``): ``trainer.fit``; rank 0 returns the trained
    weights (those of the user's ModelCheckpoint's best model, when there is one) and the
    history."""
    # Lightning (~3 s) and torch._dynamo (~2 s, the first optimizer imports it) are imported
    # while the ranks meet in init.
    preload = threading.Thread(target=_preload, args=(config["lightning_package"],),
                               daemon=True)
    preload.start()
    import torch

    import spark_hvd.torch as hvd
    from spark_hvd.lightning._strategy import import_lightning, set_rank_zero, strategy_class
    hvd.init()
    preload.join()

    from . import _training
    pl = import_lightning(config["lightning_package"])
    rank, size = hvd.rank(), hvd.size()
    set_rank_zero(pl, rank)
    for pattern in _IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    if not config["verbose"]:   # Lightning's info lines (devices found, tips)
        logging.getLogger(pl.__name__).setLevel(logging.WARNING)
    torch.set_num_threads(_training.cpu_threads_per_rank())
    pl.seed_everything(config["random_seed"], verbose=False)

    use_gpu = config["num_gpus"] if config["num_gpus"] is not None else \
        int(config["use_gpu"] and torch.cuda.is_available())
    _training.note_cpu_fallback(hvd, config["use_gpu"] and config["num_gpus"] is None,
                                bool(use_gpu), _training.TORCH_NO_CUDA)
    if use_gpu and not torch.cuda.is_available():
        raise RuntimeError(f"num_gpus={config['num_gpus']} but rank {rank} sees no CUDA "
                           f"device")
    devices = dict(accelerator="cpu", devices=1)
    if use_gpu:
        devices = dict(accelerator="gpu",
                       devices=[hvd.local_rank() % torch.cuda.device_count()])

    model = cloudpickle.loads(config["model"])
    store, run_id = config["store"], config["run_id"]
    epochs, verbose = config["epochs"], config["verbose"]
    reporter = _training.EpochReporter(rank, epochs, verbose)
    StoreCheckpoint, TerminateOnNan = _callback_classes(pl)
    callbacks = list(config["callbacks"] or [])
    if config["checkpoint_callback"] is not None and \
            not any(c is config["checkpoint_callback"] for c in callbacks):
        callbacks.append(config["checkpoint_callback"])
    if config["terminate_on_nan"]:
        callbacks.append(TerminateOnNan())

    with tempfile.TemporaryDirectory(prefix="spark_hvd-lightning-") as workdir:
        local_logs = os.path.join(workdir, "logs")
        logs_path = store.get_logs_path(run_id) if store.saving_runs() else None

        def sync_logs():
            if logs_path is not None and os.path.isdir(local_logs):
                _upload_dir(local_logs, store, logs_path)

        callbacks.append(StoreCheckpoint(hvd, reporter, config, workdir, sync_logs))
        logger = config["logger"]
        if logger is None:
            version = hvd.broadcast_object(
                _next_log_version(store, logs_path) if rank == 0 and logs_path else
                "version_0", root_rank=0, name="spark_hvd.lightning.log_version")
            logger = _default_logger(pl, local_logs, version)
        profiler = config["profiler"]
        if isinstance(profiler, pl.profilers.Profiler) and profiler.dirpath is None:
            # Lightning would give every rank rank 0's log directory; rank 0's profile is
            # copied into the Store with its logs.
            profiler.dirpath = local_logs
        trainer_kwargs = dict(
            strategy=strategy_class(config["lightning_package"])(
                compression=config["gradient_compression"],
                scale_learning_rate=config["scale_learning_rate"]),
            max_epochs=epochs, callbacks=callbacks, logger=logger,
            log_every_n_steps=config["log_every_n_steps"], num_sanity_val_steps=0,
            enable_progress_bar=False, enable_model_summary=verbose >= 1,
            default_root_dir=workdir, profiler=profiler,
            accumulate_grad_batches=config["backward_passes_per_step"], **devices)
        for name in ("gradient_clip_val", "limit_train_batches", "limit_val_batches",
                     "val_check_interval"):
            if config[name] is not None:
                trainer_kwargs[name] = config[name]
        trainer_kwargs.update(config["trainer_args"] or {})
        trainer = pl.Trainer(**trainer_kwargs)

        ckpt_path = None
        if resume is not None:
            if not resume.endswith("." + CHECKPOINT_EXTENSION):
                raise ValueError(f"run {run_id} has checkpoint {resume}, which is not a "
                                 f"Lightning checkpoint; use another run_id")
            ckpt_path = os.path.join(workdir, "resume." + CHECKPOINT_EXTENSION)
            with open(ckpt_path, "wb") as f:
                f.write(store.read_bytes(resume))

        readers = []
        try:
            if config["data_module"] is not None:
                data = {"datamodule": _data_module(config, rank, size)}
            else:
                train_reader, val_reader = _training.make_readers(config, rank, size)
                readers = [r for r in (train_reader, val_reader) if r is not None]

                def current_epoch():
                    return trainer.current_epoch
                data = {"train_dataloaders": ShardBatches(train_reader, config, current_epoch)}
                if val_reader is not None:
                    data["val_dataloaders"] = ShardBatches(val_reader, config, current_epoch)
            trainer.fit(model, ckpt_path=ckpt_path, **data)
        finally:
            for reader in readers:
                reader.close()
        if rank != 0:
            return None
        sync_logs()
        state = model.state_dict()
        best = [c.best_model_path for c in _model_checkpoints(pl, callbacks)
                if c.best_model_path and os.path.exists(c.best_model_path)]
        if best:
            state = torch.load(best[0], map_location="cpu", weights_only=False)["state_dict"]
    buffer = bytes_io(b"")
    torch.save({k: v.detach().cpu() for k, v in state.items()}, buffer)
    return {"model_state": buffer.getvalue(), "history": reporter.history,
            "best_model_path": best[0] if best else None}


def _preload(package):
    _import_dynamo()
    try:
        importlib.import_module(package)
    except Exception:  # noqa: BLE001 - the import in the rank's thread reports it
        pass


def _data_module(config, rank, size):
    """The user's ``data_module``: a LightningDataModule, or a class built with
    :func:`data_module_kwargs` (as Horovod builds its ``PetastormDataModule``)."""
    from ..data._loader import default_steps_per_epoch
    data_module = config["data_module"]
    if not isinstance(data_module, type):
        return data_module
    metadata = config["metadata"]
    train_steps = config["train_steps_per_epoch"] or default_steps_per_epoch(
        metadata, "train", config["batch_size"], size)
    val_steps = None
    if metadata["splits"].get("val"):
        val_steps = config["validation_steps_per_epoch"] or default_steps_per_epoch(
            metadata, "val", config["val_batch_size"], size)
    return data_module(**data_module_kwargs(config, rank, size, train_steps, val_steps))
