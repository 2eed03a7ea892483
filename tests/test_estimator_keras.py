"""KerasEstimator → KerasModel end to end on a real local Spark: fit in a Pipeline with
validation, sample weights and a custom layer, transform, history and progress, save/load of
Estimator, Model and PipelineModel, resume by run_id, a compiled two-input two-output model
with checkpoint_callback, Spark Connect, the Param errors, and the example through
spark-submit. Every fit costs several seconds, so each test checks several things."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyspark")
keras = pytest.importorskip("keras")

import cloudpickle  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "spark_workers"))
import keras_estimator_fns as fns  # noqa: E402

from spark_hvd.estimators import KerasEstimator, KerasModel, Store  # noqa: E402
from spark_hvd.estimators._base import SparkBackend  # noqa: E402
from spark_hvd.estimators.rank._keras import read_state  # noqa: E402

cloudpickle.register_pickle_by_value(fns)
pytestmark = pytest.mark.timeout(300)

CUSTOM = {"Scale": fns.Scale}


def make_estimator(store, **overrides):
    params = dict(num_proc=2, store=store, model=fns.linear_model(),
                  optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=[fns.abs_error],
                  custom_objects=CUSTOM, feature_cols=["features"], label_cols=["label"],
                  batch_size=16, epochs=3, random_seed=7, verbose=1, partitions_per_process=2)
    params.update(overrides)
    return KerasEstimator(**params)


def features_of(pandas_df, column):
    return np.stack(pandas_df[column].map(lambda v: v.toArray()).to_numpy()).astype(np.float32)


def test_pipeline_fit_transform_history_save_load(spark, regression_df, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import StandardScaler
    out = io.StringIO()
    store = Store.create(str(tmp_path / "store"))
    estimator = make_estimator(store, validation="is_val", sample_weight_col="weight",
                               feature_cols=["scaled"], num_proc=None,
                               backend=SparkBackend(num_proc=2, stdout=out))
    pipeline = Pipeline(stages=[StandardScaler(inputCol="features", outputCol="scaled"),
                                estimator])
    # The unfitted Pipeline saves and loads; the model comes back through custom_objects.
    pipeline.save(str(tmp_path / "pipeline"))
    loaded = Pipeline.load(str(tmp_path / "pipeline")).getStages()[1]
    assert isinstance(loaded, KerasEstimator)
    for name in ("batch_size", "epochs", "validation", "sample_weight_col", "feature_cols",
                 "label_cols", "random_seed", "loss", "partitions_per_process"):
        assert loaded.getOrDefault(name) == estimator.getOrDefault(name), name
    assert isinstance(loaded.getModel().layers[-2], fns.Scale)
    np.testing.assert_array_equal(loaded.getModel().get_weights()[0],
                                  estimator.getModel().get_weights()[0])
    assert isinstance(loaded.getOptimizer(), keras.optimizers.SGD)
    assert loaded.getMetrics()[0].__name__ == "abs_error"

    fitted = pipeline.fit(regression_df)
    keras_model = fitted.stages[-1]
    assert isinstance(keras_model, KerasModel)
    history = keras_model.getHistory()
    assert set(history) == {"loss", "abs_error", "val_loss", "val_abs_error"}
    assert all(len(v) == 3 for v in history.values())
    assert history["loss"][-1] < history["loss"][0] * 0.5 and history["val_loss"][-1] < 0.05
    lines = [line for line in out.getvalue().splitlines() if line.startswith("Epoch ")]
    assert [line.split(" - ")[0] for line in lines] == ["Epoch 1/3", "Epoch 2/3", "Epoch 3/3"]
    assert "val_loss:" in lines[-1] and "rows/s" in lines[-1]
    assert [e for e, _ in store.list_checkpoints(keras_model.getRunId())] == [1, 2]
    trained = keras_model.getModel()
    assert trained.compiled and int(trained.optimizer.iterations) > 0

    scored = fitted.transform(regression_df).select("scaled", "label", "label__output") \
        .toPandas()
    assert len(scored) == 512 and scored["label__output"].dtype == np.float64
    expected = trained.predict_on_batch(features_of(scored, "scaled"))
    np.testing.assert_allclose(scored["label__output"], expected, rtol=1e-5, atol=1e-5)
    assert np.abs(scored["label__output"] - scored["label"]).mean() < 0.3

    fitted.write().overwrite().save(str(tmp_path / "fitted"))
    store.delete(store.prefix_path)          # the model is in the saved directory
    reloaded = PipelineModel.load(str(tmp_path / "fitted"))
    reloaded_model = reloaded.stages[-1]
    assert isinstance(reloaded_model, KerasModel)
    assert reloaded_model.getHistory() == history
    assert reloaded_model.getRunId() == keras_model.getRunId()
    assert reloaded_model.getCustomObjects().keys() == CUSTOM.keys()
    model = reloaded_model.getModel()
    assert model.compiled and int(model.optimizer.iterations) == int(trained.optimizer.iterations)
    for a, b in zip(model.get_weights(), trained.get_weights()):
        np.testing.assert_array_equal(a, b)
    again = reloaded.transform(regression_df).select("label__output").toPandas()
    np.testing.assert_array_equal(again["label__output"], scored["label__output"])


def test_resume_by_run_id(spark, regression_df, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    first = make_estimator(store, epochs=2, run_id="resumable").fit(regression_df)
    assert [e for e, _ in store.list_checkpoints("resumable")] == [0, 1]
    _, last = store.list_checkpoints("resumable")[-1]
    data = store.read_bytes(last)
    state = read_state(data)               # a .keras file with the epoch and history in it
    assert state["epoch"] == 1 and state["history"] == first.getHistory()
    path = tmp_path / "checkpoint.keras"
    path.write_bytes(data)
    assert isinstance(keras.models.load_model(path, custom_objects=CUSTOM, compile=False),
                      keras.Model)

    second = make_estimator(store, epochs=3, run_id="resumable").fit(regression_df)
    history = second.getHistory()
    assert {k: v[:2] for k, v in history.items()} == first.getHistory()
    assert all(len(v) == 3 for v in history.values())
    assert history["loss"][2] < history["loss"][0]
    assert [e for e, _ in store.list_checkpoints("resumable")] == [1, 2]
    # The optimizer state went on too: 3 epochs of steps, not 1.
    steps = int(first.getModel().optimizer.iterations) // 2
    assert int(second.getModel().optimizer.iterations) == 3 * steps


def test_compiled_two_inputs_two_outputs_and_checkpoint_callback(spark, tmp_path,
                                                                 two_inputs_df):
    df = two_inputs_df
    model = fns.two_in_two_out()
    # Compiled: optimizer and losses come from the model. The checkpoint callback keeps only
    # the *worst* epoch (the first), so the model fit returns is epoch 0's.
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=["mse", "mse"],
                  loss_weights=[1.0, 0.5])
    store = Store.create(str(tmp_path / "store"))
    estimator = KerasEstimator(
        num_proc=2, store=store, model=model, feature_cols=["vec", "grid"],
        label_cols=["y1", "y2"], input_shapes=[[-1, 4], [-1, 2, 3]], batch_size=16, epochs=2,
        backward_passes_per_step=2, scale_learning_rate=True, random_seed=1, verbose=0,
        checkpoint_callback=keras.callbacks.ModelCheckpoint(
            "unused.keras", monitor="loss", mode="max", save_best_only=True))
    fitted = estimator.fit(df)
    history = fitted.getHistory()
    assert set(history) >= {"loss", "y1_loss", "y2_loss"}
    assert history["loss"][1] < history["loss"][0]
    checkpoints = dict(store.list_checkpoints(fitted.getRunId()))
    epoch0 = keras.models.load_model(_local_copy(store, checkpoints[0], tmp_path, "e0"),
                                     compile=False)
    epoch1 = keras.models.load_model(_local_copy(store, checkpoints[1], tmp_path, "e1"),
                                     compile=False)
    returned = fitted.getModel()
    assert all(np.array_equal(a, b) for a, b in zip(returned.get_weights(),
                                                    epoch0.get_weights()))
    assert not all(np.array_equal(a, b) for a, b in zip(returned.get_weights(),
                                                        epoch1.get_weights()))
    assert isinstance(returned.optimizer, keras.optimizers.Adam)
    assert float(returned.optimizer.learning_rate) == pytest.approx(0.1)   # 0.05 * 2 ranks

    fitted.setOutputCols(["p1", "p2"])
    scored = fitted.transform(df).select("y1", "y2", "p1", "p2").toPandas()
    assert list(scored.columns) == ["y1", "y2", "p1", "p2"] and len(scored) == 256
    assert scored["p1"].dtype == np.float64 and scored["p2"].dtype == np.float64


def _local_copy(store, path, tmp_path, name):
    local = tmp_path / f"{name}.keras"
    local.write_bytes(store.read_bytes(path))
    return local


def test_connect_session_fit_and_transform(connect, regression_df, tmp_path):
    regression_df.write.parquet(str(tmp_path / "data.parquet"))
    df = connect.read.parquet(str(tmp_path / "data.parquet"))
    estimator = make_estimator(Store.create(str(tmp_path / "store")), epochs=1, verbose=0)
    model = estimator.fit(df)
    scored = model.transform(df.limit(10)).toPandas()
    assert len(scored) == 10 and "label__output" in scored.columns
    path = str(tmp_path / "model")
    model.write().session(connect).save(path)
    loaded = KerasModel.read().session(connect).load(path)
    for a, b in zip(loaded.getModel().get_weights(), model.getModel().get_weights()):
        np.testing.assert_array_equal(a, b)


def test_stage_saved_before_the_rooms_loads(tmp_path, monkeypatch):
    """A saved stage's payload pickles its Keras model and optimizer as SavedModel and
    _KerasObject records, by class path: stages saved before the estimators' files moved into
    rooms name spark_hvd.estimators._keras_remote, which still loads them (a fresh process)."""
    import subprocess

    import spark_hvd.estimators._keras_remote  # noqa: F401 - cloudpickle looks the path up
    from spark_hvd.estimators.keras import _pack_model_params
    from spark_hvd.estimators.rank import _keras
    model = fns.linear_model()
    packed = _pack_model_params({"model": model, "optimizer": keras.optimizers.SGD(0.05)})
    old = "spark_hvd.estimators._keras_remote"
    with monkeypatch.context() as patch:     # the classes where the old code had them
        patch.setattr(_keras.SavedModel, "__module__", old)
        patch.setattr(_keras._KerasObject, "__module__", old)
        payload = cloudpickle.dumps({"params": packed, "extra": None})
    assert old.encode() in payload and b"rank._keras" not in payload
    (tmp_path / "payload").write_bytes(payload)
    code = f"""
