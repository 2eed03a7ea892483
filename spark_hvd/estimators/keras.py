"""KerasEstimator → KerasModel: train a Keras 3 model on a Spark DataFrame.

    import keras
    from spark_hvd.estimators import KerasEstimator, Store

    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    estimator = KerasEstimator(
        num_proc=2, store=Store.create("/tmp/store"), model=model,
        optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
        metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
        batch_size=64, epochs=5, validation=0.1, random_seed=1)
    keras_model = estimator.fit(train_df)              # a Spark ML Model (Transformer)
    keras_model.transform(test_df)                     # adds "label__output"
    keras_model.getHistory()["val_accuracy"]           # one value per epoch

Every rank loads the model from its ``.keras`` bytes and compiles it with the optimizer wrapped
in ``spark_hvd.keras.DistributedOptimizer``; ``model.fit`` runs on batches of the rank's
shards, rank 0's variables are broadcast when training begins, epoch metrics are averaged over
the ranks, and rank 0 checkpoints every epoch to ``runs/<run_id>/checkpoints/`` in the Store
(a ``.keras`` file: model, optimizer state, epoch and history), from which a fit with the same
``run_id`` resumes.
"""

from __future__ import annotations

from . import _params
from ._base import DistributedEstimator, DistributedModel
from .rank._keras import SavedModel, compile_args, model_to_bytes, pack, train_on_rank, unpack
from ._predictions import KerasPredictor

__all__ = ["KerasEstimator", "KerasModel"]

_CUSTOM_OBJECTS = ("custom objects (classes and functions by name) that loading the model "
                   "needs, as for keras.models.load_model", None, None)

_KERAS_ESTIMATOR_PARAMS = dict(_params.COMMON_ESTIMATOR_PARAMS)
_KERAS_ESTIMATOR_PARAMS.update({
    "optimizer": ("a Keras optimizer (or its name); default: the one the model is compiled "
                  "with", None, None),
    "loss": ("a Keras loss (name, function or Loss), or a list/dict of them, one per output; "
             "default: the model's compiled loss", None, None),
    "custom_objects": _CUSTOM_OBJECTS,
    "checkpoint_callback": ("a ModelCheckpoint-like callback run on rank 0 (e.g. "
                            "spark_hvd.keras.callbacks.BestModelCheckpoint); its filepath is "
                            "set by the estimator, and the model it saved last is the model "
                            "fit returns", None, None),
    "backend_env": ("Horovod's: environment variables for the training ranks (env, when set, "
                    "wins); default Horovod's {'LIBHDFS_OPTS': '-Xms2048m -Xmx2048m'}, the "
                    "JVM heap of libhdfs for an HDFSStore", None,
                    {"LIBHDFS_OPTS": "-Xms2048m -Xmx2048m"}),
})

_KERAS_MODEL_PARAMS = dict(_params.COMMON_MODEL_PARAMS)
# spark_hvd.keras._backend.SUPPORTED, named here so that the driver does not load the core.
_SUPPORTED_BACKENDS = ("tensorflow", "torch", "jax")
_KERAS_MODEL_PARAMS["custom_objects"] = _CUSTOM_OBJECTS


def _check_backend() -> None:
    """The driver's Keras backend is one the ranks can train on (they use the same)."""
    import keras
    backend = keras.backend.backend()
    if backend not in _SUPPORTED_BACKENDS:
        raise ValueError(
            f"KerasEstimator trains on the Keras backends {', '.join(_SUPPORTED_BACKENDS)}; "
            f"this driver runs Keras on {backend!r}. Set KERAS_BACKEND to one of them before "
            f"keras is imported (the ranks train on the driver's backend).")


def _is_keras_model(model) -> bool:
    import keras
    return isinstance(model, keras.Model)


def _pack_model_params(params: dict) -> dict:
    """Keras objects among a stage's pickled Params in picklable form: the model as .keras
    bytes, optimizers, losses and metrics as (class, config)."""
    packed = {}
    for name, value in params.items():
        if _is_keras_model(value):
            packed[name] = SavedModel.of(value)
        elif name in ("optimizer", "loss", "metrics"):
            packed[name] = pack(value)
        else:
            packed[name] = value
    return packed


def _unpack_model_params(params: dict, custom_objects) -> dict:
    import keras
    with keras.saving.custom_object_scope(custom_objects or {}):
        return {name: value.load(custom_objects) if isinstance(value, SavedModel)
                else unpack(value) for name, value in params.items()}


