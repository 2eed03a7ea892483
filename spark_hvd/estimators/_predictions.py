"""``Model.transform``: predictions in batches through an Arrow UDF, never row by row.

Feature columns are turned into arrays the same way as for training (Spark ML vectors through
``vector_to_array``), each Arrow batch becomes NumPy arrays without per-row Python work, the
model runs on ``batch_size`` rows at a time, and its outputs come back as new columns: a double
when the output has one value per row and the label was a scalar, an array of floats otherwise
(a Spark ML vector when the label was one). Every other column of the DataFrame is kept.

The model is loaded in each Spark Python worker by its framework's predictor (below), which
the UDF carries pickled.
"""

from __future__ import annotations

import collections
import threading
import uuid

import cloudpickle
import numpy as np

from .data import _columns
from .data._arrays import arrow_to_numpy, reshape_batch

_STRUCT = "__spark_hvd_predictions"

# The predictors (loaded models) a Spark Python worker keeps between tasks and transform calls,
# newest last: a worker serves many tasks, and loading the model in every task was a fixed
# cost per task (seconds for a large model), as predict_batch_udf's own cache avoids.
PREDICTORS_KEPT = 2
_predictors: collections.OrderedDict = collections.OrderedDict()
_predictors_lock = threading.Lock()


def in_spark_task() -> bool:
    """Whether this code runs inside a Spark task (a Python worker), not on the driver: only
    there may a predictor change process-wide settings such as the framework's threads."""
    try:
        from pyspark import TaskContext
    except ImportError:
        return False
    return TaskContext.get() is not None


def predictor_key(factory) -> str:
    """What identifies the model ``factory`` loads: its ``cache_key()`` (a digest of the
    model's bytes), or else a key of this transform call only."""
    key = getattr(factory, "cache_key", None)
    return key() if key is not None else uuid.uuid4().hex


def cached_predictor(key: str, factory):
    """The predictor ``factory()`` returns, loaded once per Python worker for ``key``."""
    with _predictors_lock:
        predictor = _predictors.get(key)
        if predictor is not None:
            _predictors.move_to_end(key)
            return predictor
    predictor = factory()
    with _predictors_lock:
        _predictors[key] = predictor
        while len(_predictors) > PREDICTORS_KEPT:
            _predictors.popitem(last=False)
    return predictor


# -- the frameworks' predictors (pickled into the UDF; framework imports inside) --------------

class TorchPredictor:
    """TorchModel's: loads the model (once per Spark Python worker: ``cache_key``); called
    with a list of input arrays."""

    def __init__(self, model_blob: bytes):
        self.model_blob = model_blob

    def cache_key(self) -> str:
        import hashlib
        return "torch:" + hashlib.sha1(self.model_blob).hexdigest()

    def __call__(self):
        import torch

        from .rank._torch import as_tensor
        if in_spark_task():
            torch.set_num_threads(1)   # one Spark task per core (the driver keeps its own)
        model = cloudpickle.loads(self.model_blob)
        model.eval()

        def predict(inputs):
            with torch.inference_mode():
                outputs = model(*[as_tensor(x) for x in inputs])
            if not isinstance(outputs, (list, tuple)):
                outputs = [outputs]
            return [o.detach().cpu().numpy() for o in outputs]
        return predict


def _limit_threads(threads: int) -> None:
    import keras
    backend = keras.backend.backend()
    if backend == "torch":
        import torch
        torch.set_num_threads(threads)
    elif backend == "tensorflow":
        import tensorflow as tf
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)
        except RuntimeError:   # TensorFlow already started in this process: keep its setting
            pass


def as_list(outputs, model) -> list:
    """A Keras model's outputs (one array, a list, or a dict by output name) as a list."""
    if isinstance(outputs, dict):
        return [outputs[name] for name in model.output_names]
    if isinstance(outputs, (list, tuple)):
        return list(outputs)
    return [outputs]


class KerasPredictor:
    """KerasModel's: loads the model (once per Spark Python worker: ``cache_key``); called
    with a list of input arrays."""

    def __init__(self, model_data: bytes, custom_objects=None, backend=None):
        # custom_objects pickled here, by the cloudpickle a user registers modules with
        # (pickle_by_value), not by the copy vendored in PySpark that ships the UDF.
        self.model_data = model_data
        self.custom_objects = cloudpickle.dumps(custom_objects)
        self.backend = backend

    def cache_key(self) -> str:
        import hashlib
        digest = hashlib.sha1(self.model_data)
        digest.update(self.custom_objects)
        return "keras:" + digest.hexdigest()

    def __call__(self):
        import os
        import sys
        if self.backend and "keras" not in sys.modules:
            # The driver's Keras backend, in a Spark worker that has not loaded Keras yet (one
            # that has keeps its own: a .keras file loads on every backend).
            os.environ.setdefault("KERAS_BACKEND", self.backend)
        from .rank._keras import load_model_bytes
        if in_spark_task():
            _limit_threads(1)   # one Spark task per core (the driver keeps its own)
        model = load_model_bytes(self.model_data, cloudpickle.loads(self.custom_objects))

        def predict(inputs):
            x = inputs[0] if len(inputs) == 1 else list(inputs)
            return [np.asarray(o) for o in as_list(model.predict_on_batch(x), model)]
        return predict


