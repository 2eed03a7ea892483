"""Spark ML Estimators: fit a deep-learning model on a Spark DataFrame, get a Transformer back.

    from pyspark.ml import Pipeline
    from spark_hvd.estimators import Store, TorchEstimator

    store = Store.create("/tmp/spark_hvd_store")          # or hdfs://..., s3://... (fsspec)
    estimator = TorchEstimator(num_proc=2, store=store, model=net, optimizer=opt,
                               loss=torch.nn.functional.cross_entropy,
                               feature_cols=["features"], label_cols=["label"],
                               batch_size=64, epochs=5, validation=0.1)
    model = Pipeline(stages=[assembler, estimator]).fit(train_df)
    predictions = model.transform(test_df)                 # adds "label__output"

``fit`` writes the DataFrame as Parquet shards into the Store (reused when the same DataFrame
is fitted again), trains on Spark barrier tasks with ``spark_hvd.spark.run`` (one rank per
task, each reading its own shards), checkpoints every epoch under ``runs/<run_id>/`` and
returns a Model holding the trained weights and the per-epoch history.

``SparkBackend(num_proc, env, **spark.run arguments)`` runs the ranks; any object with
Horovod's backend interface (``num_processes()``, ``run(fn, args, kwargs, env)``) may stand in
for it as ``backend=``.

Horovod's module paths work too: ``spark_hvd.spark.torch``, ``spark_hvd.spark.keras``,
``spark_hvd.spark.common.store``, ``spark_hvd.spark.common.backend`` and
``spark_hvd.spark.common.util`` (``prepare_data``: prepare once, ``fit_on_parquet`` several
estimators).

Modules: ``store`` (Store, AbstractFilesystemStore, LocalStore, DBFSLocalStore, HDFSStore,
FilesystemStore),
``loader`` (the shard reader every rank trains from), ``torch`` (TorchEstimator, TorchModel),
``keras`` (KerasEstimator, KerasModel), ``lightning`` (LightningEstimator, LightningModel).

Inside, the files are in rooms by the side they run on: this level holds the public modules and
the driver's side of a fit (Params, the fit flow, persistence, tracking, progress, transform's
predictions); ``rank/`` what runs inside the training ranks; ``data/`` the shards (their format,
preparing them, reading them). ``rank/`` and ``data/`` never import this level's private modules
(tests/test_layering.py checks it).
"""

import importlib
import importlib.util

_EXPORTS = {
    "Store": "store", "LocalStore": "store", "HDFSStore": "store", "FilesystemStore": "store",
    "DBFSLocalStore": "store", "AbstractFilesystemStore": "store",
    "TorchEstimator": "torch", "TorchModel": "torch",
    "KerasEstimator": "keras", "KerasModel": "keras", "SparkBackend": "_base",
    "Backend": "_base",
}
# Helper modules that may not be there in every build: exported only when present.
if importlib.util.find_spec(f"{__name__}.lightning") is not None:
    _EXPORTS.update(LightningEstimator="lightning", LightningModel="lightning")

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    # Lazy: importing the Store must not import torch or TensorFlow.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'spark_hvd.estimators' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
