"""DataFrame → Parquet shards in a Store, in the format of ``_format`` (the loader's contract).

``prepare_data`` validates the training columns, splits off validation rows, and writes
``num_proc * partitions_per_process`` balanced shard files per split, then ``_metadata.json``
last. It uses DataFrame APIs only (no ``df.rdd``, no SparkContext), so it runs the same under a
classic and a Spark Connect session, and it writes the files itself from ``mapInArrow`` tasks
through the Store (not with Spark's Parquet writer), so any Store works, including fsspec URLs
Spark cannot write to. Executors must reach the Store (a shared path, HDFS, an object store):
``memory://`` lives in one Python process and does NOT work here.

Type decisions (recorded per column in the metadata as dtype, shape, kind):

- numeric scalars keep their width: byte→int8, short→int16, int→int32, long→int64,
  float→float32, double→float64; decimal→float64 (cast by Spark; precision beyond a double's
  is lost); boolean→bool.
- arrays (of arrays ...) of those keep their element dtype and must have one fixed shape over
  all rows, e.g. ``array<array<float>>`` of 28x28 → float32, shape [28, 28].
- Spark ML vectors (dense or sparse, ``pyspark.ml.linalg`` or ``pyspark.mllib.linalg``) become
  dense ``float32`` arrays by default (what deep-learning models take; ``vector_dtype="float64"``
  keeps doubles), all of one size.
- strings, binary, maps, structs, dates, timestamps, intervals are refused with an error
  saying how to encode them.

No torch or TensorFlow import here: this runs on the driver and on Spark executors.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import posixpath
import sys
import threading
import time

from spark_hvd.estimators.data import _columns, _format
from spark_hvd.estimators.store import Store

__all__ = ["prepare_data", "load_metadata", "data_key_of", "describe_parquet", "check_columns",
           "check_rank_rows", "dataset_in_use", "active_dataset"]

# Row groups: at most this many rows, and about this many bytes (the loader shuffles across
# row groups, so large files should have several).
MAX_ROW_GROUP_ROWS = 65536
TARGET_ROW_GROUP_BYTES = 8 << 20
DEFAULT_SEED = 0
_VAL_FLAG = "__spark_hvd_is_val__"

_INTEGRAL = {"byte": "int8", "short": "int16", "integer": "int32", "long": "int64"}
_FLOATING = {"float": "float32", "double": "float64", "decimal": "float64"}
_HINTS = {
    "string": "encode it as numbers first (e.g. pyspark.ml.feature.StringIndexer, or "
              "a vector of embeddings)",
    "varchar": "encode it as numbers first (e.g. pyspark.ml.feature.StringIndexer)",
    "char": "encode it as numbers first (e.g. pyspark.ml.feature.StringIndexer)",
    "binary": "decode it into a numeric array first",
    "map": "turn it into fixed numeric columns or a fixed-size array first",
    "struct": "select its fields as separate columns (col('s.field')) first",
    "date": "convert it to a number first (e.g. unix_date, or year/month/day columns)",
    "timestamp": "convert it to a number first (e.g. unix_seconds or unix_timestamp)",
    "timestamp_ntz": "convert it to a number first (e.g. unix_seconds)",
    "void": "it holds only nulls; drop it",
}


def _log(verbose, message):
    if verbose:
        print(f"spark_hvd.estimators: {message}", file=sys.stderr, flush=True)


def _functions(df):
    """(functions module, vector_to_array) for ``df``'s kind of session."""
    fns = _columns.for_frame(df)
    return fns.F, fns.vector_to_array


def _quote(name: str) -> str:
    # Backticks so that names with dots or spaces are columns, not struct fields.
    return "`" + name.replace("`", "``") + "`"


class _Column:
    """What is written for one training column (also pickled to the executors)."""

    def __init__(self, name, kind, dtype, depth=0, shape=None):
        self.name, self.kind, self.dtype, self.depth = name, kind, dtype, depth
        self.shape = list(shape or [])

    @property
    def size(self):
        return math.prod(self.shape)

    def arrow_type(self):
        import pyarrow as pa
        t = pa.from_numpy_dtype(self.dtype)
        return t if self.kind == "scalar" else pa.list_(t, self.size)

    def meta(self):
        return {"dtype": self.dtype, "shape": list(self.shape), "kind": self.kind}


def _is_vector(dt) -> bool:
    from pyspark.sql.types import UserDefinedType
    return isinstance(dt, UserDefinedType) and type(dt).__name__ == "VectorUDT"


