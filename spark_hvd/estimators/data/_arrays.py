"""Batch columns as NumPy arrays of the shape a model takes, for training (the ranks) and for
``Model.transform`` (Spark's Python workers) alike: an Arrow column turned into an array of
``(rows, *shape)``, and a batch reshaped by ``input_shapes`` / ``label_shapes``. NumPy and
PyArrow only."""

from __future__ import annotations

import numpy as np


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
