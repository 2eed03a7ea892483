"""The rank side of KerasEstimator (the training each Spark task's rank runs), and the Keras
(de)serialisation the driver, the ranks and ``KerasModel.transform``'s predictor share.

Models cross processes in Keras' own ``.keras`` format, never pickled: the format is what Keras
keeps loadable, and ``custom_objects`` apply to it. Optimizers, losses and metrics that are
Keras objects travel as (class, ``get_config()``) and are rebuilt with ``from_config`` inside
a ``custom_object_scope``; plain functions and strings travel as they are (cloudpickle).

Kept free of PySpark imports, and Keras/TensorFlow are imported inside the functions, so that a
rank configures TensorFlow's threads and devices before TensorFlow starts.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import zipfile

import cloudpickle

STATE_ENTRY = "spark_hvd_state.json"   # epoch and history, inside a checkpoint's .keras zip
_COMPILE_KEYS = ("optimizer", "loss", "loss_weights", "metrics", "weighted_metrics")


# -- Keras objects across processes ----------------------------------------------------------

class _KerasObject:
    """A Keras optimizer, loss or metric as (class, config): rebuilt fresh (no variables)."""

    def __init__(self, cls, config):
        self.cls, self.config = cls, config

    def rebuild(self):
        return self.cls.from_config(self.config)


def _plain_class(obj):
    """The class to rebuild ``obj`` as: a spark_hvd DistributedOptimizer is rebuilt as the
    optimizer it wraps (the ranks wrap their own)."""
    cls = type(obj)
    # Only an optimizer wrapped in this process can be one: importing spark_hvd.keras here
    # would load the native core on the driver for nothing.
    wrapping = sys.modules.get("spark_hvd.keras.optimizer")
    if wrapping is not None and isinstance(obj, wrapping._DistributedOptimizer):
        mixin = wrapping._DistributedOptimizer
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, mixin))
    return cls


def pack(obj):
    """``obj`` (nested lists, tuples and dicts too) with its Keras optimizers, losses and
    metrics replaced by picklable (class, config) records."""
    import keras
    if isinstance(obj, (list, tuple)):
        return type(obj)(pack(o) for o in obj)
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    # These pickle through Keras' saving code with no custom_objects, and carry variables.
    if isinstance(obj, (keras.optimizers.Optimizer, keras.losses.Loss, keras.metrics.Metric)):
        return _KerasObject(_plain_class(obj), obj.get_config())
    return obj


def unpack(obj):
    """The inverse of :func:`pack` (call it inside the ``custom_object_scope``)."""
    if isinstance(obj, (list, tuple)):
        return type(obj)(unpack(o) for o in obj)
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, _KerasObject):
        return obj.rebuild()
    return obj


def compile_args(model) -> dict | None:
    """The arguments ``model`` was compiled with (None if it was not)."""
    if not getattr(model, "compiled", False):
        return None
    # The arguments as given (objects, functions); the public get_compile_config() has them
    # serialised, and functions serialised by name need custom_objects to come back.
    saved = getattr(getattr(model, "_compile_config", None), "config", None)
    if saved is None:
        return {"optimizer": getattr(model, "optimizer", None),
                "loss": getattr(model, "loss", None)}
    return {k: saved.get(k) for k in _COMPILE_KEYS if saved.get(k) is not None}


@contextlib.contextmanager
def _scratch_file(name: str):
    directory = tempfile.mkdtemp(prefix="spark_hvd_keras_")
    try:
        yield os.path.join(directory, name)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def model_to_bytes(model, state: dict | None = None) -> bytes:
    """``model`` as the bytes of a ``.keras`` file (with its optimizer state when compiled);
    ``state`` is added as a JSON entry that Keras ignores when loading."""
    with _scratch_file("model.keras") as path:
        model.save(path)
        if state is not None:
            with zipfile.ZipFile(path, "a") as archive:
                archive.writestr(STATE_ENTRY, json.dumps(state))
        with open(path, "rb") as f:
            return f.read()


def read_state(data: bytes) -> dict:
    """The state entry :func:`model_to_bytes` added."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return json.loads(archive.read(STATE_ENTRY))


def load_model_bytes(data: bytes, custom_objects=None):
    """The model in ``.keras`` bytes, not compiled (compiling needs the losses and metrics,
    which the caller has as objects)."""
    import keras
    with _scratch_file("model.keras") as path:
        with open(path, "wb") as f:
            f.write(data)
        return keras.models.load_model(path, custom_objects=custom_objects or None,
                                       compile=False)


