"""Tracking of a fit: MLflow (a real local file store, read back through MLflow's client) and
TensorBoard (the event files read back with TensorBoard's EventAccumulator), for TorchEstimator,
KerasEstimator and LightningEstimator on a real local Spark, with no error printed by MLflow
while it logs the model; the progress listeners and the MLflow switch."""

from __future__ import annotations

import importlib
import io
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyspark")
torch = pytest.importorskip("torch")
mlflow = pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

import cloudpickle  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "spark_workers"))
import estimator_fns  # noqa: E402
from hide_package import run_without  # noqa: E402

from spark_hvd.estimators import Store, TorchEstimator, TorchModel  # noqa: E402
from spark_hvd.estimators import _progress, _tracking  # noqa: E402
from spark_hvd.estimators._base import SparkBackend  # noqa: E402

cloudpickle.register_pickle_by_value(estimator_fns)
cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(300)

EPOCH_PAUSE = 1.5     # seconds each rank waits at the start of epochs 1, 2, ...


class PauseBetweenEpochs:
    """Makes the epochs of a fit seconds apart, so that metrics logged as the epochs end have
    timestamps that far apart (logged from the history at the end, they would not)."""

    def on_epoch_begin(self, epoch):
        if epoch > 0:
            time.sleep(EPOCH_PAUSE)


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A fresh MLflow file store (MLflow 3 refuses one unless MLFLOW_ALLOW_FILE_STORE is set;
    a database store needs the full mlflow package), the process's tracking state restored
    afterwards."""
    from mlflow.tracking._tracking_service import utils
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    # mlflow.set_tracking_uri / set_experiment export MLFLOW_TRACKING_URI / _EXPERIMENT_ID:
    # restored afterwards, or later tests' subprocesses (the examples) would track into a
    # store that is gone. (monkeypatch.delenv does not restore a name that was not set.)
    names = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME")
    saved = {name: os.environ.pop(name, None) for name in names}
    uri = (tmp_path / "mlruns").as_uri()      # not created yet: MLflow makes "Default" in it
    yield uri
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    while mlflow.active_run() is not None:
        mlflow.end_run()
    utils._tracking_uri = None
    mlflow.tracking.fluent._active_experiment_id = None


def events(logdir):
    """{split: {tag: [(step, value), ...]}} of the TensorBoard event files under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    scalars = {}
    for split in sorted(os.listdir(logdir)):
        path = os.path.join(logdir, split)
        if not os.path.isdir(path):
            continue
        acc = EventAccumulator(path)
        acc.Reload()
        scalars[split] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
                          for tag in acc.Tags()["scalars"]}
    return scalars


def mlflow_problems(text: str) -> list[str]:
    """The lines in which MLflow says something is wrong with the model it was given: an
    error, a failed check of its input example ("Failed to validate serving input example ...
    Got error: The PyTorch flavor does not support List or Dict input types ..."), no
    signature."""
    return [line for line in text.splitlines()
            if re.search(r"\bERROR mlflow|Got error|Failed to validate|without specifying "
                         r"model signature", line)]


def log_model_alone(estimator, model, capfd) -> str:
    """Logs ``model`` as the tracking of a fit of ``estimator`` does, checks that MLflow printed
    no problem, and returns the logged model's URI."""
    sink = _progress.ProgressSink(io.StringIO(), verbose=0)
    with _tracking.track_fit(estimator, "r", sink) as tracking:
        tracking.log_model(model)
    printed = capfd.readouterr()
    assert not mlflow_problems(printed.out + printed.err), printed.err[-4000:]
    return f"runs:/{model.getMlflowRunId()}/model"


def metric_history(client, run_id, key):
    """The run's values of ``key`` by step. MLflow 3 returns the logged model's copy of the
    values at its step as well: one value per step is kept."""
    by_step = {m.step: m for m in client.get_metric_history(run_id, key)}
    return [by_step[step] for step in sorted(by_step)]