class KerasEstimator(DistributedEstimator):
    """Spark ML Estimator that trains a Keras 3 model on spark_hvd ranks, on the driver's Keras
    backend (TensorFlow, torch or JAX: the ranks get its ``KERAS_BACKEND``).

    Params (each also has ``getX``/``setX``, e.g. ``setEpochs(5)``): see
    ``spark_hvd.estimators._params.COMMON_ESTIMATOR_PARAMS`` for the shared ones; Keras adds
    ``custom_objects``, ``checkpoint_callback`` and ``backend_env``. ``model`` is a
    ``keras.Model`` (compiled or not) taking one input per feature column (reshaped by
    ``input_shapes``) and giving one output per label column; ``optimizer`` a Keras optimizer (default: the model's compiled
    one); ``loss`` a Keras loss or one per output (default: the compiled one), combined with
    ``loss_weights``; ``metrics`` Keras metrics (names, functions or Metric objects);
    ``callbacks`` Keras callbacks run on every rank. Nothing is scaled unless asked
    (``scale_learning_rate``). ``fit`` returns a :class:`KerasModel`.
    """

    _run_prefix = "keras"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    # Checked before the data is prepared, so a mistake costs no Spark job.
    def _check_params(self, df) -> None:
        super()._check_params(df)
        _check_backend()
        model = self.getModel()
        if not _is_keras_model(model):
            raise ValueError(f"KerasEstimator: model must be a keras.Model, got "
                             f"{type(model).__name__}")
        self._compile_args()

    def _compile_args(self) -> dict:
        """optimizer, loss, loss_weights and metrics: the Params, or else the model's own
        compile arguments."""
        import keras
        compiled = compile_args(self.getModel()) or {}
        args = {
            "optimizer": self.getOptimizer() or compiled.get("optimizer"),
            "loss": self.getLoss() or compiled.get("loss"),
            "loss_weights": self.getLossWeights() or compiled.get("loss_weights"),
            "metrics": self.getMetrics() or compiled.get("metrics"),
            "weighted_metrics": compiled.get("weighted_metrics"),
        }
        if isinstance(args["optimizer"], str):
            args["optimizer"] = keras.optimizers.get(args["optimizer"])
        if args["optimizer"] is None:
            raise ValueError("KerasEstimator: optimizer is not set and the model is not "
                             "compiled with one (e.g. optimizer=keras.optimizers.Adam(1e-3))")
        if not isinstance(args["optimizer"], keras.optimizers.Optimizer):
            raise ValueError(f"KerasEstimator: optimizer must be a keras.optimizers.Optimizer, "
                             f"got {type(args['optimizer']).__name__}")
        if args["loss"] is None:
            raise ValueError("KerasEstimator: loss is not set and the model is not compiled "
                             "with one (e.g. loss='mse')")
        return {k: v for k, v in args.items() if v is not None}

    def _framework_config(self) -> dict:
        import cloudpickle
        spec = {"model": model_to_bytes(self.getModel()),
                "compile": pack(self._compile_args()),
                "custom_objects": self.getCustomObjects(),
                "callbacks": list(self.getCallbacks() or []),
                "checkpoint_callback": self.getCheckpointCallback()}
        # Keras objects go to the ranks packed and pickled once, and are only unpickled after
        # the rank has set up TensorFlow; the shared keys would carry them unpacked.
        return {"keras": cloudpickle.dumps(spec), "metrics": None, "callbacks": None}

    def _remote_trainer(self):
        return train_on_rank

    def _run_env(self) -> dict:
        import keras
        # The ranks train on the Keras backend the driver's model was built with (env, when
        # it names another, wins).
        env = {"KERAS_BACKEND": keras.backend.backend()}
        env.update(self.getBackendEnv() or {})
        env.update(super()._run_env())
        return env

    def _create_model(self, result, metadata, run_id):
        custom_objects = self.getCustomObjects()
        saved = SavedModel(result["model"], pack(self._compile_args()))
        model = saved.load(custom_objects, optimizer_state=True)
        return KerasModel(model=model, feature_cols=self.getFeatureCols(),
                          label_cols=self.getLabelCols(), input_shapes=self.getInputShapes(),
                          custom_objects=custom_objects, run_id=run_id,
                          history=result["history"], training_metadata=metadata)

    def _pack_params(self, params: dict) -> dict:
        return _pack_model_params(params)

    def _unpack_params(self, params: dict) -> dict:
        return _unpack_model_params(params, params.get("custom_objects",
                                                       self.getCustomObjects()))


class KerasModel(DistributedModel):
    """The Transformer a KerasEstimator returns. ``transform(df)`` adds one prediction column
    per model output (``<label>__output``, or ``setOutputCols``); ``getModel()`` is the trained
    ``keras.Model`` (compiled as for training, with the optimizer's state); ``getHistory()``
    the per-epoch metrics ({"loss": [...], "val_loss": [...], ...}). Saved with the model in
    Keras' ``.keras`` format; ``custom_objects`` are used to load it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def _predictor_factory(self):
        import keras
        return KerasPredictor(model_to_bytes(self.getModel()), self.getCustomObjects(),
                              keras.backend.backend())

    def _pack_params(self, params: dict) -> dict:
        return _pack_model_params(params)

    def _unpack_params(self, params: dict) -> dict:
        return _unpack_model_params(params, params.get("custom_objects",
                                                       self.getCustomObjects()))


_params.declare(KerasEstimator, _KERAS_ESTIMATOR_PARAMS)
_params.declare(KerasModel, _KERAS_MODEL_PARAMS)