def _leaf_dtype(dt):
    """The NumPy dtype name of a scalar Spark type, None if unsupported."""
    name = dt.typeName()
    if name == "boolean":
        return "bool"
    return _INTEGRAL.get(name) or _FLOATING.get(name)


def _describe(dt) -> str:
    try:
        return dt.simpleString()
    except Exception:  # noqa: BLE001 - a UDT without one
        return type(dt).__name__


def _column_spec(name, dt, role, vector_dtype):
    """The _Column for Spark type ``dt``, or ValueError saying why it cannot be trained on."""
    from pyspark.sql.types import ArrayType
    if _is_vector(dt):
        return _Column(name, "vector", vector_dtype, depth=1)
    leaf, depth = dt, 0
    while isinstance(leaf, ArrayType):
        leaf, depth = leaf.elementType, depth + 1
    dtype = _leaf_dtype(leaf)
    if dtype is None:
        what = f"arrays of {_describe(leaf)}" if depth else _describe(dt)
        hint = _HINTS.get(leaf.typeName(), "convert it to a numeric type first")
        if _is_vector(leaf):
            hint = "use one vector per row (or an array of numbers)"
        raise ValueError(
            f"{role} column {name!r} has type {_describe(dt)}: {what} cannot be used for "
            f"training; {hint}. Supported: numeric and boolean columns, (nested) arrays of "
            f"them with a fixed shape, and Spark ML vectors.")
    return _Column(name, "array" if depth else "scalar", dtype, depth=depth)


def _array_type_nulls(dt) -> list[bool]:
    """containsNull of each array level of ``dt``."""
    from pyspark.sql.types import ArrayType
    out = []
    while isinstance(dt, ArrayType):
        out.append(dt.containsNull)
        dt = dt.elementType
    return out


def _flatten_times(F, c, times):
    for _ in range(times):
        c = F.flatten(c)
    return c


def _validation_spec(validation):
    """('none'|'fraction'|'column', value), ValueError for anything else."""
    if validation is None:
        return "none", None
    if isinstance(validation, bool):
        raise ValueError(f"validation={validation!r}: give a fraction in (0, 1) or the name of a "
                         "boolean/0-1 column, or None for no validation split")
    if isinstance(validation, (int, float)):
        if not 0.0 < float(validation) < 1.0:
            raise ValueError(f"validation={validation!r}: a validation fraction must be strictly "
                             "between 0 and 1 (e.g. 0.1), or None for no validation split")
        return "fraction", float(validation)
    if isinstance(validation, str):
        return "column", validation
    raise ValueError(f"validation={validation!r}: give a fraction in (0, 1), a column name, or "
                     "None")


def _plan_fingerprint(df) -> str:
    """A fingerprint of ``df``'s query plan: Spark's semanticHash (both session kinds have it;
    equal for the same DataFrame), else the plan's text, else a random value (no reuse)."""
    try:
        return f"semantic:{df.semanticHash()}"
    except Exception:  # noqa: BLE001 - a session that cannot tell
        pass
    try:
        if type(df).__module__.startswith("pyspark.sql.connect"):
            return "plan:" + str(df._plan.to_proto(df._session.client))
        return "plan:" + df._jdf.queryExecution().analyzed().toString()
    except Exception:  # noqa: BLE001
        import uuid
        return "random:" + uuid.uuid4().hex


