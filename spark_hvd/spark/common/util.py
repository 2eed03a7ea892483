"""Horovod's ``horovod.spark.common.util`` data preparation: prepare a DataFrame once, then fit
several estimators on it.

    from spark_hvd.spark.common import util

    with util.prepare_data(num_processes=2, store=store, df=df, feature_columns=["features"],
                           label_columns=["y"], validation=0.1) as dataset_idx:
        torch_model = torch_estimator.fit_on_parquet()        # this block's data
        keras_model = keras_estimator.fit_on_parquet(dataset_idx=dataset_idx)

The data is written once as Parquet shards under ``store.get_train_data_path(dataset_idx)``
and ``get_val_data_path(dataset_idx)`` (``dataset_idx`` is the data's key, a string), and stays
there after the block, so later Spark applications can train on it with
``fit_on_parquet(dataset_idx=...)``. ``estimator.fit(df)`` on the same DataFrame, columns,
validation and number of processes reuses it too.
"""

from __future__ import annotations

import contextlib
import threading

from spark_hvd.estimators.data import _prepare

__all__ = ["prepare_data", "get_dataset_properties", "clear_training_cache"]

_stores_lock = threading.Lock()
_stores: dict = {}    # dataset_idx -> the Store it was prepared in (for get_dataset_properties)


@contextlib.contextmanager
def prepare_data(num_processes, store, df, label_columns, feature_columns=None, validation=None,
                 sample_weight_col=None, compress_sparse=False, partitions_per_process=10,
                 verbose=0):
    """Writes ``df``'s training columns into ``store`` once (or finds them written) and yields
    the data's key, ``dataset_idx``; inside the block ``estimator.fit_on_parquet()`` trains on
    that data.

    Args (Horovod's):
        num_processes: the number of ranks that will train on it.
        store: a Store.
        df: the DataFrame.
        label_columns: label column names.
        feature_columns: feature column names (default: every column that is not a label, the
            sample weight or the validation column).
        validation: a fraction in (0, 1) of rows for validation, or the name of a boolean/0-1
            column marking them.
        sample_weight_col: a column of per-row loss weights.
        compress_sparse: accepted; Spark ML vectors are written dense (what models take).
        partitions_per_process: Parquet files per process and split.
        verbose: print what is written (1) or nothing (0).
    """
    del compress_sparse   # sparse compression is a Petastorm codec feature: vectors go dense
    if not label_columns:
        raise ValueError("prepare_data: label_columns cannot be None or empty")
    label_columns = [label_columns] if isinstance(label_columns, str) else list(label_columns)
    if feature_columns is None:
        others = set(label_columns) | {sample_weight_col}
        if isinstance(validation, str):
            others.add(validation)
        feature_columns = [c for c in df.columns if c not in others]
    metadata = _prepare.prepare_data(
        df, store, num_proc=int(num_processes), partitions_per_process=int(partitions_per_process),
        feature_cols=feature_columns, label_cols=label_columns,
        sample_weight_col=sample_weight_col, validation=validation, verbose=verbose)
    key = metadata["data_key"]
    with _stores_lock:
        _stores[key] = store
    with _prepare.dataset_in_use(store, key):
        yield key


def get_dataset_properties(dataset_idx):
    """``(train_rows, val_rows, metadata, avg_row_size)`` of the data set ``prepare_data``
    yielded as ``dataset_idx`` in this process (metadata is spark_hvd's ``_metadata.json``;
    the row size is in bytes as the ranks decode it)."""
    with _stores_lock:
        store = _stores.get(dataset_idx)
    if store is None:
        raise KeyError(f"no data set {dataset_idx!r} was prepared by util.prepare_data in this "
                       "process")
    return _prepare.dataset_properties(store, dataset_idx)


def clear_training_cache():
    """Forgets which data sets ``prepare_data`` prepared in this process (their files stay in
    the Store; delete them with ``store.delete(store.get_train_data_path(idx))``)."""
    with _stores_lock:
        _stores.clear()