def test_torch_fit_logs_params_live_metrics_model_and_tensorboard(spark, regression_df,
                                                                  tmp_path, mlflow_store, capfd):
    mlflow.set_tracking_uri(mlflow_store)
    mlflow.set_experiment("estimators")
    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = estimator_fns.Linear()
    out = io.StringIO()
    estimator = TorchEstimator(
        backend=SparkBackend(num_proc=2, stdout=out), store=store, model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss=torch.nn.functional.mse_loss,
        metrics=[estimator_fns.mae], feature_cols=["features"], label_cols=["label"],
        batch_size=16, epochs=3, random_seed=7, validation="is_val", partitions_per_process=2,
        callbacks=[PauseBetweenEpochs()], verbose=0)
    with mlflow.start_run(run_name="user run") as run:
        started = time.time()
        model = estimator.fit(regression_df)
        ended = time.time()
    printed = capfd.readouterr()
    assert not mlflow_problems(printed.out + printed.err), printed.err[-4000:]
    assert out.getvalue().count("Epoch ") == 0          # verbose=0: nothing printed...
    assert model.getMlflowRunId() == run.info.run_id    # ...but tracked in the active run
    history = model.getHistory()
    client = mlflow.MlflowClient()
    logged = client.get_run(run.info.run_id)
    assert logged.info.status == "FINISHED"
    params = logged.data.params
    assert params["batch_size"] == "16" and params["epochs"] == "3"
    assert params["feature_cols"] == "['features']" and params["validation"] == "is_val"
    assert params["optimizer"].startswith("SGD (") and "Linear" in params["model"]
    assert "env" not in params
    assert logged.data.tags["spark_hvd.run_id"] == model.getRunId()
    assert logged.data.tags["spark_hvd.tensorboard_logdir"] == \
        store.get_logs_path(model.getRunId())

    for key in ("loss", "mae", "val_loss", "val_mae"):
        series = metric_history(client, run.info.run_id, key)
        assert [m.step for m in series] == [0, 1, 2], key
        np.testing.assert_allclose([m.value for m in series], history[key], rtol=1e-6)
    # Logged as the epochs ended: the timestamps are the pauses apart and inside the fit.
    stamps = [m.timestamp / 1000 for m in metric_history(client, run.info.run_id, "loss")]
    assert started - 1 <= stamps[0] and stamps[-1] <= ended + 1
    assert all(b - a >= EPOCH_PAUSE * 0.8 for a, b in zip(stamps, stamps[1:])), stamps
    assert len(metric_history(client, run.info.run_id, "rows_per_second")) == 3

    # The model with MLflow's pytorch flavour, predicting what the TorchModel's module does,
    # also through MLflow's pyfunc (its input example, one array, was checked while logging).
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "history.png" in artifacts
    uri = f"runs:/{run.info.run_id}/model"
    loaded = importlib.import_module("mlflow.pytorch").load_model(uri)
    x = torch.randn(5, 4)
    with torch.no_grad():
        expected = model.getModel()(x).numpy()
        np.testing.assert_allclose(loaded(x).numpy(), expected, rtol=1e-5, atol=1e-6)
    served = importlib.import_module("mlflow.pyfunc").load_model(uri)
    np.testing.assert_allclose(served.predict(x.numpy()), expected, rtol=1e-5, atol=1e-6)

    # TensorBoard: epoch scalars for train and validation, the loss of every step.
    scalars = events(store.fs_path(store.get_logs_path(model.getRunId())))
    assert set(scalars) == {"train", "validation"}
    for name, split, tag in (("loss", "train", "epoch_loss"), ("mae", "train", "epoch_mae"),
                             ("val_loss", "validation", "epoch_loss"),
                             ("val_mae", "validation", "epoch_mae")):
        assert [s for s, _ in scalars[split][tag]] == [0, 1, 2]
        np.testing.assert_allclose([v for _, v in scalars[split][tag]], history[name],
                                   rtol=1e-6)
    steps = [s for s, _ in scalars["train"]["batch_loss"]]
    assert len(steps) >= 3 and steps == sorted(set(steps)) and steps[0] == 1
    assert len(steps) % 3 == 0          # the same number of steps in every epoch
    assert [s for s, _ in scalars["train"]["epoch_rows_per_second"]] == [0, 1, 2]


