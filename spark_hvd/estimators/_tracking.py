"""Experiment tracking of a fit in MLflow, on the driver.

``track_fit`` wraps one ``fit`` (TorchEstimator, KerasEstimator, LightningEstimator: nothing
here depends on the framework but the choice of MLflow flavour for the trained model). When
tracking is on it

- uses the MLflow run active on the fitting thread, or starts one named after the fit's
  ``run_id`` (and ends it when the fit ends: FINISHED, or FAILED with the error),
- logs the estimator's Params (objects as their ``repr``; ``env`` is never logged: it may hold
  credentials) and tags ``spark_hvd.run_id``, ``spark_hvd.store`` and
  ``spark_hvd.tensorboard_logdir``,
- logs every epoch's metrics (step = epoch) as soon as rank 0 reports the epoch, from the
  driver's ProgressSink, plus ``rows_per_second``; epochs it did not see live (a custom
  backend without the sink, a resumed run's earlier epochs) are logged from the history at
  the end,
- logs the trained model with MLflow's own flavour (``mlflow.pytorch`` for ``torch.nn.Module``
  including Lightning modules, ``mlflow.keras`` for Keras models) under the artifact name
  ``model``, with its signature (and, for a module MLflow's PyTorch pyfunc can call, an input
  example), and the history plot (``history.png``) when matplotlib is installed,
- and sets the returned model's ``mlflow_run_id`` Param (``getMlflowRunId()``).

Tracking is on when ``mlflow_tracking=True``, or ``mlflow_tracking_uri`` is set, or (the
default, ``mlflow_tracking=None``) MLflow is installed and either a run is active or a
tracking URI is set (``mlflow.set_tracking_uri`` or ``MLFLOW_TRACKING_URI``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings

MODEL_ARTIFACT = "model"
MAX_PARAM_LENGTH = 6000       # MLflow's limit on a param value's length
_NOT_LOGGED = frozenset({"env", "mlflow_tracking", "mlflow_tracking_uri"})


class _NoTracking:
    mlflow_run_id = None

    def log_model(self, model) -> None:
        """Logs the trained model (a Transformer of this package)."""


def _param(stage, name):
    return stage.getOrDefault(name) if stage.hasParam(name) else None


def _mlflow(required: bool):
    """The mlflow module; None when it is not installed and not ``required``."""
    try:
        import mlflow
    except ImportError as error:
        if not required:
            return None
        raise ImportError("MLflow tracking was asked for (mlflow_tracking=True or "
                          "mlflow_tracking_uri) but MLflow is not installed: pip install "
                          f"mlflow-skinny (or mlflow) ({error})") from error
    return mlflow


def tracking_uri_set(mlflow) -> bool:
    from mlflow.tracking._tracking_service import utils
    return bool(utils.is_tracking_uri_set())


def mlflow_for(estimator):
    """The mlflow module when ``estimator``'s fit is to be tracked, else None."""
    flag = _param(estimator, "mlflow_tracking")
    if flag is False:
        return None
    if flag or _param(estimator, "mlflow_tracking_uri"):
        return _mlflow(required=True)
    # Automatic: a user with an active run has imported MLflow; a tracking URI may also come
    # from the environment alone.
    if "mlflow" in sys.modules:
        mlflow = sys.modules["mlflow"]
        return mlflow if mlflow.active_run() is not None or tracking_uri_set(mlflow) else None
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return _mlflow(required=False)
    return None


def param_strings(estimator) -> dict:
    """The estimator's Params as MLflow param values (strings within MLflow's length limit)."""
    from ._params import param_values
    values = {}
    for name, value in sorted(param_values(estimator).items()):
        if name in _NOT_LOGGED or name.startswith("_"):
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            text = str(value)
        elif isinstance(value, (list, tuple)) and all(
                v is None or isinstance(v, (bool, int, float, str)) for v in value):
            text = str(list(value))
        else:
            text = repr(value)
        values[name] = text if len(text) <= MAX_PARAM_LENGTH else \
            text[:MAX_PARAM_LENGTH - 3] + "..."
    return values


@contextlib.contextmanager
def _tracking_uri(mlflow, uri):
    if not uri:
        yield
        return
    from mlflow.tracking._tracking_service import utils
    with utils._use_tracking_uri(uri):
        yield