def load_weights_bytes(model, data: bytes) -> None:
    """Loads the weights and the optimizer state in ``.keras`` bytes into the compiled
    ``model`` (its optimizer is built first, or Keras would skip the optimizer's state)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built and model.built:
        optimizer.build(model.trainable_variables)
    with _scratch_file("model.keras") as path:
        with open(path, "wb") as f:
            f.write(data)
        model.load_weights(path)


class SavedModel:
    """A Keras model in picklable form: its ``.keras`` bytes and its packed compile
    arguments. Used wherever a model is saved with a stage or sent to another process."""

    def __init__(self, data: bytes, compile: dict | None):
        self.data, self.compile = data, compile

    @classmethod
    def of(cls, model) -> "SavedModel":
        args = compile_args(model)
        return cls(model_to_bytes(model), pack(args) if args else None)

    def load(self, custom_objects=None, optimizer_state: bool = True):
        """The model, compiled again as it was (with a fresh optimizer of the same class and
        configuration, and its saved state when ``optimizer_state``)."""
        import keras
        with keras.saving.custom_object_scope(custom_objects or {}):
            model = load_model_bytes(self.data, custom_objects)
            if self.compile:
                model.compile(**unpack(self.compile))
                if optimizer_state:
                    load_weights_bytes(model, self.data)
        return model


# -- training (what each rank runs) ----------------------------------------------------------

def _batch_converter(config):
    """batch dict -> ``(x, y)`` or ``(x, y, sample_weight)`` as ``model.fit`` takes them:
    ``transformation_fn`` applied, ``input_shapes``/``label_shapes`` reshaped, floating point
    in Keras' float type (Spark's doubles would not match the model's weights)."""
    import keras
    import numpy as np

    from ..data._arrays import reshape_batch
    floatx = keras.backend.floatx()
    feature_cols, label_cols = config["feature_cols"], config["label_cols"]
    input_shapes = config["input_shapes"] or [None] * len(feature_cols)
    label_shapes = config["label_shapes"] or [None] * len(label_cols)
    weight_col, transformation_fn = config["sample_weight_col"], config["transformation_fn"]

    def typed(array):
        array = np.asarray(array)
        return array.astype(floatx, copy=False) if array.dtype.kind == "f" else array

    def one_or_tuple(arrays):
        return arrays[0] if len(arrays) == 1 else tuple(arrays)

    def convert(batch):
        if transformation_fn is not None:
            batch = transformation_fn(batch)
        x = one_or_tuple([typed(reshape_batch(batch[c], s))
                          for c, s in zip(feature_cols, input_shapes)])
        y = one_or_tuple([typed(reshape_batch(batch[c], s))
                          for c, s in zip(label_cols, label_shapes)])
        if weight_col:
            return x, y, typed(batch[weight_col]).astype(floatx, copy=False)
        return x, y
    return convert


class _BatchStream:
    """A ShardReader's epochs as one stream of converted batches, from ``first_epoch`` on.

    Keras keeps one training iterator across epochs when ``steps_per_epoch`` is given, so the
    training stream runs on from one epoch into the next (each epoch reshuffled by the
    reader); the validation stream is restarted for every evaluation (``repeat=False``)."""

    def __init__(self, reader, convert, first_epoch: int, repeat: bool):
        self.reader, self.convert, self.repeat = reader, convert, repeat
        self.first_epoch = first_epoch
        self._stream = self._generate() if repeat else None
        self._peeked = None

    def _generate(self):
        epoch = self.first_epoch
        while True:
            with self.reader.epoch(epoch) as batches:
                for batch in batches:
                    yield self.convert(batch)
            if not self.repeat:
                return
            epoch += 1

    def peek(self):
        """The training stream's first batch (still yielded by the stream)."""
        if self._peeked is None:
            self._peeked = next(self._stream)
        return self._peeked

    def __call__(self):
        if not self.repeat:
            return self._generate()

        def resume():
            if self._peeked is not None:
                first, self._peeked = self._peeked, None
                yield first
            # A plain loop, not ``yield from``: closing this iterator (TensorFlow does when it
            # drops one) must not close the stream, which later iterators continue.
            for batch in self._stream:
                yield batch
        return resume()

    def dataset(self, sample, prefetch=None):
        """A ``tf.data.Dataset`` over this stream, typed like ``sample``, prefetching
        ``prefetch`` batches (None: 2; 0: none, Horovod's
        ``tensorflow_dataset_prefetch_buffer_size``)."""
        import tensorflow as tf
        signature = tf.nest.map_structure(
            lambda a: tf.TensorSpec((None, *a.shape[1:]), tf.as_dtype(a.dtype)), sample)
        dataset = tf.data.Dataset.from_generator(self, output_signature=signature)
        prefetch = 2 if prefetch is None else int(prefetch)
        return dataset.prefetch(prefetch) if prefetch > 0 else dataset


