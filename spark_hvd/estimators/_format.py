"""The on-Store format of prepared training data: the contract between data preparation
(``_prepare``, on the Spark side) and the shard loader (``loader``, on every rank).

Layout under ``Store.get_data_path(data_key)``::

    train/part-00000.parquet ... part-<N-1>.parquet     N = num_proc * partitions_per_process
    val/part-00000.parquet ...                           only with a validation split
    _metadata.json                                       written last; its presence = complete

Rank ``r`` of ``size`` reads the files whose index ``i`` has ``i % size == r``.

Column encoding in the Parquet files: a scalar column (numeric or boolean) is a primitive
column of its dtype; an array or Spark ML vector column is a ``fixed_size_list<dtype>`` of
``prod(shape)`` values, row-major, reshaped to ``shape`` by the loader.

``_metadata.json``::

    {"format_version": 1,
     "data_key": "...",
     "feature_cols": [...], "label_cols": [...], "sample_weight_col": null | "...",
     "columns": {"<name>": {"dtype": "float32", "shape": [784], "kind": "vector"}},
                  # kind: "scalar" (shape []), "array", "vector" (Spark ML, dense or sparse)
     "splits": {"train": {"files": ["train/part-00000.parquet", ...],
                          "rows": [rows of each file, same order], "total_rows": n},
                "val": {...} | null}}
"""

FORMAT_VERSION = 1
METADATA_FILE = "_metadata.json"
SPLITS = ("train", "val")
KINDS = ("scalar", "array", "vector")
# NumPy dtype names the format allows (Spark types map onto these).
DTYPES = ("bool", "int8", "int16", "int32", "int64", "float32", "float64")


def part_file(split: str, index: int) -> str:
    """Path of shard ``index`` of ``split``, relative to the data path."""
    return f"{split}/part-{index:05d}.parquet"


def files_of_rank(files: list, rank: int, size: int) -> list:
    """The shard files rank ``rank`` of ``size`` reads."""
    return [f for i, f in enumerate(files) if i % size == rank]
