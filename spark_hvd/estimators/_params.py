"""Spark ML Params of the estimators and their models, declared once for Torch and Keras.

Each Param gets Spark-style accessors generated from its name: ``num_proc`` → ``getNumProc()``
and ``setNumProc(value)`` (which returns ``self``), as in Horovod's estimators. Constructors take
the same names as keywords.
"""

from __future__ import annotations

from pyspark.ml.param import Param, Params, TypeConverters

from ._fit_retry import RETRY_PARAMS


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _param(name, doc, converter=None):
    return Param(Params._dummy(), name, doc, typeConverter=converter)


def _to_list_of_strings(value):
    if isinstance(value, str):
        return [value]
    return TypeConverters.toListString(value)


def _to_optional_int(value):
    return None if value is None else TypeConverters.toInt(value)


# name: (doc, type converter or None for arbitrary Python objects, default)
COMMON_ESTIMATOR_PARAMS = {
    "num_proc": ("number of training processes (Spark tasks); default: the cluster's "
                 "default parallelism. Not together with backend.", _to_optional_int, None),
    "backend": ("a SparkBackend (or any object with run(fn, args, kwargs, env) and "
                "num_processes()) that runs the training ranks; default: SparkBackend(num_proc)",
                None, None),
    "store": ("the Store for prepared data, checkpoints and logs (Store.create(url))", None, None),
    "model": ("the model to train", None, None),
    "optimizer": ("the optimizer", None, None),
    "loss": ("loss function, or a list of them (one per label column)", None, None),
    "loss_weights": ("weights of the losses when there are several labels", None, None),
    "metrics": ("metrics reported every epoch, averaged over the ranks", None, []),
    "feature_cols": ("feature column names", _to_list_of_strings, None),
    "label_cols": ("label column names", _to_list_of_strings, None),
    "sample_weight_col": ("column of per-row loss weights", None, None),
    "validation": ("validation fraction (0 < f < 1) or the name of a boolean/0-1 column that "
                   "marks validation rows", None, None),
    "batch_size": ("rows per batch on each rank", TypeConverters.toInt, 32),
    "val_batch_size": ("rows per validation batch on each rank (default: batch_size)",
                       _to_optional_int, None),
    "epochs": ("number of epochs", TypeConverters.toInt, 1),
    "train_steps_per_epoch": ("steps per epoch on every rank (default: training rows // "
                              "(batch_size * num_proc))", _to_optional_int, None),
    "validation_steps_per_epoch": ("validation steps per epoch (default: validation rows // "
                                   "(val_batch_size * num_proc))", _to_optional_int, None),
    "shuffle": ("shuffle the training rows every epoch", TypeConverters.toBoolean, True),
    "shuffle_buffer_size": ("rows in the shuffle buffer (default: the loader's)",
                            _to_optional_int, None),
    "random_seed": ("seed of the model initialisation on the ranks, the shuffle and the "
                    "validation split; same seed and data give the same model", _to_optional_int,
                    None),
    "verbose": ("0 quiet, 1 one line per epoch, 2 a progress bar", TypeConverters.toInt, 1),
    "partitions_per_process": ("Parquet shards written per process", TypeConverters.toInt, 10),
    "run_id": ("the run's id: checkpoints and logs go to runs/<run_id>/ in the Store; fitting "
               "again with the same run_id resumes from its last checkpoint (default: a new id)",
               None, None),
    "transformation_fn": ("function applied on each rank to every training and validation "
                          "batch: spark_hvd's style takes and returns a dict of column name to "
                          "NumPy array; Horovod's takes and returns a pandas DataFrame (see "
                          "transformation_fn_input)", None, None),
    "transformation_fn_input": ("what transformation_fn takes: 'numpy' (a dict of arrays), "
                                "'pandas' (Horovod's: a DataFrame), 'rows' (Horovod's with "
                                "make_reader: one row dict), or None to detect it on the first "
                                "batch", None, None),
    "transformation_edit_fields": ("Horovod's: (name, numpy_dtype, shape, is_nullable) of each "
                                   "column transformation_fn adds or changes; the result is "
                                   "cast and reshaped to them", None, None),
    "transformation_removed_fields": ("Horovod's: names of columns transformation_fn removes "
                                      "(dropped from its result)", None, None),
    "input_shapes": ("shape of each feature column as the model takes it (-1 or None for the "
                     "batch dimension); default: the column's own shape", None, None),
    "label_shapes": ("shape of each label column as the loss takes it", None, None),
    "gradient_compression": ("gradient compression (Compression.fp16 or .none)", None, None),
    "backward_passes_per_step": ("backward passes (batches) accumulated locally per allreduce "
                                 "and optimizer step", TypeConverters.toInt, 1),
    "callbacks": ("training callbacks", None, []),
    "use_gpu": ("train on the GPU Spark gave each task, when there is one",
                TypeConverters.toBoolean, True),
    "inmemory_cache_all": ("keep every decoded batch of the rank in memory after the first "
                           "epoch", TypeConverters.toBoolean, False),
    "train_reader_num_workers": ("threads reading training shards on each rank",
                                 TypeConverters.toInt, 2),
    "val_reader_num_workers": ("threads reading validation shards on each rank",
                               TypeConverters.toInt, 2),
    "reader": ("'arrow' (spark_hvd's loader, the default) or 'petastorm' (make_batch_reader, "
               "when Petastorm can be imported)", TypeConverters.toString, "arrow"),
    "reader_pool_type": ("Horovod's reader pool: 'thread' (the default) and 'process' read "
                         "with train/val_reader_num_workers threads (the decode releases the "
                         "GIL, so processes would add only copies), 'dummy' reads in the "
                         "training thread itself", TypeConverters.toString, "thread"),
    "compress_sparse_cols": ("Horovod's: store SparseVector columns compressed; accepted, and "
                             "vectors are stored dense (what the model takes)",
                             TypeConverters.toBoolean, False),
    "continuous_cols": ("Horovod's: continuous feature columns of its NVTabular data module; "
                        "accepted and recorded, unused (features are feature_cols)",
                        _to_list_of_strings, None),
    "categorical_cols": ("Horovod's: categorical feature columns of its NVTabular data module; "
                         "accepted and recorded, unused (features are feature_cols)",
                         _to_list_of_strings, None),
    "mp_start_method": ("multiprocessing start method ('fork', 'spawn', 'forkserver') set on "
                        "every rank before training, as Horovod does; None leaves Python's",
                        None, None),
    "tensorflow_dataset_prefetch_buffer_size": ("batches the Keras tf.data input prefetches: "
                                                "None 2, 0 none (Horovod's default 0); no "
                                                "effect on Torch", _to_optional_int, None),
    "scale_learning_rate": ("multiply the optimizer's learning rate by the number of processes "
                            "(Horovod's recipe; off unless asked)", TypeConverters.toBoolean,
                            False),
    "env": ("extra environment variables for the training ranks", None, None),
    "mlflow_tracking": ("log Params, per-epoch metrics and the trained model to MLflow: None "
                        "(default) when MLflow is installed and a run is active or a tracking "
                        "URI is set, True always (MLflow must be installed), False never",
                        None, None),
    "mlflow_tracking_uri": ("MLflow tracking URI to log to (default: MLflow's own, from "
                            "MLFLOW_TRACKING_URI); setting it turns tracking on", None, None),
}