def _start_backend(threads: int) -> str:
    """Starts the rank's Keras backend (``KERAS_BACKEND``, which the estimator sets to the
    driver's) with ``threads`` CPU threads, before Keras is imported; returns its name."""
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    if backend == "tensorflow":
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    elif backend == "torch":
        import torch
        torch.set_num_threads(threads)
    elif backend == "jax" and threads == 1:
        # XLA's CPU client reads its flags when JAX starts.
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_cpu_multi_thread_eigen" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false").strip()
    return backend


def _backend_gpus(backend: str) -> int:
    """How many GPUs the Keras backend sees (TensorFlow's are chosen by _select_devices;
    torch and JAX take the devices Spark made visible to the task)."""
    if backend == "tensorflow":
        import tensorflow as tf
        return len(tf.config.list_physical_devices("GPU"))
    if backend == "torch":
        import torch
        return torch.cuda.device_count()
    import jax
    return sum(d.platform == "gpu" for d in jax.devices())


def _select_devices(backend: str, hvd, use_gpu: bool) -> None:
    """With ``use_gpu``, the backend sees one GPU: ``local_rank % visible GPUs``, one that
    Spark gave the task (see ``spark.run``); without, TensorFlow sees none. No GPU: the CPU,
    with one line from rank 0 if ranks given GPUs fell back. Every rank calls it (a
    collective with ``use_gpu``)."""
    from . import _training
    gpus = _backend_gpus(backend)
    _training.note_cpu_fallback(hvd, use_gpu, bool(gpus),
                                f"Keras' {backend} backend lists no GPU (a CPU-only build, or "
                                "no CUDA driver on the executors)")
    if not gpus or backend != "tensorflow":
        return
    import tensorflow as tf
    devices = tf.config.list_physical_devices("GPU")
    if use_gpu:
        gpu = devices[hvd.local_rank() % len(devices)]
        tf.config.set_visible_devices([gpu], "GPU")
        tf.config.experimental.set_memory_growth(gpu, True)
    else:
        tf.config.set_visible_devices([], "GPU")


def _scale_learning_rate(optimizer, factor: float) -> None:
    rate = optimizer.learning_rate
    if callable(rate) or not hasattr(rate, "assign"):
        raise ValueError("scale_learning_rate needs an optimizer with a constant learning "
                         "rate, not a schedule (scale the schedule's rates instead)")
    rate.assign(rate * factor)


