"""The on-Store format of prepared training data: the contract between data preparation
(``_prepare``, on the Spark side) and the shard loader (``loader``, on every rank).

Layout (Horovod's: ``Store.get_train_data_path(data_key)`` and ``get_val_data_path(data_key)``)::

    <train_path>.<data_key>/part-00000.parquet ... part-<N-1>.parquet   N = num_proc *
                                                                         partitions_per_process
    <train_path>.<data_key>/_metadata.json       written last; its presence = complete
    <val_path>.<data_key>/part-00000.parquet ... only with a validation split

Each directory is a plain Parquet data set (``_metadata.json`` starts with ``_``, which Parquet
readers skip). Rank ``r`` of ``size`` reads the files whose index ``i`` has ``i % size == r``.
``fit_on_parquet`` describes existing Parquet directories in the same format (no files written).

Column encoding in the Parquet files: a scalar column (numeric or boolean) is a primitive
column of its dtype; an array or Spark ML vector column is a ``fixed_size_list<dtype>`` of
``prod(shape)`` values, row-major, reshaped to ``shape`` by the loader (the loader also reads
plain ``list<dtype>`` columns whose rows all hold ``prod(shape)`` values).

``_metadata.json``::

    {"format_version": 2,
     "data_key": "...",
     "feature_cols": [...], "label_cols": [...], "sample_weight_col": null | "...",
     "columns": {"<name>": {"dtype": "float32", "shape": [784], "kind": "vector"}},
                  # kind: "scalar" (shape []), "array", "vector" (Spark ML, dense or sparse)
     "splits": {"train": {"dir": "<the split's directory, as the Store's filesystem names it>",
                          "files": ["part-00000.parquet", ...],   # relative to dir
                          "rows": [rows of each file, same order], "total_rows": n},
                "val": {...} | null}}
"""

FORMAT_VERSION = 2
METADATA_FILE = "_metadata.json"
SPLITS = ("train", "val")
KINDS = ("scalar", "array", "vector")
# NumPy dtype names the format allows (Spark types map onto these).
DTYPES = ("bool", "int8", "int16", "int32", "int64", "float32", "float64")


def part_file(index: int) -> str:
    """File name of shard ``index`` in its split's directory."""
    return f"part-{index:05d}.parquet"


def files_of_rank(files: list, rank: int, size: int) -> list:
    """The shard files rank ``rank`` of ``size`` reads."""
    return [f for i, f in enumerate(files) if i % size == rank]