import sys, cloudpickle
sys.path.insert(0, {str(Path(fns.__file__).parent)!r})
import keras_estimator_fns as fns
from spark_hvd.estimators.keras import _unpack_model_params
payload = cloudpickle.loads(open({str(tmp_path / "payload")!r}, "rb").read())
params = _unpack_model_params(payload["params"], {{"Scale": fns.Scale}})
print(type(params["optimizer"]).__name__, params["optimizer"].learning_rate.numpy())
print(repr([w.tolist() for w in params["model"].get_weights()]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-2].split()[0] == "SGD" and float(lines[-2].split()[1]) == pytest.approx(0.05)
    assert lines[-1] == repr([w.tolist() for w in model.get_weights()])


def test_param_errors(spark, regression_df, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    with pytest.raises(ValueError, match="model must be a keras.Model"):
        make_estimator(store, model="not a model").fit(regression_df)
    with pytest.raises(ValueError, match="optimizer is not set"):
        make_estimator(store, optimizer=None).fit(regression_df)
    with pytest.raises(ValueError, match="must be a keras.optimizers.Optimizer"):
        make_estimator(store, optimizer=object()).fit(regression_df)
    with pytest.raises(ValueError, match="loss is not set"):
        make_estimator(store, loss=None).fit(regression_df)
    with pytest.raises(ValueError, match="store is not set"):
        make_estimator(None).fit(regression_df)
    with pytest.raises(TypeError, match="unknown parameter"):
        KerasEstimator(loss_constructors=[])
    assert make_estimator(store).setEpochs(5).getEpochs() == 5


@pytest.mark.slow
def test_example_with_spark_submit(tmp_path):
    from test_spark_cluster import _check_estimator_example, _env, _run, _submit_args
    example = Path(__file__).resolve().parent.parent / "examples" / "spark" / \
        "keras_estimator.py"
    args = _submit_args("local[2]", tmp_path) + [example, "--rows", "2000", "--epochs", "2",
                                                 "--store", tmp_path / "store"]
    _check_estimator_example(_run(args, _env(tmp_path), timeout=360))