def _epoch_callback(keras, reporter, store, run_id, steps, rows_per_epoch, rank):
    """Reports every epoch to the driver (the logs are already averaged over the ranks) and
    writes rank 0's checkpoint: the model with its optimizer state, the epoch and history."""
    from . import _training

    class EstimatorProgress(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            reporter.start(epoch, steps)

        def on_train_batch_end(self, batch, logs=None):
            loss = (logs or {}).get("loss") if reporter.wants_step_loss else None
            reporter.step(1, float(loss) if loss is not None else None)

        def on_epoch_end(self, epoch, logs=None):
            metrics = {k: float(v) for k, v in (logs or {}).items() if _is_number(v)}
            reporter.end(epoch, metrics, rows_per_epoch)
            if rank == 0:
                data = model_to_bytes(self.model, {"epoch": epoch,
                                                   "history": reporter.history})
                _training.save_checkpoint(store, run_id, epoch, data, "keras")
    return EstimatorProgress()


def _is_number(value) -> bool:
    import numpy as np
    return np.ndim(value) == 0 and np.issubdtype(np.asarray(value).dtype, np.number)


def _prepare_checkpoint_callback(callback, directory: str):
    """Horovod's ``checkpoint_callback``: runs on rank 0 and writes into the rank's scratch
    directory; what it wrote last is the model fit returns (e.g. the best one)."""
    weights_only = getattr(callback, "save_weights_only", False)
    callback.filepath = os.path.join(directory, "checkpoint.weights.h5" if weights_only
                                     else "checkpoint.keras")
    return callback


def train_on_rank(config, resume):
    """What each rank runs (through ``spark.run``): train with ``model.fit``, checkpoint,
    report; rank 0 returns the trained model (``.keras`` bytes) and the history."""
    from . import _training
    backend = _start_backend(_training.cpu_threads_per_rank())
    import keras

    import spark_hvd.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if rank == 0 and config["verbose"]:
        print(f"KerasEstimator: training on Keras' {backend} backend", flush=True)
    _select_devices(backend, hvd, config["use_gpu"])
    keras.utils.set_random_seed(config["random_seed"])

    spec = cloudpickle.loads(config["keras"])
    custom_objects = spec["custom_objects"] or {}
    with keras.saving.custom_object_scope(custom_objects):
        model = load_model_bytes(spec["model"], custom_objects)
        args = unpack(spec["compile"])
        callbacks = list(spec["callbacks"] or [])
        checkpoint_callback = spec["checkpoint_callback"]
    optimizer = args["optimizer"]
    if config["scale_learning_rate"]:
        _scale_learning_rate(optimizer, size)
    hvd.DistributedOptimizer(optimizer,
                             compression=config["gradient_compression"] or hvd.Compression.none,
                             backward_passes_per_step=config["backward_passes_per_step"])
    # On TensorFlow the collectives are Python kernels, which XLA cannot compile; JAX's
    # compiled step reaches them through a callback, torch's runs eagerly.
    model.compile(**args, **({"jit_compile": False} if backend == "tensorflow" else {}))

    store, run_id = config["store"], config["run_id"]
    start_epoch, history = 0, {}
    if resume is not None and rank == 0:
        data = store.read_bytes(resume)
        load_weights_bytes(model, data)
        state = read_state(data)
        start_epoch, history = state["epoch"] + 1, state["history"]
    # Rank 0's weights and optimizer state reach the others in BroadcastGlobalVariables.
    start_epoch, history = hvd.broadcast_object((start_epoch, history), root_rank=0)

    scratch = tempfile.mkdtemp(prefix="spark_hvd_keras_rank_")
    reporter = None
    train_reader, val_reader = _training.make_readers(config, rank, size)
    try:
        convert = _batch_converter(config)
        train = _BatchStream(train_reader, convert, start_epoch, repeat=True)
        sample = train.peek()
        prefetch = config.get("tensorflow_dataset_prefetch_buffer_size")
        validation = None
        if val_reader is not None and backend == "tensorflow":
            validation = _BatchStream(val_reader, convert, 0, repeat=False).dataset(
                sample, prefetch)
        elif val_reader is not None:
            # Keras keeps a generator's iterator across epochs when validation_steps is
            # given: one stream running through the validation epochs.
            validation = _BatchStream(val_reader, convert, 0, repeat=True)()
        epochs, steps = config["epochs"], train_reader.steps_per_epoch
        reporter = _training.EpochReporter(rank, epochs, config["verbose"], history,
                                           store=store, run_id=run_id)
        fit_callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback(), *callbacks,
                         _epoch_callback(keras, reporter, store, run_id, steps,
                                         steps * config["batch_size"] * size, rank)]
        if checkpoint_callback is not None and rank == 0:
            fit_callbacks.append(_prepare_checkpoint_callback(checkpoint_callback, scratch))
        # tf.data on TensorFlow; torch and JAX read a Python generator (Keras adapts it).
        data = train.dataset(sample, prefetch) if backend == "tensorflow" else train()
        model.fit(data, steps_per_epoch=steps, epochs=epochs,
                  initial_epoch=start_epoch, validation_data=validation,
                  validation_steps=val_reader.steps_per_epoch if val_reader else None,
                  callbacks=fit_callbacks, shuffle=False, verbose=0)
        if rank != 0:
            return None
        return {"model": _trained_model_bytes(model, checkpoint_callback),
                "history": reporter.history}
    finally:
        if reporter is not None:
            reporter.close()
        train_reader.close()
        if val_reader is not None:
            val_reader.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _trained_model_bytes(model, checkpoint_callback) -> bytes:
    """The model fit returns: what ``checkpoint_callback`` saved last, if it saved anything,
    else the model as training left it."""
    path = getattr(checkpoint_callback, "filepath", None)
    if path and os.path.exists(path):
        if path.endswith(".keras"):
            with open(path, "rb") as f:
                return f.read()
        model.load_weights(path)
    return model_to_bytes(model)
