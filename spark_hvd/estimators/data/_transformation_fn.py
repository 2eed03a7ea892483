"""``transformation_fn`` on the ranks, in either style:

* spark_hvd's: the function takes a batch as a dict ``column -> np.ndarray (rows, *shape)`` and
  returns such a dict (or a pandas DataFrame);
* Horovod's: the function takes a pandas DataFrame, as Petastorm's ``TransformSpec`` hands it
  with ``make_batch_reader`` (one row per batch row; an array column holds one NumPy array per
  row), and returns a DataFrame; or it takes one row as a dict of NumPy values, as a
  TransformSpec gets it with ``make_reader`` (what Horovod's Torch and Keras data modules use
  when a transformation_fn is set), and returns such a dict. ``transformation_edit_fields`` (``(name, numpy_dtype, shape, is_nullable)``
  tuples, Petastorm's ``edit_fields``) give the dtype and shape of columns it adds or changes,
  and ``transformation_removed_fields`` the columns it drops.

``transformation_fn_input`` picks the style: ``"numpy"``, ``"pandas"``, ``"rows"``, or ``None``
(default): the first batch is offered as a dict of arrays (unless edit or removed fields are
given, which only mean something to a TransformSpec), then as a DataFrame, then row by row;
the first style the function does not fail on is kept for the rest of the run. A function that
works in several (``batch["x"] = batch["x"] * 2``) gives the same result in each.

The result is always a dict of NumPy arrays with the batch dimension first, which is what the
training loops of both frameworks take. Pure NumPy/pandas: no torch or TensorFlow import.
"""

from __future__ import annotations

import numpy as np

STYLES = ("numpy", "pandas", "rows")


def make_batch_transform(fn, edit_fields=None, removed_fields=None, style=None):
    """The picklable ``batch dict -> batch dict`` function the ranks apply to every batch, or
    None without ``fn``. Raises ValueError for a malformed field spec or style."""
    if fn is None:
        if edit_fields or removed_fields:
            raise ValueError("transformation_edit_fields / transformation_removed_fields are "
                             "set but transformation_fn is not")
        return None
    if not callable(fn):
        raise ValueError(f"transformation_fn must be callable, got {type(fn).__name__}")
    if style is not None and style not in STYLES:
        raise ValueError(f"transformation_fn_input must be one of {STYLES} or None, got "
                         f"{style!r}")
    return BatchTransform(fn, _edit_specs(edit_fields), list(removed_fields or []), style)


def _edit_specs(edit_fields):
    specs = []
    for field in edit_fields or []:
        name = getattr(field, "name", None)
        if name is not None:       # a Petastorm UnischemaField
            dtype, shape = field.numpy_dtype, field.shape
        else:
            if not isinstance(field, (tuple, list)) or len(field) < 3:
                raise ValueError(f"transformation_edit_fields: {field!r} is not a "
                                 "(name, numpy_dtype, shape, is_nullable) tuple")
            name, dtype, shape = field[0], field[1], field[2]
        try:
            dtype = np.dtype(dtype)
        except TypeError as e:
            raise ValueError(f"transformation_edit_fields: field {name!r} has dtype "
                             f"{dtype!r}, which is not a NumPy dtype") from e
        shape = tuple(-1 if d is None else int(d) for d in (shape or ()))
        specs.append((name, dtype, shape))
    return specs


class BatchTransform:
    """Applies a ``transformation_fn`` to a batch dict (see the module docstring)."""

    def __init__(self, fn, edit_specs, removed, style):
        self.fn, self.edit_specs, self.removed = fn, edit_specs, removed
        self.style = style
        # Edit/removed fields belong to a TransformSpec: the function is Horovod's.
        self._candidates = ("pandas", "rows") if edit_specs or removed else STYLES

    def __call__(self, batch: dict) -> dict:
        if self.style is None:
            out = self._first_call(batch)
        else:
            out = self._apply(self.style, batch)
        return self._finish(out, len(next(iter(batch.values()))))

    def _apply(self, style, batch):
        if style == "numpy":
            return self.fn(batch)
        if style == "pandas":
            return self.fn(to_pandas(batch))
        rows = len(next(iter(batch.values())))
        results = [self.fn({k: v[i] for k, v in batch.items()}) for i in range(rows)]
        if not all(isinstance(r, dict) for r in results):
            raise TypeError("a row function must return a dict")
        return {k: np.stack([np.asarray(r[k]) for r in results]) for k in results[0]}

    def _first_call(self, batch):
        errors = []
        for style in self._candidates:
            try:
                # On copies: a function that changes arrays in place and then fails must
                # leave the batch intact for the next attempt.
                out = self._apply(style, {k: v.copy() for k, v in batch.items()})
                if not (_is_frame(out) or isinstance(out, dict)):
                    raise TypeError(f"it returned {type(out).__name__}")
            except Exception as e:  # noqa: BLE001 - the function is of another style
                errors.append(f"as {_DESCRIPTIONS[style]}: {type(e).__name__}: {e}")
                continue
            self.style = style
            return out
        raise ValueError("transformation_fn failed on the first batch "
                         + "; ".join(errors) + ". Set transformation_fn_input to one of "
                         f"{STYLES} to see that style's error alone")

    def _finish(self, out, rows):
        if _is_frame(out):
            out = from_pandas(out)
        elif not isinstance(out, dict):
            raise ValueError(f"transformation_fn must return a dict of column arrays or a "
                             f"pandas DataFrame, got {type(out).__name__}")
        out = {k: v for k, v in out.items() if k not in self.removed}
        for name, dtype, shape in self.edit_specs:
            if name not in out:
                raise ValueError(f"transformation_fn did not return column {name!r}, which "
                                 "transformation_edit_fields lists")
            array = np.asarray(out[name], dtype=dtype)
            out[name] = array.reshape((len(array),) + shape) if shape else array
        for name, value in out.items():
            if not isinstance(value, np.ndarray):
                out[name] = np.asarray(value)
        bad = {k: len(v) for k, v in out.items() if v.ndim == 0 or len(v) != rows}
        if bad:
            raise ValueError(f"transformation_fn returned column(s) without one value per "
                             f"batch row ({rows} rows): {bad}")
        return out


_DESCRIPTIONS = {"numpy": "a dict of NumPy arrays", "pandas": "a pandas DataFrame",
                 "rows": "one row at a time (a dict of values)"}


def _is_frame(value) -> bool:
    return type(value).__name__ == "DataFrame" and hasattr(value, "columns")


def to_pandas(batch: dict):
    """A batch as Petastorm hands it to a TransformSpec: scalar columns as numbers, array
    columns as one NumPy array per row."""
    import pandas as pd
    return pd.DataFrame({name: (list(values) if values.ndim > 1 else values)
                         for name, values in batch.items()})


def from_pandas(frame) -> dict:
    """A DataFrame back to a batch dict: columns of arrays (or lists) are stacked."""
    out = {}
    for name in frame.columns:
        values = frame[name].to_numpy()
        if values.dtype == object and len(values):
            values = np.stack([np.asarray(v) for v in values])
        out[name] = values
    return out