# A fit that survives lost ranks: max_failures, min_num_proc (see _fit_retry).
COMMON_ESTIMATOR_PARAMS.update(RETRY_PARAMS)

COMMON_MODEL_PARAMS = {
    "model": ("the trained model", None, None),
    "feature_cols": ("feature column names", _to_list_of_strings, None),
    "label_cols": ("label column names (used to name the output columns)",
                   _to_list_of_strings, None),
    "output_cols": ("prediction column names, one per model output (default: "
                    "<label>__output)", _to_list_of_strings, None),
    "input_shapes": ("shape of each feature column as the model takes it", None, None),
    "batch_size": ("rows per prediction batch in transform", TypeConverters.toInt, 1024),
    "run_id": ("the id of the run that trained the model", None, None),
    "history": ("per-epoch metrics of the training run", None, None),
    "mlflow_run_id": ("the MLflow run the fit logged its Params, metrics and this model to "
                      "(None when the fit was not tracked)", None, None),
    "training_metadata": ("column types and shapes of the training data (the prepared "
                          "data's metadata)", None, None),
}

# Horovod's model constructor keywords -> our Param names.
MODEL_KEYWORD_ALIASES = {"feature_columns": "feature_cols", "label_columns": "label_cols",
                         "_metadata": "training_metadata"}