# -- the UDF -------------------------------------------------------------------------------------

def _input_expressions(fns, model, metadata):
    F, vector_to_array = fns.F, fns.vector_to_array
    exprs = []
    for col in model.getFeatureCols():
        info = metadata["columns"][col]
        if info["kind"] == "vector":
            exprs.append(vector_to_array(F.col(col), dtype=info["dtype"]))
        else:
            exprs.append(F.col(col))
    return exprs


def output_specs(model, metadata, predictor):
    """(name, flat size, is_scalar, as_vector) per output, found by running the model on one
    row of zeros on the driver."""
    inputs = []
    for col, shape in zip(model.getFeatureCols(), _input_shapes(model)):
        info = metadata["columns"][col]
        inputs.append(reshape_batch(np.zeros((1, *info["shape"]), dtype=info["dtype"]), shape))
    outputs = predictor(inputs)
    names = model.getOutputCols()
    if len(names) != len(outputs):
        raise ValueError(f"the model returns {len(outputs)} output(s) but there are "
                         f"{len(names)} output column(s) {names}; set output_cols "
                         f"(setOutputCols) to one name per output")
    labels = model.getLabelCols()
    specs = []
    for i, (name, out) in enumerate(zip(names, outputs)):
        size = int(np.prod(np.shape(out)[1:]))
        label = metadata["columns"].get(labels[i]) if i < len(labels) else None
        label_kind = label["kind"] if label else "array"
        specs.append((name, size, size == 1 and label_kind == "scalar",
                      label_kind == "vector"))
    return specs


def _input_shapes(model):
    shapes = model.getInputShapes()
    return list(shapes) if shapes else [None] * len(model.getFeatureCols())


def add_predictions(df, model):
    """``df`` with the model's prediction columns added."""
    import pyarrow as pa
    from pyspark.sql.types import ArrayType, DoubleType, FloatType, StructField, StructType

    metadata = model.getTrainingMetadata()
    missing = [c for c in model.getFeatureCols() if c not in df.columns]
    if missing:
        raise ValueError(f"transform: feature column(s) {missing} not in the DataFrame "
                         f"(columns: {df.columns})")
    factory = model._predictor_factory()
    key = predictor_key(factory)
    specs = output_specs(model, metadata, cached_predictor(key, factory))
    fields = [StructField(name, DoubleType() if scalar else ArrayType(FloatType()), False)
              for name, _, scalar, _ in specs]
    columns = [(c, metadata["columns"][c]) for c in model.getFeatureCols()]
    shapes = _input_shapes(model)
    batch_size = model.getBatchSize()

    def predict(batches):
        predictor = cached_predictor(key, factory)
        for arrays in batches:
            if isinstance(arrays, (pa.Array, pa.ChunkedArray)):
                arrays = (arrays,)
            inputs = [reshape_batch(arrow_to_numpy(a, info["shape"], info["dtype"], name), s)
                      for a, (name, info), s in zip(arrays, columns, shapes)]
            rows = len(inputs[0])
            chunks = [[] for _ in specs]
            for start in range(0, rows, batch_size):
                outs = predictor([x[start:start + batch_size] for x in inputs])
                for chunk, out in zip(chunks, outs):
                    chunk.append(np.asarray(out).reshape(len(out), -1))
            children = []
            for (name, size, scalar, _), chunk in zip(specs, chunks):
                values = (np.concatenate(chunk) if chunk
                          else np.zeros((0, size), dtype=np.float32))
                if scalar:
                    children.append(pa.array(values.reshape(-1).astype(np.float64)))
                else:
                    flat = pa.array(values.astype(np.float32, copy=False).reshape(-1))
                    children.append(pa.FixedSizeListArray.from_arrays(flat, size)
                                    .cast(pa.list_(pa.float32())))
            yield pa.StructArray.from_arrays(children, fields=[
                pa.field(name, child.type, nullable=False)
                for (name, *_), child in zip(specs, children)])

    fns = _columns.for_frame(df)
    F = fns.F
    udf = fns.arrow_iter_udf(predict, StructType(fields))
    out = df.withColumn(_STRUCT, udf(*_input_expressions(fns, model, metadata)))
    # withColumns + drop: a select of every column of df cost a JVM round trip per column on
    # the driver (tens of ms per transform call for a wide DataFrame).
    outputs = {}
    for name, _, _, as_vector in specs:
        value = F.col(_STRUCT).getField(name)
        outputs[name] = fns.array_to_vector(value) if as_vector else value
    return out.withColumns(outputs).drop(_STRUCT)