class MlflowTracking:
    """One fit's MLflow run (see the module's docstring)."""

    def __init__(self, mlflow, estimator, run_id: str, owned: bool):
        self.mlflow, self.estimator, self.run_id = mlflow, estimator, run_id
        self.owned = owned
        self.mlflow_run_id = mlflow.active_run().info.run_id
        self.client = mlflow.MlflowClient(tracking_uri=mlflow.get_tracking_uri())
        self.epochs_logged = set()
        self._failed_live = False

    def start(self) -> None:
        store = _param(self.estimator, "store")
        tags = {"spark_hvd.run_id": self.run_id,
                "spark_hvd.estimator": type(self.estimator).__name__}
        if store is not None:
            tags["spark_hvd.store"] = str(getattr(store, "prefix_path", store))
            tags["spark_hvd.tensorboard_logdir"] = store.get_logs_path(self.run_id)
        self.mlflow.set_tags(tags)
        try:
            self.mlflow.log_params(param_strings(self.estimator))
        except self.mlflow.exceptions.MlflowException as error:
            # A second fit in the same run with other Params: MLflow refuses to change a
            # param's value. The metrics and the model are still logged.
            warnings.warn(f"spark_hvd: the estimator's Params were not logged to MLflow run "
                          f"{self.mlflow_run_id} ({error}); fit each estimator in its own run "
                          f"(e.g. mlflow.start_run(nested=True))", stacklevel=4)

    # -- progress events (on the thread that forwards the ranks' output) ------------------

    def on_event(self, kind: str, event: dict) -> None:
        if kind != "epoch_end":
            return
        metrics = dict(event.get("metrics") or {})
        if event.get("rows_per_second"):
            metrics["rows_per_second"] = event["rows_per_second"]
        try:
            self._log_epoch(int(event["epoch"]), metrics)
        except Exception as error:  # noqa: BLE001 - a tracking server's hiccup must not stop
            if not self._failed_live:  # training; the history is logged again at the end
                self._failed_live = True
                sys.stderr.write(f"spark_hvd: logging epoch {event.get('epoch')} to MLflow "
                                 f"failed ({type(error).__name__}: {error}); the remaining "
                                 f"epochs are logged when the fit ends\n")

    def _log_epoch(self, epoch: int, metrics: dict) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.mlflow_run_id, metrics=[
            Metric(key=k, value=float(v), timestamp=now, step=epoch)
            for k, v in metrics.items()])
        self.epochs_logged.add(epoch)

    # -- the end of the fit ------------------------------------------------------------------

    def log_model(self, model) -> None:
        """Logs the epochs not seen live, the trained model and the history plot, and sets
        the model's ``mlflow_run_id``."""
        history = _param(model, "history") or {}
        epochs = max((len(v) for v in history.values()), default=0)
        for epoch in range(epochs):
            if epoch not in self.epochs_logged:
                self._log_epoch(epoch, {k: v[epoch] for k, v in history.items()
                                        if epoch < len(v)})
        try:
            # MLflow 3 links the run's metrics at the model's step to the logged model: those
            # of the last epoch, whose weights these are.
            log_flavour(self.mlflow, model, step=max(epochs - 1, 0))
            if history:
                self._log_history_plot(history)
        except Exception as error:  # noqa: BLE001 - the trained model is returned anyway
            warnings.warn(f"spark_hvd: the trained model was not logged to MLflow run "
                          f"{self.mlflow_run_id}: {type(error).__name__}: {error}",
                          stacklevel=3)
        if model.hasParam("mlflow_run_id"):
            model._set(mlflow_run_id=self.mlflow_run_id)

    def _log_history_plot(self, history) -> None:
        import tempfile

        from . import _history
        if not _history.matplotlib_available():
            return
        with tempfile.TemporaryDirectory(prefix="spark_hvd_mlflow_") as directory:
            path = os.path.join(directory, "history.png")
            _history.plot_history(history, path, title=self.run_id)
            self.mlflow.log_artifact(path)

    def end(self, error: BaseException | None) -> None:
        if self.owned:
            self.mlflow.end_run("FINISHED" if error is None else "FAILED")


