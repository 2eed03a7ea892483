"""What TorchEstimator and KerasEstimator share: the fit flow on the driver (check Params,
prepare the data, pick the run, run the ranks, build the Model) and the Model's batched,
Arrow-based ``transform``. The framework modules supply only the rank's training function and
the model (de)serialisation."""

from __future__ import annotations

import datetime
import os
import secrets

from pyspark.ml import Estimator, Model

from . import _params, _tracking
from ._fit_retry import FitRetry
from ._persistence import Persistable
from ._progress import ProgressSink
from .rank._training import RankEntry


class Backend:
    """Horovod's interface for what runs an estimator's training function (``backend=``): a
    custom backend derives from it when training runs somewhere other than the Spark
    application that fits the estimator."""

    def run(self, fn, args=(), kwargs=None, env=None):
        """Runs ``fn(*args, **kwargs)`` on every rank with ``env`` added to the environment;
        returns the results ordered by rank."""
        raise NotImplementedError()

    def num_processes(self):
        """The number of ranks ``run`` starts."""
        raise NotImplementedError()


class SparkBackend(Backend):
    """Runs an estimator's training ranks on Spark barrier tasks (``spark_hvd.spark.run``).

    Args:
        num_proc: number of ranks; default: the session's default parallelism.
        env: extra environment variables for the ranks.
        stdout, stderr: where the ranks' output goes (default the driver's).
        verbose: ``spark.run``'s verbosity.
        start_timeout: seconds to wait for the tasks and the ranks to start.
        nics: network interfaces for the ranks' connections.
        spark: the SparkSession (default: the DataFrame's).
        **kwargs: any other argument of ``spark_hvd.spark.run`` (as Horovod's SparkBackend
            passes them on), e.g. ``prefix_output_with_timestamp``.
    """

    def __init__(self, num_proc=None, env=None, stdout=None, stderr=None, verbose=1,
                 start_timeout=None, nics=None, spark=None, **kwargs):
        import inspect
        import spark_hvd.spark
        known = set(inspect.signature(spark_hvd.spark.run).parameters) - {"fn", "args", "kwargs"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"SparkBackend got unknown argument(s) {unknown}; it passes "
                            f"spark_hvd.spark.run's on: {sorted(known)}")
        self.num_proc, self.env, self.stdout, self.stderr = num_proc, env, stdout, stderr
        self.verbose, self.start_timeout, self.nics, self.spark = (verbose, start_timeout, nics,
                                                                   spark)
        self.run_kwargs = kwargs

    def num_processes(self, spark=None) -> int:
        """The number of ranks ``run`` starts."""
        if self.num_proc is not None:
            return int(self.num_proc)
        from spark_hvd.spark import _session
        return _session.default_num_proc(_session.active_session(self.spark or spark))

    def run(self, fn, args=(), kwargs=None, env=None, stdout=None, spark=None):
        """Runs ``fn`` on every rank; returns its results by rank."""
        import spark_hvd.spark
        merged = dict(self.env or {})
        merged.update(env or {})
        return spark_hvd.spark.run(
            fn, args=args, kwargs=kwargs, num_proc=self.num_processes(spark), env=merged,
            stdout=stdout if stdout is not None else self.stdout, stderr=self.stderr,
            verbose=self.verbose, start_timeout=self.start_timeout, nics=self.nics,
            spark=self.spark or spark, **self.run_kwargs)

    def __getstate__(self):  # the session and streams stay on the driver
        state = dict(self.__dict__)
        state.update(spark=None, stdout=None, stderr=None)
        return state


def run_on(backend, fn, args, env, spark, stdout):
    """Runs ``fn`` through ``backend``: a SparkBackend (the session and the progress sink go
    along), or any object with Horovod's backend interface, ``num_processes()`` and
    ``run(fn, args=(), kwargs=None, env=None)``."""
    if isinstance(backend, SparkBackend):
        return backend.run(fn, args=args, env=env, stdout=stdout, spark=spark)
    return backend.run(fn, args=args, kwargs={}, env=env)