def test_keras_fit_with_tracking_uri_param_starts_and_ends_its_own_run(spark, regression_df,
                                                                       tmp_path, mlflow_store,
                                                                       capfd):
    keras = pytest.importorskip("keras")
    import keras_estimator_fns as kfns
    cloudpickle.register_pickle_by_value(kfns)
    from spark_hvd.estimators import KerasEstimator
    assert mlflow.active_run() is None
    store = Store.create(str(tmp_path / "store"))
    estimator = KerasEstimator(
        num_proc=2, store=store, model=kfns.linear_model(),
        optimizer=keras.optimizers.SGD(0.05), loss="mse", custom_objects={"Scale": kfns.Scale},
        feature_cols=["features"], label_cols=["label"], batch_size=16, epochs=2,
        random_seed=7, validation="is_val", partitions_per_process=2, verbose=0,
        mlflow_tracking_uri=mlflow_store)
    model = estimator.fit(regression_df)
    printed = capfd.readouterr()
    assert not mlflow_problems(printed.out + printed.err), printed.err[-4000:]
    assert mlflow.active_run() is None                  # the fit's own run was ended
    client = mlflow.MlflowClient(tracking_uri=mlflow_store)
    run = client.get_run(model.getMlflowRunId())
    assert run.info.status == "FINISHED" and run.info.run_name == model.getRunId()
    assert run.data.params["epochs"] == "2" and run.data.params["loss"] == "mse"
    history = model.getHistory()
    for key in ("loss", "val_loss"):
        series = metric_history(client, run.info.run_id, key)
        assert [m.step for m in series] == [0, 1]
        np.testing.assert_allclose([m.value for m in series], history[key], rtol=1e-5)
    with mlflow.tracking._tracking_service.utils._use_tracking_uri(mlflow_store):
        uri = f"runs:/{run.info.run_id}/model"
        loaded = importlib.import_module("mlflow.keras").load_model(
            uri, custom_objects={"Scale": kfns.Scale})
        signature = mlflow.models.get_model_info(uri).signature
    assert [(s.name, s.shape) for s in signature.inputs.inputs] == [(None, (-1, 4))]
    x = np.random.default_rng(1).normal(size=(6, 4)).astype(np.float32)
    np.testing.assert_allclose(loaded.predict(x, verbose=0),
                               model.getModel().predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    scalars = events(store.fs_path(store.get_logs_path(model.getRunId())))
    np.testing.assert_allclose([v for _, v in scalars["validation"]["epoch_loss"]],
                               history["val_loss"], rtol=1e-5)
    assert len(scalars["train"]["batch_loss"]) >= 2


def test_lightning_fit_logs_a_model_mlflow_serves(spark, regression_df, tmp_path, mlflow_store,
                                                  capfd):
    """A LightningModule is logged with the pytorch flavour, an input example and a signature
    that MLflow's pyfunc serves: MLflow checks it while logging and prints no error (it printed
    "Got error: The PyTorch flavor does not support List or Dict input types" when the
    signature named the input)."""
    pytest.importorskip("lightning")
    import lightning_fns
    cloudpickle.register_pickle_by_value(lightning_fns)
    from spark_hvd.estimators.lightning import LightningEstimator
    torch.manual_seed(0)
    estimator = LightningEstimator(
        num_proc=2, store=Store.create(str(tmp_path / "store")),
        model=lightning_fns.Regressor(lr=0.1), feature_cols=["features"], label_cols=["label"],
        batch_size=16, epochs=1, random_seed=3, partitions_per_process=2, verbose=0,
        mlflow_tracking_uri=mlflow_store)
    model = estimator.fit(regression_df)
    printed = capfd.readouterr()
    assert not mlflow_problems(printed.out + printed.err), printed.err[-4000:]
    uri = f"runs:/{model.getMlflowRunId()}/model"
    x = torch.randn(5, 4)
    with torch.no_grad():
        expected = model.getModel()(x).numpy()
    with mlflow.tracking._tracking_service.utils._use_tracking_uri(mlflow_store):
        loaded = importlib.import_module("mlflow.pytorch").load_model(uri)
        served = importlib.import_module("mlflow.pyfunc").load_model(uri)
    with torch.no_grad():
        np.testing.assert_allclose(loaded(x).numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(served.predict(x.numpy()), expected, rtol=1e-5, atol=1e-6)
    assert served.metadata.metadata["spark_hvd.feature_cols"] == ["features"]


class TwoInputs(torch.nn.Module):
    """A vector and a 2x3 grid in, one output. (Not estimator_fns.TwoInputs: its forward's
    ``len(grid)`` makes torch.export fix the batch dimension to the example's two rows.)"""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(10, 1)

    def forward(self, vec, grid):
        return self.fc(torch.cat([vec, grid.flatten(1)], dim=1))


class TwoOutputs(torch.nn.Module):
    """One feature column in, two outputs."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        y = self.fc(x)
        return y[:, 0], y[:, 1]


@pytest.mark.parametrize("module, columns", [
    (TwoInputs, {"vec": ("float32", [4]), "grid": ("float64", [2, 3])}),
    (TwoOutputs, {"features": ("float32", [4])})], ids=["two_inputs", "two_outputs"])
def test_modules_mlflow_pyfunc_cannot_call_are_logged_without_errors(mlflow_store, capfd,
                                                                     module, columns):
    """MLflow's PyTorch pyfunc calls a module with one array and takes one tensor back. A
    module with several inputs or outputs is logged with a signature naming its columns and
    traced on tensors, without the pyfunc flavour and input example that MLflow would check
    while logging (printing "Got error: ..." as it fails), and it loads and predicts."""
    mlflow.set_tracking_uri(mlflow_store)
    torch.manual_seed(0)
    net = module()
    metadata = {"columns": {name: {"dtype": dtype, "shape": shape, "kind": "array"}
                            for name, (dtype, shape) in columns.items()}}
    model = TorchModel(model=net, feature_cols=list(columns), label_cols=["y1", "y2"],
                       training_metadata=metadata)
    uri = log_model_alone(TorchEstimator(mlflow_tracking=True), model, capfd)
    info = mlflow.models.get_model_info(uri)
    assert info.signature.inputs.input_names() == list(columns)
    inputs = [torch.randn(3, *shape) for _, shape in columns.values()]
    loaded = importlib.import_module("mlflow.pytorch").load_model(uri)
    with torch.no_grad():
        got, want = loaded(*inputs), net(*inputs)
    for got, want in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, want))):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_keras_model_with_two_inputs_is_logged_with_a_signature_pyfunc_serves(mlflow_store,
                                                                            capfd):
    """A Keras model's signature names several inputs as the model does: MLflow's pyfunc
    hands the model a dict by those names, which Keras matches to its inputs."""
    pytest.importorskip("keras")
    import keras_estimator_fns as kfns

    from spark_hvd.estimators import KerasEstimator, KerasModel
    mlflow.set_tracking_uri(mlflow_store)
    net = kfns.two_in_two_out()
    metadata = {"columns": {"vec": {"dtype": "float32", "shape": [4], "kind": "vector"},
                            "grid": {"dtype": "float64", "shape": [2, 3], "kind": "array"}}}
    model = KerasModel(model=net, feature_cols=["vec", "grid"], label_cols=["y1", "y2"],
                       training_metadata=metadata)
    uri = log_model_alone(KerasEstimator(mlflow_tracking=True), model, capfd)
    signature = mlflow.models.get_model_info(uri).signature
    assert signature.inputs.input_names() == ["vec", "grid"]
    rng = np.random.default_rng(2)
    x = {"vec": rng.normal(size=(3, 4)).astype(np.float32), "grid": rng.normal(size=(3, 2, 3))}
    served = importlib.import_module("mlflow.pyfunc").load_model(uri).predict(x)
    expected = net.predict_on_batch([x["vec"], x["grid"]])
    np.testing.assert_allclose(np.asarray(served), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_tracking_switch(mlflow_store, tmp_path):
    """mlflow_tracking: None follows MLflow's state, False never, True always."""
    estimator = TorchEstimator()
    assert _tracking.mlflow_for(estimator) is None           # no run, no URI set
    mlflow.set_tracking_uri(mlflow_store)
    assert _tracking.mlflow_for(estimator) is mlflow          # a URI set by the user
    assert _tracking.mlflow_for(TorchEstimator(mlflow_tracking=False)) is None
    from mlflow.tracking._tracking_service import utils
    utils._tracking_uri = None
    assert _tracking.mlflow_for(TorchEstimator(mlflow_tracking=True)) is mlflow
    assert _tracking.mlflow_for(TorchEstimator(mlflow_tracking_uri=mlflow_store)) is mlflow
    # Params as MLflow strings: objects by repr, env never, long values cut to MLflow's limit.
    values = _tracking.param_strings(TorchEstimator(
        epochs=2, env={"SECRET": "x"}, feature_cols=["a", "b"], run_id="r" * 7000))
    assert values["epochs"] == "2" and values["feature_cols"] == "['a', 'b']"
    assert "env" not in values and len(values["run_id"]) == _tracking.MAX_PARAM_LENGTH
    # No tracking: the model keeps no MLflow run id.
    model = TorchModel(model=torch.nn.Linear(2, 1))
    with _tracking.track_fit(TorchEstimator(mlflow_tracking=False), "r", None) as tracking:
        tracking.log_model(model)
    assert model.getMlflowRunId() is None


def test_tracking_that_cannot_start_costs_no_fit_unless_asked(mlflow_store, tmp_path,
                                                              monkeypatch):
    """A tracking URI from the environment turns tracking on by itself; when MLflow then cannot
    start a run (here MLflow 3 refusing a file store without MLFLOW_ALLOW_FILE_STORE), the fit
    goes on untracked with a warning. Asked for by a Param, the same failure is an error."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_store          # restored by the fixture
    sink = _progress.ProgressSink(io.StringIO(), verbose=0)
    model = TorchModel(model=torch.nn.Linear(2, 1))
    with pytest.warns(UserWarning, match="not tracked in MLflow"):
        with _tracking.track_fit(TorchEstimator(), "r", sink) as tracking:
            tracking.log_model(model)
    assert model.getMlflowRunId() is None and mlflow.active_run() is None
    with pytest.raises(mlflow.exceptions.MlflowException, match="MLFLOW_ALLOW_FILE_STORE"):
        with _tracking.track_fit(TorchEstimator(mlflow_tracking=True), "r", sink):
            pass
    assert mlflow.active_run() is None


def test_tracking_asked_without_mlflow_names_the_package():
    proc = run_without("mlflow", """
        from spark_hvd.estimators import TorchEstimator, _tracking
        assert _tracking.mlflow_for(TorchEstimator()) is None
        try:
            _tracking.mlflow_for(TorchEstimator(mlflow_tracking=True))
        except ImportError as error:
            print("ERROR:", error)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "ERROR: MLflow tracking was asked for (mlflow_tracking=True or " \
           "mlflow_tracking_uri) but MLflow is not installed: pip install mlflow-skinny" \
           in proc.stdout, proc.stdout


def marked(kind, **fields):
    return f"[0]<stdout>: {_progress.MARKER}{json.dumps({'event': kind, **fields})}\n"


def test_progress_listeners_see_every_event_at_any_verbosity():
    quiet = io.StringIO()
    sink = _progress.ProgressSink(quiet, verbose=0)
    seen = []
    sink.add_listener(lambda kind, fields: seen.append((kind, fields)))

    def broken(kind, fields):
        raise RuntimeError("tracking server down")
    sink.add_listener(broken)
    sink.write(marked("epoch_start", epoch=0, epochs=2, steps=4))
    sink.write(marked("epoch_end", epoch=0, epochs=2, metrics={"loss": 0.5}) + "plain\n")
    assert [k for k, _ in seen] == ["epoch_start", "epoch_end"]
    assert seen[1][1]["metrics"] == {"loss": 0.5} and quiet.getvalue() == ""
    sink.write(marked("epoch_end", epoch=1, epochs=2, metrics={"loss": 0.25}))
    assert len(seen) == 3       # the broken listener was dropped, the other one still called


def test_tensorboard_logs_reach_a_store_that_is_not_local(tmp_path):
    """A Store on another filesystem (fsspec's memory://) gets copies of the event files
    after every epoch; TensorFlow is never imported for them."""
    pytest.importorskip("fsspec")
    from spark_hvd.estimators.rank import _tensorboard
    store = Store.create(f"memory://spark_hvd_tb_{os.getpid()}/store")
    logs = _tensorboard.RunLogs(store, "run_1")
    for step in range(1, 5):
        logs.step(step, 1.0 / step)
    logs.epoch(0, {"loss": 0.5, "val_loss": 0.75}, 100.0)
    remote = store.get_logs_path("run_1")
    assert sorted(store.listdir(remote)) == ["train", "validation"]   # copied at epoch end
    logs.step(5, 0.125)
    logs.close()
    for split in ("train", "validation"):
        (tmp_path / split).mkdir()
        for name in store.listdir(store.join(remote, split)):
            (tmp_path / split / name).write_bytes(store.read_bytes(store.join(remote, split,
                                                                              name)))
    scalars = events(str(tmp_path))
    assert scalars["train"]["batch_loss"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3)),
                                              (4, 0.25), (5, 0.125)]
    assert scalars["train"]["epoch_loss"] == [(0, 0.5)]
    assert scalars["validation"]["epoch_loss"] == [(0, 0.75)]
    assert not os.path.exists(logs._scratch)