def log_flavour(mlflow, model, step: int = 0) -> None:
    """Logs the trained framework model of ``model`` (a Transformer) as the artifact
    ``model`` with MLflow's flavour for it (``step``: the epoch whose metrics describe it)."""
    inner = _param(model, "model")
    torch = sys.modules.get("torch")
    keras = sys.modules.get("keras")
    if torch is not None and isinstance(inner, torch.nn.Module):
        _log_torch(mlflow, model, inner, step)
    elif keras is not None and isinstance(inner, keras.Model):
        _log_keras(mlflow, model, inner, step)
    else:
        warnings.warn(f"spark_hvd: MLflow has no flavour here for a {type(inner).__name__}; "
                      "the trained model was not logged", stacklevel=3)


def _artifact_name(log_model, step: int) -> dict:
    import inspect
    # MLflow 3 names a logged model with name= and links it to a step; MLflow 2 took
    # artifact_path= and had no step.
    parameters = inspect.signature(log_model).parameters
    if "name" not in parameters:
        return {"artifact_path": MODEL_ARTIFACT}
    return {"name": MODEL_ARTIFACT, **({"step": step} if "step" in parameters else {})}


def example_inputs(model) -> list:
    """Two rows of zeros per feature column of ``model`` (a Transformer), in the dtype of the
    training data and the shape ``transform`` feeds the framework model (``input_shapes``)."""
    import numpy as np

    from .data._arrays import reshape_batch
    metadata = _param(model, "training_metadata")
    columns = list(_param(model, "feature_cols"))
    shapes = _param(model, "input_shapes") or [None] * len(columns)
    return [reshape_batch(np.zeros((2, *metadata["columns"][c]["shape"]),
                                   dtype=metadata["columns"][c]["dtype"]), shape)
            for c, shape in zip(columns, shapes)]


def signature_of(model, inputs, outputs, input_names):
    """The MLflow signature of a framework model that gave ``outputs`` for ``inputs`` (arrays,
    rows first): inputs named ``input_names`` (None: unnamed), outputs named ``output_cols``
    (default ``output_<i>``)."""
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    def spec(arrays, names):
        return Schema([TensorSpec(a.dtype, (-1, *a.shape[1:]), name) for a, name in
                       zip(arrays, names)])
    out_names = (list(_param(model, "output_cols") or []) or
                 [f"output_{i}" for i in range(len(outputs))])
    return ModelSignature(inputs=spec(inputs, input_names), outputs=spec(outputs, out_names))


def _columns_metadata(model, parameters) -> dict:
    """``metadata=`` for ``log_model`` (when it takes it): the feature columns, which the
    signature does not name when the model has one input."""
    if "metadata" not in parameters:
        return {}
    return {"metadata": {"spark_hvd.feature_cols": list(_param(model, "feature_cols"))}}


def torch_example(model, module):
    """(inputs, signature, servable) of a TorchModel: :func:`example_inputs` as ``transform``
    feeds the module (floats in torch's default dtype), the signature of those inputs and of
    the outputs they give, and whether MLflow's PyTorch pyfunc can serve the module, which it
    calls with one array, taking one tensor back. A servable module's input is unnamed in the
    signature: given a named one, the pyfunc hands the module a dict, which its PyTorch flavour
    refuses ("does not support List or Dict input types"). Other modules' inputs are named by
    their feature columns."""
    import torch

    from .rank._torch import as_tensor
    inputs = [as_tensor(x).numpy() for x in example_inputs(model)]
    with torch.inference_mode():
        outputs = module(*[torch.from_numpy(x) for x in inputs])
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    outputs = [o.detach().cpu().numpy() for o in outputs]
    servable = len(inputs) == 1 and len(outputs) == 1
    names = [None] if servable else list(_param(model, "feature_cols"))
    return inputs, signature_of(model, inputs, outputs, names), servable