def num_processes_of(backend, spark) -> int:
    if isinstance(backend, SparkBackend):
        return backend.num_processes(spark)
    return int(backend.num_processes())


def new_run_id(prefix: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    return f"{prefix}_{stamp}_{secrets.token_hex(3)}"


class DistributedEstimator(Estimator, Persistable):
    """Base of TorchEstimator and KerasEstimator (framework hooks at the bottom)."""

    _run_prefix = "run"
    # Whether a lost rank is survived in memory (hvd.elastic.run on run_elastic; the rank's
    # training function supports config["elastic"]) rather than from the last checkpoint.
    _fit_in_memory = False

    def __init__(self, **kwargs):
        super().__init__()
        _params.init_params(self, kwargs)

    # -- the fit flow --------------------------------------------------------------------------

    def _fit(self, df):
        from .data._prepare import prepare_data
        self._check_params(df)
        spark = df.sparkSession
        backend, num_proc = self._backend_and_size(spark)
        metadata = prepare_data(
            df, self.getStore(), num_proc=num_proc,
            partitions_per_process=self.getPartitionsPerProcess(),
            feature_cols=self.getFeatureCols(), label_cols=self.getLabelCols(),
            sample_weight_col=self.getSampleWeightCol(), validation=self.getValidation(),
            random_seed=self.getRandomSeed(), verbose=self.getVerbose())
        return self._fit_prepared(metadata, backend, num_proc, spark)

    def fit_on_parquet(self, params=None, dataset_idx=None, train_data=None, val_data=None):
        """Trains on Parquet data already in the Store, without a DataFrame (Horovod's method).

        Reads, in this order of preference:

        * ``train_data`` (and ``val_data``): paths of Parquet data sets (a directory of files,
          as ``df.write.parquet`` writes, or one file) that the Store's filesystem reads;
          ``fit_on_parquet("/data/train", "/data/val")`` is the same;
        * ``dataset_idx``: the data set ``spark_hvd.spark.common.util.prepare_data`` prepared
          (the key its ``with`` block yields);
        * inside a ``util.prepare_data(...)`` block on the same Store: that block's data;
        * else the Store's ``train_path`` and, if it exists, ``val_path`` (Horovod's
          ``Store.create(..., train_path=..., val_path=...)`` then ``fit_on_parquet()``).

        Columns must be numeric or boolean scalars, or lists of them with one length in every
        row (not Spark ML vectors: ``fit(df)`` or ``prepare_data`` converts those); every rank
        needs at least one file with rows (rank ``r`` reads the files ``i % num_proc == r``).
        ``validation`` does not apply: validation rows come from ``val_data``. ``params``
        overrides Params for this call, as in ``fit``. Returns the trained Model.
        """
        if isinstance(params, (str, os.PathLike)):   # fit_on_parquet(train_data, val_data)
            params, train_data, val_data, dataset_idx = None, params, dataset_idx, None
        estimator = self.copy(params) if params else self
        return estimator._fit_on_parquet(dataset_idx, train_data, val_data)

    def _fit_on_parquet(self, dataset_idx, train_data, val_data):
        from .data import _prepare
        self._check_params(None)
        store = self.getStore()
        spark = None   # no DataFrame: a SparkBackend uses the active session
        backend, num_proc = self._backend_and_size(spark)
        if train_data is None and dataset_idx is None:
            dataset_idx = _prepare.active_dataset(store)
        if train_data is None and dataset_idx is not None:
            metadata = _prepare.load_metadata(store, str(dataset_idx))
            _prepare.check_columns(metadata, self.getFeatureCols(), self.getLabelCols(),
                                   self.getSampleWeightCol())
        else:
            if train_data is None:
                train_data = store.get_train_data_path()
                default_val = store.get_val_data_path()
                val_data = default_val if store.exists(default_val) else None
            metadata = _prepare.describe_parquet(
                store, str(train_data), None if val_data is None else str(val_data),
                self.getFeatureCols(), self.getLabelCols(), self.getSampleWeightCol())
        _prepare.check_rank_rows(metadata, num_proc)
        return self._fit_prepared(metadata, backend, num_proc, spark)

    def _backend_and_size(self, spark):
        backend = self.getBackend() or SparkBackend(num_proc=self.getNumProc())
        return backend, num_processes_of(backend, spark)

    def _fit_prepared(self, metadata, backend, num_proc, spark):
        """Trains on prepared data (every fit path ends here): picks the run, runs the ranks
        inside the fit's tracking, builds the Model."""
        store = self.getStore()
        verbose = self.getVerbose()
        run_id = self.getRunId() or new_run_id(self._run_prefix)
        checkpoints = store.list_checkpoints(run_id)
        config = self._training_config(metadata, run_id, num_proc, self.getRandomSeed())
        resume = checkpoints[-1][1] if checkpoints else None
        if resume is not None and verbose:
            print(f"spark_hvd: resuming run {run_id} from {resume}", flush=True)
        sink = ProgressSink(getattr(backend, "stdout", None), verbose)
        trainer = RankEntry(self._remote_trainer(), self.getMpStartMethod())
        with _tracking.track_fit(self, run_id, sink) as tracking:
            try:   # ranks lost during training: goes on (in memory, or from a checkpoint)
                results = FitRetry(self, backend, spark, sink, run_id, config).run(
                    trainer, resume, self._run_env())
            finally:
                sink.close()
            model = self._create_model(results[0], metadata, run_id)
            tracking.log_model(model)
        return model

    def _run_env(self) -> dict:
        """Environment variables the ranks get (``env``; Keras adds ``backend_env``)."""
        return dict(self.getEnv() or {})

    def _check_params(self, df) -> None:
        name = type(self).__name__
        if self.getStore() is None:
            raise ValueError(f"{name}: store is not set; pass store=Store.create('<dir or url>')")
        if self.getModel() is None:
            raise ValueError(f"{name}: model is not set")
        if not self.getFeatureCols():
            raise ValueError(f"{name}: feature_cols is not set")
        if not self.getLabelCols():
            raise ValueError(f"{name}: label_cols is not set")
        if self.getNumProc() is not None and self.getBackend() is not None:
            raise ValueError(f"{name}: set num_proc or backend, not both (give the backend "
                             f"its num_proc)")
        for param in ("batch_size", "epochs", "backward_passes_per_step",
                      "partitions_per_process"):
            value = self.getOrDefault(param)
            if value is None or value < 1:
                raise ValueError(f"{name}: {param} must be a positive integer, got {value!r}")
        if self.getReaderPoolType() not in ("thread", "process", "dummy"):
            raise ValueError(f"{name}: reader_pool_type must be 'thread', 'process' or "
                             f"'dummy', got {self.getReaderPoolType()!r}")
        method = self.getMpStartMethod()
        if method is not None:
            import multiprocessing
            if method not in multiprocessing.get_all_start_methods():
                raise ValueError(f"{name}: mp_start_method {method!r} is not supported here; "
                                 f"use one of {multiprocessing.get_all_start_methods()}")
        if self.getReader() not in ("arrow", "petastorm"):
            raise ValueError(f"{name}: reader must be 'arrow' or 'petastorm', "
                             f"got {self.getReader()!r}")
        shapes = self.getInputShapes()
        if shapes is not None and len(shapes) != len(self.getFeatureCols()):
            raise ValueError(f"{name}: input_shapes has {len(shapes)} shapes for "
                             f"{len(self.getFeatureCols())} feature columns")
        shapes = self.getLabelShapes()
        if shapes is not None and len(shapes) != len(self.getLabelCols()):
            raise ValueError(f"{name}: label_shapes has {len(shapes)} shapes for "
                             f"{len(self.getLabelCols())} label columns")

    def _training_config(self, metadata, run_id, num_proc, seed) -> dict:
        """Everything a rank needs, picklable; framework-specific parts are added by
        ``_framework_config``."""
        from .data._transformation_fn import make_batch_transform
        batch_size = self.getBatchSize()
        # Horovod's 'dummy' pool reads in the consumer's thread: our loader with no workers.
        in_thread = self.getReaderPoolType() == "dummy"
        transformation = make_batch_transform(
            self.getTransformationFn(), self.getTransformationEditFields(),
            self.getTransformationRemovedFields(), self.getTransformationFnInput())
        config = {
            "store": self.getStore(), "metadata": metadata, "run_id": run_id,
            "num_proc": num_proc, "epochs": self.getEpochs(), "batch_size": batch_size,
            "val_batch_size": self.getValBatchSize() or batch_size,
            "train_steps_per_epoch": self.getTrainStepsPerEpoch(),
            "validation_steps_per_epoch": self.getValidationStepsPerEpoch(),
            "shuffle": self.getShuffle(), "shuffle_buffer_size": self.getShuffleBufferSize(),
            "random_seed": seed if seed is not None else secrets.randbelow(2**31),
            "verbose": self.getVerbose(), "transformation_fn": transformation,
            "input_shapes": self.getInputShapes(), "label_shapes": self.getLabelShapes(),
            "feature_cols": self.getFeatureCols(), "label_cols": self.getLabelCols(),
            "sample_weight_col": self.getSampleWeightCol(),
            "backward_passes_per_step": self.getBackwardPassesPerStep(),
            "gradient_compression": self.getGradientCompression(),
            "use_gpu": self.getUseGpu(), "inmemory_cache_all": self.getInmemoryCacheAll(),
            "train_reader_num_workers": 0 if in_thread else self.getTrainReaderNumWorkers(),
            "val_reader_num_workers": 0 if in_thread else self.getValReaderNumWorkers(),
            "tensorflow_dataset_prefetch_buffer_size":
                self.getTensorflowDatasetPrefetchBufferSize(),
            "reader": self.getReader(), "scale_learning_rate": self.getScaleLearningRate(),
            "metrics": self.getMetrics() or [], "loss_weights": self.getLossWeights(),
            "callbacks": self.getCallbacks() or [],
        }
        config.update(self._framework_config())
        return config

    # -- framework hooks -----------------------------------------------------------------------

    def _framework_config(self) -> dict:
        raise NotImplementedError

    def _remote_trainer(self):
        """The function each rank runs: ``fn(config, resume_checkpoint_path) -> result``."""
        raise NotImplementedError

    def _create_model(self, result, metadata, run_id):
        raise NotImplementedError


class DistributedModel(Model, Persistable):
    """Base of TorchModel and KerasModel: ``transform`` through an Arrow UDF in batches."""

    _keyword_aliases = _params.MODEL_KEYWORD_ALIASES

    def __init__(self, **kwargs):
        super().__init__()
        _params.init_params(self, kwargs)

    def _get_metadata(self):
        """The training data's metadata (Horovod's internal accessor, for its ``_metadata``)."""
        return self.getTrainingMetadata()

    def getOutputCols(self):
        """The prediction columns: ``output_cols`` if set, else ``<label>__output``."""
        cols = self.getOrDefault(self.output_cols)
        return list(cols) if cols else [f"{c}__output" for c in self.getLabelCols()]

    def _transform(self, df):
        from ._predictions import add_predictions
        return add_predictions(df, self)

    def plot_history(self, path, metrics=None, title=None):
        """Draws ``getHistory()`` (loss and metrics per epoch, train and validation) into the
        image file ``path`` (.png, .svg, .pdf, ...); returns ``path``. Needs matplotlib."""
        from ._history import plot_history
        return plot_history(self.getHistory() or {}, path, metrics=metrics,
                            title=title or self.getRunId())

    # -- framework hooks -----------------------------------------------------------------------

    def _predictor_factory(self):
        """A picklable ``factory() -> predict(list of input arrays) -> list of output arrays``;
        the factory runs once per Spark task (loads the model there)."""
        raise NotImplementedError