def data_key_of(df, columns, validation, num_files, random_seed, vector_dtype) -> str:
    """The key of the prepared data for these inputs: equal keys mean equal shards.

    Hashes the DataFrame's plan fingerprint, the selected columns and their types, the
    validation spec, the number of files, the seed, the vector dtype and the format version.
    A DataFrame read from files is keyed by its plan (paths), not the files' content: after
    changing the files in place, use a new Store prefix or delete ``intermediate/``.
    """
    spec = {
        "plan": _plan_fingerprint(df),
        "schema": [(n, _describe(t)) for n, t in columns],
        "validation": list(_validation_spec(validation)),
        "num_files": num_files,
        "seed": random_seed,
        "vector_dtype": vector_dtype,
        "format_version": _format.FORMAT_VERSION,
    }
    blob = json.dumps(spec, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def load_metadata(store: Store, data_key: str) -> dict:
    """The ``_metadata.json`` of prepared data ``data_key`` in ``store``.

    FileNotFoundError if that data was never completely prepared.
    """
    path = store.join(store.get_data_path(data_key), _format.METADATA_FILE)
    if not store.exists(path):
        raise FileNotFoundError(f"no prepared data {data_key!r} in {store!r} ({path} is missing; "
                                "prepare_data writes it last, so the data is incomplete or gone)")
    return json.loads(store.read_text(path))


def prepare_data(df, store: Store, *, num_proc: int, partitions_per_process: int = 1,
                 feature_cols, label_cols, sample_weight_col: str | None = None,
                 validation=None, random_seed: int | None = None, verbose: int = 1,
                 vector_dtype: str = "float32", row_group_size: int | None = None) -> dict:
    """Write ``df``'s training columns as Parquet shards into ``store``; return the metadata.

    Args:
        df: a classic or Spark Connect DataFrame.
        store: where to write (executors must reach it: not ``memory://``).
        num_proc: number of training ranks; every rank needs at least one training row.
        partitions_per_process: files per rank and split (N = num_proc * this).
        feature_cols, label_cols: column names (a name may be in both, e.g. autoencoders).
        sample_weight_col: optional numeric scalar column of per-row weights.
        validation: None; a fraction in (0, 1) of rows drawn at random (seeded with
            ``random_seed``, default 0, so the split is the same on every run over the same
            deterministic input); or the name of a boolean or 0/1 integer column whose
            true/1 rows are the validation rows (that column is not written).
        random_seed: seed of the validation split (None → 0).
        verbose: 0 silent, 1 one line per call on stderr.
        vector_dtype: dtype of Spark ML vector columns, "float32" (default) or "float64".
        row_group_size: rows per Parquet row group (default: up to 65536 rows, ~8 MiB).

    Returns the ``_metadata.json`` dict of ``_format`` (``data_key`` included). When data for
    the same DataFrame plan, columns, split, N, seed and dtype is already complete in the store
    it is returned without writing anything. Raises ValueError, naming the column and what to
    do, for missing columns, unsupported types, nulls, arrays of varying length, an empty
    DataFrame or split, a bad validation spec, or fewer training rows than ``num_proc``.
    """
    if not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"num_proc={num_proc!r}: must be a positive integer")
    if not isinstance(partitions_per_process, int) or partitions_per_process < 1:
        raise ValueError(f"partitions_per_process={partitions_per_process!r}: must be a positive "
                         "integer")
    if row_group_size is not None and (not isinstance(row_group_size, int) or row_group_size < 1):
        raise ValueError(f"row_group_size={row_group_size!r}: must be a positive integer or None")
    if vector_dtype not in ("float32", "float64"):
        raise ValueError(f"vector_dtype={vector_dtype!r}: must be 'float32' or 'float64'")
    feature_cols = _as_list(feature_cols, "feature_cols")
    label_cols = _as_list(label_cols, "label_cols")
    if not feature_cols:
        raise ValueError("feature_cols is empty: name at least one feature column")
    mode, val_value = _validation_spec(validation)
    seed = DEFAULT_SEED if random_seed is None else int(random_seed)
    num_files = num_proc * partitions_per_process

    # 1. Columns exist and have supported types (no Spark job yet).
    roles = [(c, "feature") for c in feature_cols] + [(c, "label") for c in label_cols]
    if sample_weight_col is not None:
        roles.append((sample_weight_col, "sample weight"))
    needed = [c for c, _ in roles] + ([val_value] if mode == "column" else [])
    types = {f.name: f.dataType for f in df.schema.fields}
    missing = [c for c in dict.fromkeys(needed) if c not in types]
    if missing:
        raise ValueError(f"column(s) {missing} not found in the DataFrame; its columns are "
                         f"{list(types)}. Check feature_cols/label_cols/sample_weight_col/"
                         "validation.")
    columns, seen = [], set()
    for name, role in roles:
        if name in seen:
            continue
        seen.add(name)
        col = _column_spec(name, types[name], role, vector_dtype)
        if role == "sample weight" and (col.kind != "scalar" or col.dtype == "bool"):
            raise ValueError(f"sample weight column {name!r} has type "
                             f"{_describe(types[name])}: it must be a numeric scalar column")
        columns.append(col)
    if mode == "column":
        vt = types[val_value].typeName()
        if vt != "boolean" and vt not in _INTEGRAL:
            raise ValueError(f"validation column {val_value!r} has type "
                             f"{_describe(types[val_value])}: it must be boolean, or an integer "
                             "column of 0 (train) and 1 (validation)")

    key = data_key_of(df, [(c.name, types[c.name]) for c in columns], validation, num_files,
                      seed, vector_dtype)
    data_path = store.get_data_path(key)
    split_dirs = {"train": store.get_train_data_path(key)}
    if mode != "none":
        split_dirs["val"] = store.get_val_data_path(key)
    if store.exists(store.join(data_path, _format.METADATA_FILE)):
        _log(verbose, f"reusing prepared data {key} ({data_path})")
        return load_metadata(store, key)

    started = time.monotonic()
    F, vector_to_array = _functions(df)
    # 2. One aggregation pass: row count, nulls, array lengths, validation column values.
    total = _check_data(df, F, vector_to_array, columns, types, mode, val_value, num_proc)

    # 3. Select and convert (vectors → arrays, decimals → double), add the validation flag.
    exprs = [_convert_expr(F, vector_to_array, c, types[c.name]) for c in columns]
    if mode == "fraction":
        # rand() before the repartition: the split depends only on the input's partitions and
        # row order, so the same seed gives the same split on a deterministic input.
        exprs.append((F.rand(seed) < F.lit(val_value)).alias(_VAL_FLAG))
    elif mode == "column":
        v = F.col(_quote(val_value))
        flag = v if types[val_value].typeName() == "boolean" else (v == F.lit(1))
        exprs.append(flag.alias(_VAL_FLAG))
    has_val = mode != "none"
    if row_group_size is None:
        row_bytes = max(1, sum(c.size * _itemsize(c.dtype) for c in columns))
        row_group_size = max(1, min(MAX_ROW_GROUP_ROWS, TARGET_ROW_GROUP_BYTES // row_bytes))

    # 4. Write: N round-robin partitions (balanced row counts), one file per split each, written
    # by the task itself through the Store. train and val come from the same pass over the data,
    # so every row lands in exactly one split even if the input is re-read.
    writer = _PartitionWriter(store, split_dirs, columns, int(row_group_size))
    written = (df.select(*exprs).repartition(num_files)
               .mapInArrow(writer, "index int, split string, path string, rows long").collect())
    splits = _collect_splits(writer, written, num_files)

    # 5. Split sizes are known only now for a random split: check before declaring it complete.
    try:
        _check_splits(splits, num_proc, mode, val_value)
    except ValueError:
        for directory in split_dirs.values():
            store.delete(directory)
        raise
    got = sum(s["total_rows"] for s in splits.values() if s)
    if got != total:
        _log(verbose, f"warning: the DataFrame had {total} rows when checked but {got} when "
                      "written (is its source changing or non-deterministic?)")
    metadata = {
        "format_version": _format.FORMAT_VERSION,
        "data_key": key,
        "feature_cols": feature_cols,
        "label_cols": label_cols,
        "sample_weight_col": sample_weight_col,
        "columns": {c.name: c.meta() for c in columns},
        "splits": {"train": splits["train"], "val": splits.get("val")},
    }
    # Written last: its presence means the data is complete.
    store.write_text(store.join(data_path, _format.METADATA_FILE),
                     json.dumps(metadata, indent=1))
    val = splits.get("val")
    _log(verbose, f"prepared data {key}: {splits['train']['total_rows']} train"
                  + (f" + {val['total_rows']} val" if val else "")
                  + f" rows in {num_files} file(s) per split at "
                  + " and ".join(split_dirs.values()) + " "
                  f"({time.monotonic() - started:.1f} s)")
    return metadata


def _as_list(cols, what):
    if cols is None:
        return []
    if isinstance(cols, str):
        return [cols]
    cols = list(cols)
    bad = [c for c in cols if not isinstance(c, str)]
    if bad:
        raise ValueError(f"{what} must be column names (strings), got {bad}")
    return cols


def _itemsize(dtype):
    import numpy as np
    return np.dtype(dtype).itemsize


def _convert_expr(F, vector_to_array, col, spark_type):
    c = F.col(_quote(col.name))
    if col.kind == "vector":
        c = vector_to_array(c, col.dtype)
    elif "decimal" in _describe(spark_type):
        from pyspark.sql.types import ArrayType, DoubleType
        target = DoubleType()
        for _ in range(col.depth):
            target = ArrayType(target)
        c = c.cast(target)
    return c.alias(col.name)


def _check_data(df, F, vector_to_array, columns, types, mode, val_value, num_proc):
    """One aggregation over ``df``: fail on an empty DataFrame, nulls, varying array lengths or
    a bad validation column; set each array column's shape. Returns the number of rows."""
    aggs = {"rows": F.count(F.lit(1))}
    for i, col in enumerate(columns):
        c = F.col(_quote(col.name))
        aggs[f"null{i}"] = F.count_if(c.isNull())
        if col.kind == "vector":
            size = F.size(vector_to_array(c, "float64"))
            aggs[f"min{i}_0"], aggs[f"max{i}_0"] = F.min(size), F.max(size)
        elif col.kind == "array":
            nulls = _array_type_nulls(types[col.name])
            # Nulls inside the arrays, at any level: F.exists over each level's elements.
            inner = [F.exists(_flatten_times(F, c, lvl), lambda x: x.isNull())
                     for lvl, may_be_null in enumerate(nulls) if may_be_null]
            if inner:
                any_inner = inner[0]
                for e in inner[1:]:
                    any_inner = any_inner | e
                aggs[f"inull{i}"] = F.count_if(c.isNotNull() & F.coalesce(any_inner, F.lit(True)))
            for lvl in range(col.depth):
                if lvl == 0:
                    lo = hi = F.size(c)
                else:
                    sizes = F.transform(_flatten_times(F, c, lvl - 1), lambda x: F.size(x))
                    lo, hi = F.array_min(sizes), F.array_max(sizes)
                aggs[f"min{i}_{lvl}"], aggs[f"max{i}_{lvl}"] = F.min(lo), F.max(hi)
    if mode == "column":
        v = F.col(_quote(val_value))
        aggs["vnull"] = F.count_if(v.isNull())
        if types[val_value].typeName() == "boolean":
            aggs["vrows"] = F.count_if(v)
        else:
            aggs["vrows"] = F.count_if(v == F.lit(1))
            aggs["vbad"] = F.count_if(~v.isin(0, 1))
    row = df.agg(*[e.alias(k) for k, e in aggs.items()]).collect()[0].asDict()

    total = row["rows"]
    if total == 0:
        raise ValueError("the DataFrame is empty: there is nothing to train on")
    nulls = {c.name: row[f"null{i}"] for i, c in enumerate(columns) if row[f"null{i}"]}
    if nulls:
        detail = ", ".join(f"{n!r}: {k} of {total} rows" for n, k in nulls.items())
        raise ValueError(f"null values in training column(s) ({detail}); fill them "
                         "(DataFrame.fillna / na.fill) or drop those rows (na.drop) first")
    for i, col in enumerate(columns):
        if row.get(f"inull{i}"):
            raise ValueError(f"column {col.name!r} has null elements inside its arrays in "
                             f"{row[f'inull{i}']} of {total} rows; replace them (e.g. with "
                             "transform(col, x -> coalesce(x, 0))) or drop those rows first")
        if col.kind == "scalar":
            continue
        shape = []
        for lvl in range(col.depth):
            lo, hi = row[f"min{i}_{lvl}"], row[f"max{i}_{lvl}"]
            where = "" if lvl == 0 else f" at nesting level {lvl + 1}"
            if lo != hi:
                raise ValueError(
                    f"column {col.name!r} has {col.kind}s of varying length{where}: lengths "
                    f"from {lo} to {hi} were seen; every row needs the same shape (pad or "
                    "truncate them, e.g. with slice/concat, or filter the rows)")
            if not lo:
                raise ValueError(f"column {col.name!r} has empty {col.kind}s{where} (length "
                                 f"{lo}); there is nothing to train on in it")
            shape.append(int(lo))
        col.shape = shape
    if mode == "column":
        if row["vnull"]:
            raise ValueError(f"validation column {val_value!r} has nulls in {row['vnull']} of "
                             f"{total} rows; fill them (false/0 = train) first")
        if row.get("vbad"):
            raise ValueError(f"validation column {val_value!r} has {row['vbad']} rows with "
                             "values other than 0 (train) and 1 (validation)")
        val_rows = row["vrows"]
        if val_rows == 0:
            raise ValueError(f"validation column {val_value!r} marks no rows for validation; "
                             "set it true/1 on some rows or pass validation=None")
        if val_rows == total:
            raise ValueError(f"validation column {val_value!r} marks every row for validation, "
                             "leaving no training rows")
        if total - val_rows < num_proc:
            raise ValueError(f"only {total - val_rows} training rows for num_proc={num_proc}: "
                             "every rank needs at least one; use fewer processes or more data")
    elif total < num_proc:
        raise ValueError(f"only {total} rows for num_proc={num_proc}: every rank needs at least "
                         "one training row; use fewer processes or more data")
    return total


def _check_splits(splits, num_proc, mode, val_value):
    train = splits["train"]["total_rows"]
    if train == 0:
        raise ValueError("the training split is empty: lower the validation fraction")
    if train < num_proc:
        raise ValueError(f"only {train} training rows for num_proc={num_proc}: every rank needs "
                         "at least one; use fewer processes, more data or less validation")
    val = splits.get("val")
    if val is not None and val["total_rows"] == 0:
        raise ValueError(f"the validation split is empty (validation={val_value!r}): use a "
                         "larger fraction or more data")


def _collect_splits(writer, written, num_files):
    """Per-split directories, file lists and row counts from the tasks' rows (sorted by
    index); writes an empty file for any partition whose task reported nothing."""
    splits = {s: {} for s in writer.split_dirs}
    for r in written:
        if r["index"] >= num_files or r["split"] not in splits:
            raise RuntimeError(f"unexpected shard {r['split']}/{r['path']} (index {r['index']}) "
                               f"from a write task; expected {num_files} partitions")
        splits[r["split"]][r["index"]] = (r["path"], r["rows"])
    for split, found in splits.items():
        for index in range(num_files):
            if index not in found:
                found[index] = (writer.write_empty(split, index), 0)
    return {split: {"dir": writer.store.fs_path(writer.split_dirs[split]),
                    "files": [found[i][0] for i in range(num_files)],
                    "rows": [int(found[i][1]) for i in range(num_files)],
                    "total_rows": int(sum(found[i][1] for i in range(num_files)))}
            for split, found in splits.items()}


class _PartitionWriter:
    """The ``mapInArrow`` function: writes its partition's rows as one Parquet file per split
    through the Store and yields one (index, split, file name, rows) row per file. Pickled to
    executors."""

    def __init__(self, store, split_dirs, columns, row_group_size):
        self.store, self.split_dirs, self.columns = store, split_dirs, columns
        self.has_val, self.row_group_size = "val" in split_dirs, row_group_size

    def schema(self):
        import pyarrow as pa
        return pa.schema([pa.field(c.name, c.arrow_type(), nullable=False)
                          for c in self.columns])

    def write_empty(self, split, index):
        """Write an empty shard (schema only) and return its file name."""
        import pyarrow.parquet as pq
        name = _format.part_file(index)
        with self.store.atomic_writer(self.store.join(self.split_dirs[split], name)) as f:
            pq.ParquetWriter(f, self.schema()).close()
        return name

    def __call__(self, batches):
        import pyarrow as pa
        import pyarrow.compute as pc
        from pyspark import TaskContext
        index = TaskContext.get().partitionId()
        schema = self.schema()
        splits = ("train", "val") if self.has_val else ("train",)
        with contextlib.ExitStack() as stack:
            shards = {}
            for split in splits:
                name = _format.part_file(index)
                f = stack.enter_context(
                    self.store.atomic_writer(self.store.join(self.split_dirs[split], name)))
                shards[split] = _ShardFile(f, schema, self.row_group_size, name)
                # Closed (footer written) before its atomic_writer renames it: LIFO.
                stack.callback(shards[split].close)
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                table = self._convert(batch, schema)
                if self.has_val:
                    flag = batch.column(_VAL_FLAG)
                    shards["val"].add(table.filter(flag))
                    shards["train"].add(table.filter(pc.invert(flag)))
                else:
                    shards["train"].add(table)
        for split in splits:
            s = shards[split]
            yield pa.RecordBatch.from_arrays(
                [pa.array([index], pa.int32()), pa.array([split]), pa.array([s.rel]),
                 pa.array([s.rows], pa.int64())], names=["index", "split", "path", "rows"])

    def _convert(self, batch, schema):
        """The batch's training columns in the format's encoding (fixed_size_list for arrays)."""
        import pyarrow as pa
        import pyarrow.compute as pc
        arrays = []
        for col, field in zip(self.columns, schema):
            arr = batch.column(col.name)
            if col.kind == "scalar":
                arrays.append(arr.cast(field.type))
                continue
            values = pc.list_flatten(arr, recursive=True) if col.depth else arr
            if len(values) != len(arr) * col.size or arr.null_count:
                raise ValueError(f"column {col.name!r}: a row does not have shape {col.shape} "
                                 "(or is null) although every row had it when checked; is the "
                                 "DataFrame's source changing?")
            values = values.cast(field.type.value_type)
            arrays.append(pa.FixedSizeListArray.from_arrays(values, col.size))
        return pa.Table.from_arrays(arrays, schema=schema)


class _ShardFile:
    """One Parquet file being written: buffers rows into row groups of ``row_group_size``."""

    def __init__(self, f, schema, row_group_size, rel):
        import pyarrow.parquet as pq
        self.writer = pq.ParquetWriter(f, schema)
        self.row_group_size, self.rel = row_group_size, rel
        self.pending, self.pending_rows, self.rows = [], 0, 0

    def add(self, table):
        if table.num_rows == 0:
            return
        self.pending.append(table)
        self.pending_rows += table.num_rows
        self.rows += table.num_rows
        if self.pending_rows >= self.row_group_size:
            self._flush(full_only=True)

    def _flush(self, full_only):
        import pyarrow as pa
        table = pa.concat_tables(self.pending)
        keep = table.num_rows % self.row_group_size if full_only else 0
        head = table.slice(0, table.num_rows - keep)
        if head.num_rows:
            self.writer.write_table(head, row_group_size=self.row_group_size)
        self.pending = [table.slice(table.num_rows - keep)] if keep else []
        self.pending_rows = keep

    def close(self):
        if self.pending_rows:
            self._flush(full_only=False)
        self.writer.close()


# -- data sets in use (Horovod's ``util.prepare_data`` blocks) ----------------------------------

_in_use_lock = threading.Lock()
_in_use: list = []          # (store, data_key) of the open prepare_data blocks, innermost last


@contextlib.contextmanager
def dataset_in_use(store: Store, data_key: str):
    """Marks ``data_key`` as the data of an open ``util.prepare_data`` block on ``store``, for
    :func:`active_dataset`."""
    entry = (store, data_key)
    with _in_use_lock:
        _in_use.append(entry)
    try:
        yield data_key
    finally:
        with _in_use_lock:
            _in_use.reverse()
            _in_use.remove(entry)   # the innermost equal entry
            _in_use.reverse()


def active_dataset(store: Store) -> str | None:
    """The data key of the innermost open ``util.prepare_data`` block on ``store`` (None
    outside one)."""
    with _in_use_lock:
        for open_store, key in reversed(_in_use):
            if open_store == store:
                return key
    return None


# -- checks shared by fit and fit_on_parquet ----------------------------------------------------

def check_columns(metadata: dict, feature_cols, label_cols, sample_weight_col=None) -> None:
    """ValueError naming the columns a fit needs that the prepared data does not have."""
    needed = list(feature_cols or []) + list(label_cols or [])
    if sample_weight_col:
        needed.append(sample_weight_col)
    have = metadata.get("columns") or {}
    missing = [c for c in dict.fromkeys(needed) if c not in have]
    if missing:
        raise ValueError(f"column(s) {missing} are not in the prepared data "
                         f"{metadata.get('data_key')!r}, which has {sorted(have)}; prepare it "
                         "with these columns")


def check_rank_rows(metadata: dict, num_proc: int) -> None:
    """ValueError unless every one of ``num_proc`` ranks owns training rows (rank ``r`` reads
    the files ``i % num_proc == r``)."""
    train = metadata["splits"]["train"]
    rows = [sum(_format.files_of_rank(train["rows"], r, num_proc)) for r in range(num_proc)]
    empty = [r for r, n in enumerate(rows) if n == 0]
    if empty:
        raise ValueError(
            f"the training data has {len(train['files'])} file(s) with {train['rows']} rows, so "
            f"rank(s) {empty} of num_proc={num_proc} would get no rows (rank r reads the files "
            f"i % {num_proc} == r): write it as more files (df.repartition({num_proc} * k) "
            "before .write.parquet), use util.prepare_data, or use fewer processes")


# -- existing Parquet data (fit_on_parquet) -----------------------------------------------------

_ARROW_DTYPES = {"int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
                 "float": "float32", "double": "float64", "bool": "bool"}


def describe_parquet(store: Store, train_path: str, val_path: str | None, feature_cols,
                     label_cols, sample_weight_col=None) -> dict:
    """Metadata in the format of ``_format`` for existing Parquet data (directories of
    Parquet files, as ``df.write.parquet`` writes them, or single files): files and rows from
    the footers, column dtypes and shapes from the schema and the first row. Writes nothing.

    ValueError, naming the path and column, when a path holds no Parquet files, a column is
    missing or has a type the loader cannot train on (strings, structs such as Spark ML
    vectors, nested lists, ...), or the files disagree on a column's type."""
    columns = list(dict.fromkeys(list(feature_cols or []) + list(label_cols or [])
                                 + ([sample_weight_col] if sample_weight_col else [])))
    splits = {"train": _describe_split(store, train_path, "training")}
    splits["val"] = (_describe_split(store, val_path, "validation")
                     if val_path is not None else None)
    specs = _parquet_columns(store, splits["train"], columns, train_path)
    if splits["val"] is not None:
        val_specs = _parquet_columns(store, splits["val"], columns, val_path)
        for name, spec in specs.items():
            if val_specs[name] != spec:
                raise ValueError(f"column {name!r} is {spec} in the training data "
                                 f"({train_path}) but {val_specs[name]} in the validation "
                                 f"data ({val_path})")
    if splits["train"]["total_rows"] == 0:
        raise ValueError(f"the training data at {train_path} has no rows")
    blob = json.dumps([train_path, val_path, splits], sort_keys=True).encode()
    return {
        "format_version": _format.FORMAT_VERSION,
        "data_key": "parquet-" + hashlib.sha256(blob).hexdigest()[:16],
        "feature_cols": list(feature_cols or []), "label_cols": list(label_cols or []),
        "sample_weight_col": sample_weight_col,
        "columns": specs,
        "splits": splits,
    }


def _describe_split(store, path, what):
    import pyarrow.parquet as pq
    if not store.exists(path):
        raise ValueError(f"the {what} data {path} does not exist (in {store!r})")
    if store.isdir(path):
        directory = path
        names = [n for n in store.listdir(path) if not n.startswith(("_", "."))]
        subdirs = [n for n in names if store.isdir(store.join(path, n))]
        if subdirs:
            raise ValueError(f"the {what} data {path} has subdirectories {subdirs[:3]}: "
                             "partitioned Parquet data sets are not supported; write it "
                             "without partitionBy, or use fit(df)")
    else:
        directory, name = posixpath.split(path.rstrip("/"))
        names = [name]
    if not names:
        raise ValueError(f"the {what} data {path} holds no Parquet files")
    rows = []
    for name in names:
        try:
            with store.open_input(store.join(directory, name)) as f:
                rows.append(pq.ParquetFile(f).metadata.num_rows)
        except Exception as e:  # noqa: BLE001 - say which file is not Parquet
            raise ValueError(f"{store.join(directory, name)} in the {what} data is not a "
                             f"readable Parquet file: {e}") from e
    return {"dir": store.fs_path(directory), "files": names, "rows": rows,
            "total_rows": int(sum(rows)), "_store_dir": directory}


def _parquet_columns(store, split, columns, path):
    """Column name -> {dtype, shape, kind} from the split's files (and the first row of list
    columns); checks every file has the same types."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    directory = split.pop("_store_dir")
    specs, first_type = {}, {}
    for name, n_rows in zip(split["files"], split["rows"]):
        with store.open_input(store.join(directory, name)) as f:
            pf = pq.ParquetFile(f)
            schema = pf.schema_arrow
            for col in columns:
                index = schema.get_field_index(col)
                if index < 0:
                    raise ValueError(f"column {col!r} is not in {path} (file {name} has "
                                     f"{schema.names})")
                t = schema.field(index).type
                if col in first_type:
                    if t != first_type[col]:
                        raise ValueError(f"column {col!r} is {first_type[col]} in one file of "
                                         f"{path} but {t} in {name}")
                    if specs[col]["shape"] == [-1] and n_rows:
                        specs[col]["shape"] = [_first_length(pf, col, name)]
                    continue
                first_type[col] = t
                leaf, kind = t, "scalar"
                if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or \
                        pa.types.is_large_list(t):
                    leaf, kind = t.value_type, "array"
                dtype = _ARROW_DTYPES.get(str(leaf))
                if dtype is None or pa.types.is_nested(leaf):
                    raise ValueError(
                        f"column {col!r} of {path} has type {t}: train on numeric or boolean "
                        "columns, or lists of them with one length in every row; Spark ML "
                        "vectors and other structs, strings and nested lists need fit(df) "
                        "or util.prepare_data, which convert them")
                if kind == "scalar":
                    shape = []
                elif pa.types.is_fixed_size_list(t):
                    shape = [t.list_size]
                else:   # the loader checks that every row has this length
                    shape = [_first_length(pf, col, name)] if n_rows else [-1]
                specs[col] = {"dtype": dtype, "shape": shape, "kind": kind}
    unknown = [c for c, spec in specs.items() if spec["shape"] == [-1]]
    if unknown:
        raise ValueError(f"column(s) {unknown} of {path}: every file is empty, so their "
                         "length is unknown")
    return specs


def _first_length(parquet_file, col, name):
    for group in range(parquet_file.metadata.num_row_groups):
        values = parquet_file.read_row_group(group, columns=[col]).column(0)
        if len(values):
            first = values[0]
            if not first.is_valid:
                raise ValueError(f"column {col!r} has a null list in {name}")
            return len(first)
    return -1


def dataset_properties(store: Store, data_key: str):
    """Horovod's ``get_dataset_properties``: ``(train_rows, val_rows, metadata,
    avg_row_size)`` of prepared data ``data_key`` (row size in bytes, as decoded)."""
    metadata = load_metadata(store, data_key)
    import numpy as np
    row_bytes = sum(np.dtype(c["dtype"]).itemsize * math.prod(c["shape"])
                    for c in metadata["columns"].values())
    val = metadata["splits"].get("val")
    return (metadata["splits"]["train"]["total_rows"], val["total_rows"] if val else 0,
            metadata, row_bytes)