def _log_torch(mlflow, model, module, step: int) -> None:
    import inspect

    import mlflow.pytorch
    parameters = inspect.signature(mlflow.pytorch.log_model).parameters
    kwargs = _artifact_name(mlflow.pytorch.log_model, step)
    formats = "serialization_format" in parameters
    inputs, servable = None, False
    if _param(model, "training_metadata") is not None:
        try:
            inputs, kwargs["signature"], servable = torch_example(model, module)
            kwargs.update(_columns_metadata(model, parameters))
        except Exception as error:  # noqa: BLE001 - the model is still logged, pickled
            warnings.warn(f"spark_hvd: no input example for MLflow ({error})", stacklevel=4)
    # An input example of arrays MLflow saves with the model and, adding its pyfunc flavour,
    # checks while logging by predicting it through that flavour: where the flavour cannot
    # call the module, it printed "Failed to validate serving input example ... Got error".
    # Arrays therefore go only with a servable module; torch tensors only trace the 'pt2'
    # graph (MLflow then saves no example and adds no pyfunc flavour).
    example = inputs[0] if servable else None
    if formats and inputs is not None:
        import torch
        traced = example if servable else tuple(torch.from_numpy(x) for x in inputs)
        try:
            # MLflow's default, safe format: torch.export's graph, traced on the example.
            mlflow.pytorch.log_model(module, serialization_format="pt2", input_example=traced,
                                     **kwargs)
            return
        except Exception as error:  # noqa: BLE001 - torch.export cannot trace every module
            warnings.warn(f"spark_hvd: torch.export could not trace the model for MLflow's "
                          f"'pt2' format ({type(error).__name__}: {error}); logged pickled "
                          "instead", stacklevel=4)
    if formats:
        kwargs["serialization_format"] = "pickle"
    if example is not None:
        kwargs["input_example"] = example
    mlflow.pytorch.log_model(module, **kwargs)


def keras_signature(model, inner):
    """The signature of a KerasModel's ``inner`` model, on :func:`example_inputs`. One input is
    unnamed (MLflow's pyfunc hands the model the array); several are named as the Keras model
    names its inputs, the keys Keras matches the dict that the pyfunc hands it by."""
    import numpy as np

    from ._predictions import as_list
    inputs = example_inputs(model)
    outputs = as_list(inner.predict_on_batch(inputs[0] if len(inputs) == 1 else inputs), inner)
    names = [getattr(t, "name", None) for t in getattr(inner, "inputs", None) or []]
    if len(inputs) == 1:
        names = [None]
    elif len(names) != len(inputs) or None in names:
        names = list(_param(model, "feature_cols"))
    return signature_of(model, inputs, [np.asarray(o) for o in outputs], names)


def _log_keras(mlflow, model, inner, step: int) -> None:
    import inspect

    import mlflow.keras
    parameters = inspect.signature(mlflow.keras.log_model).parameters
    kwargs = _artifact_name(mlflow.keras.log_model, step)
    # A signature (MLflow warns "without specifying model signature" otherwise), no input
    # example: MLflow's keras flavour needs none.
    if _param(model, "training_metadata") is not None:
        try:
            kwargs["signature"] = keras_signature(model, inner)
            kwargs.update(_columns_metadata(model, parameters))
        except Exception as error:  # noqa: BLE001 - the model is still logged
            warnings.warn(f"spark_hvd: no signature for MLflow ({error})", stacklevel=4)
    mlflow.keras.log_model(inner, **kwargs)


@contextlib.contextmanager
def track_fit(estimator, run_id: str, sink):
    """Tracks one fit of ``estimator`` (run ``run_id``, progress through ``sink``); yields an
    object whose ``log_model(model)`` is called with the trained model."""
    mlflow = mlflow_for(estimator)
    if mlflow is None:
        yield _NoTracking()
        return
    uri = _param(estimator, "mlflow_tracking_uri")
    active = mlflow.active_run()
    if active is not None and uri and uri != mlflow.get_tracking_uri():
        raise ValueError(f"{type(estimator).__name__}: mlflow_tracking_uri={uri!r} differs from "
                         f"the tracking URI of the active MLflow run {active.info.run_id} "
                         f"({mlflow.get_tracking_uri()!r}); end that run or drop the Param")
    asked = bool(_param(estimator, "mlflow_tracking") or uri)
    with _tracking_uri(mlflow, None if active is not None else uri):
        tracking = None
        try:
            if active is None:
                mlflow.start_run(run_name=run_id)
            tracking = MlflowTracking(mlflow, estimator, run_id, owned=active is None)
            tracking.start()
        except Exception as error:  # noqa: BLE001
            if tracking is not None:
                tracking.end(error)
            if asked:
                raise
            # Tracking that turned itself on (an environment's tracking URI) must not cost the
            # user the fit: train untracked and say why.
            warnings.warn(f"spark_hvd: this fit is not tracked in MLflow, which could not start "
                          f"a run ({type(error).__name__}: {error}); set mlflow_tracking=False "
                          f"to silence this", stacklevel=4)
            yield _NoTracking()
            return
        try:
            sink.add_listener(tracking.on_event)
            yield tracking
        except BaseException as error:
            tracking.end(error)
            raise
        tracking.end(None)