# Horovod's spellings of some accessors (``setShufflingBufferSize``, ...) -> our Param names.
HOROVOD_ACCESSORS = {
    "ShufflingBufferSize": "shuffle_buffer_size",
    "TrainReaderNumWorker": "train_reader_num_workers",
    "ValReaderNumWorker": "val_reader_num_workers",
    "InMemoryCacheAll": "inmemory_cache_all",
    "FeatureColumns": "feature_cols",
    "LabelColumns": "label_cols",
    "LabelColoumns": "label_cols",  # sic: Horovod's model setter is setLabelColoumns
}


def declare(cls, params: dict):
    """Adds ``params`` to the Params class ``cls`` with ``getX``/``setX`` accessors (and
    Horovod's spelling where it differs), and records their defaults in
    ``cls._param_defaults``."""
    defaults = dict(getattr(cls, "_param_defaults", {}))
    for name, (doc, converter, default) in params.items():
        setattr(cls, name, _param(name, doc, converter))
        defaults[name] = default
        camel = _camel(name.lstrip("_"))
        if not hasattr(cls, "get" + camel):
            setattr(cls, "get" + camel, _getter(name))
        if not hasattr(cls, "set" + camel):
            setattr(cls, "set" + camel, _setter(name))
    for alias, name in HOROVOD_ACCESSORS.items():
        if name in params:
            for prefix, make in (("get", _getter), ("set", _setter)):
                if not hasattr(cls, prefix + alias):
                    setattr(cls, prefix + alias, make(name))
    cls._param_defaults = defaults
    return cls


def _getter(name):
    def get(self):
        return self.getOrDefault(getattr(self, name))
    get.__name__ = "get" + _camel(name.lstrip("_"))
    get.__doc__ = f"Returns the value of ``{name}``."
    return get


def _setter(name):
    def set_(self, value):
        self._set(**{name: value})
        return self
    set_.__name__ = "set" + _camel(name.lstrip("_"))
    set_.__doc__ = f"Sets ``{name}``; returns self."
    return set_


def init_params(instance, kwargs: dict):
    """Sets the defaults of ``instance`` and then ``kwargs``, naming any unknown keyword."""
    instance._setDefault(**instance._param_defaults)
    kwargs = dict(kwargs)
    for alias, name in getattr(instance, "_keyword_aliases", {}).items():
        if alias in kwargs:
            if name in kwargs:
                raise TypeError(f"{type(instance).__name__}: give {name} or {alias} (Horovod's "
                                "name), not both")
            kwargs[name] = kwargs.pop(alias)
    unknown = sorted(set(kwargs) - set(instance._param_defaults))
    if unknown:
        raise TypeError(f"{type(instance).__name__} got unknown parameter(s) {unknown}; "
                        f"known: {sorted(n for n in instance._param_defaults if n[0] != '_')}")
    instance._set(**kwargs)


def param_values(instance) -> dict:
    """Every Param of ``instance`` that is set or has a default, by name."""
    return {p.name: instance.getOrDefault(p) for p in instance.params
            if instance.isSet(p) or instance.hasDefault(p)}
