"""``Model.transform``: predictions in batches through an Arrow UDF, never row by row.

Feature columns are turned into arrays the same way as for training (Spark ML vectors through
``vector_to_array``), each Arrow batch becomes NumPy arrays without per-row Python work, the
model runs on ``batch_size`` rows at a time, and its outputs come back as new columns: a double
when the output has one value per row and the label was a scalar, an array of floats otherwise
(a Spark ML vector when the label was one). Every other column of the DataFrame is kept.
"""

from __future__ import annotations

import collections
import threading
import uuid

import numpy as np

from . import _columns

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


def reshape_batch(array: np.ndarray, shape) -> np.ndarray:
    """``array`` (rows first) reshaped to ``shape``, whose first entry may be -1/None for the
    batch dimension (Horovod's ``input_shapes`` convention); no shape → unchanged."""
    if shape is None:
        return array
    shape = list(shape)
    if shape and shape[0] in (-1, None):
        shape = shape[1:]
    return array.reshape((len(array), *shape))


def arrow_to_numpy(array, shape, dtype, column: str) -> np.ndarray:
    """One Arrow column (scalars, or fixed-length possibly nested lists) as a NumPy array of
    ``(rows, *shape)``."""
    import pyarrow as pa
    if array.null_count:
        raise ValueError(f"column {column!r} has {array.null_count} null value(s) in a batch; "
                         "fill or drop them before transform")
    rows = len(array)
    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or \
            pa.types.is_fixed_size_list(array.type):
        array = array.flatten()
        if array.null_count:
            raise ValueError(f"column {column!r} has null values inside its arrays; fill or "
                             "drop them before transform")
    values = array.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    if values.size != rows * int(np.prod(shape or [1])):
        raise ValueError(f"column {column!r}: expected {list(shape)} values per row (the shape "
                         f"seen in training), got {values.size} values in {rows} rows")
    return values.reshape((rows, *shape))


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
