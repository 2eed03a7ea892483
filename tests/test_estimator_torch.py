"""TorchEstimator → TorchModel end to end on a real local Spark: fit, transform, history,
progress, save/load of Estimator, Model and PipelineModel, Spark Connect, resume after a rank is
killed, reproducibility, and the Param errors."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyspark")
torch = pytest.importorskip("torch")

import cloudpickle  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "spark_workers"))
import estimator_fns  # noqa: E402

from spark_hvd.estimators import Store, TorchEstimator, TorchModel  # noqa: E402
from spark_hvd.estimators._base import SparkBackend  # noqa: E402
from spark_hvd.spark import RunError  # noqa: E402

from conftest import REGRESSION_W as TRUE_W  # noqa: E402

cloudpickle.register_pickle_by_value(estimator_fns)
pytestmark = pytest.mark.timeout(300)

def make_estimator(store, **overrides):
    torch.manual_seed(0)        # the same initial weights for every estimator of these tests
    model = estimator_fns.Linear()
    params = dict(num_proc=2, store=store, model=model,
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  loss=torch.nn.functional.mse_loss, metrics=[estimator_fns.mae],
                  feature_cols=["features"], label_cols=["label"], batch_size=16, epochs=3,
                  random_seed=7, verbose=1, partitions_per_process=2)
    params.update(overrides)
    return TorchEstimator(**params)


def weights(torch_model):
    return np.concatenate([p.detach().numpy().ravel()
                           for p in torch_model.getModel().parameters()])


def test_fit_transform_history_and_progress(spark, regression_df, tmp_path):
    out = io.StringIO()
    store = Store.create(str(tmp_path / "store"))
    estimator = make_estimator(store, validation="is_val",
                               backend=SparkBackend(num_proc=2, stdout=out), num_proc=None)
    model = estimator.fit(regression_df)
    assert isinstance(model, TorchModel)
    history = model.getHistory()
    assert set(history) == {"loss", "mae", "val_loss", "val_mae"}
    assert all(len(v) == 3 for v in history.values())
    assert history["loss"][-1] < history["loss"][0] * 0.5
    learned = weights(model)
    np.testing.assert_allclose(learned[:4], TRUE_W, atol=0.2)
    # One progress line per epoch on the driver.
    lines = [l for l in out.getvalue().splitlines() if l.startswith("Epoch ")]
    assert [l.split(" - ")[0] for l in lines] == ["Epoch 1/3", "Epoch 2/3", "Epoch 3/3"]
    assert "val_loss:" in lines[-1] and "rows/s" in lines[-1]
    # Checkpoints of the run are in the Store.
    assert [e for e, _ in store.list_checkpoints(model.getRunId())][-1] >= 2

    scored = model.transform(regression_df.limit(50)).toPandas()
    assert "label__output" in scored.columns and len(scored) == 50
    x = np.stack(scored["features"].map(lambda v: v.toArray()).to_numpy()).astype(np.float32)
    expected = model.getModel()(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(scored["label__output"].to_numpy(), expected, rtol=1e-5,
                               atol=1e-5)
    assert np.abs(scored["label__output"] - scored["label"]).mean() < 0.3


def test_pipeline_save_load_keeps_params_and_predictions(spark, regression_df, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import StandardScaler
    store = Store.create(str(tmp_path / "store"))
    estimator = make_estimator(store, epochs=2, validation=0.2, sample_weight_col="weight")
    estimator.setFeatureCols(["scaled"])
    pipeline = Pipeline(stages=[StandardScaler(inputCol="features", outputCol="scaled"),
                                estimator])
    pipeline.save(str(tmp_path / "pipeline"))
    loaded_pipeline = Pipeline.load(str(tmp_path / "pipeline"))
    loaded_estimator = loaded_pipeline.getStages()[1]
    assert isinstance(loaded_estimator, TorchEstimator)
    for param in estimator.params:                  # every Param survives save/load
        value = estimator.getOrDefault(param.name)
        loaded = loaded_estimator.getOrDefault(param.name)
        try:
            json.dumps(value)
        except TypeError:                            # objects: same kind, rebuilt from bytes
            assert type(loaded) is type(value), param.name
            if isinstance(value, list):
                assert [getattr(v, "__name__", type(v)) for v in loaded] == \
                    [getattr(v, "__name__", type(v)) for v in value], param.name
        else:
            assert loaded == value, param.name
    assert loaded_estimator.getStore().prefix_path == store.prefix_path
    assert isinstance(loaded_estimator.getModel(), estimator_fns.Linear)

    fitted = pipeline.fit(regression_df)
    before = fitted.transform(regression_df).select("label__output").toPandas()
    fitted.write().overwrite().save(str(tmp_path / "fitted"))
    # The weights live in the saved directory: deleting the Store loses nothing.
    store.delete(store.prefix_path)
    reloaded = PipelineModel.load(str(tmp_path / "fitted"))
    torch_model = reloaded.stages[-1]
    assert isinstance(torch_model, TorchModel)
    assert torch_model.getHistory() == fitted.stages[-1].getHistory()
    assert torch_model.getRunId() == fitted.stages[-1].getRunId()
    after = reloaded.transform(regression_df).select("label__output").toPandas()
    np.testing.assert_array_equal(before.to_numpy(), after.to_numpy())
    np.testing.assert_array_equal(weights(torch_model), weights(fitted.stages[-1]))


def test_same_seed_same_weights_and_lr_scaling(spark, regression_df, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    first = make_estimator(store, epochs=1).fit(regression_df)
    # reuses the shards too; through a backend with Horovod's interface, which only has
    # num_processes() and run(fn, args, kwargs, env)
    calls = []

    class HorovodStyleBackend:
        def num_processes(self):
            return 2

        def run(self, fn, args=(), kwargs={}, env=None):
            import spark_hvd.spark
            calls.append(sorted(env or {}))
            return spark_hvd.spark.run(fn, args=args, kwargs=kwargs, num_proc=2, env=env)

    second = make_estimator(store, epochs=1, num_proc=None, backend=HorovodStyleBackend(),
                            env={"HVD_STYLE_BACKEND": "1"}).fit(regression_df)
    assert calls == [["HVD_STYLE_BACKEND"]]
    assert first.getRunId() != second.getRunId()
    np.testing.assert_array_equal(weights(first), weights(second))
    scaled = make_estimator(store, epochs=1, scale_learning_rate=True).fit(regression_df)
    assert not np.array_equal(weights(scaled), weights(first))


def test_resume_after_a_rank_is_killed(spark, regression_df, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    steps = 4
    estimator = make_estimator(
        store, epochs=4, run_id="resumable", train_steps_per_epoch=steps,
        env={"TEST_STEPS_PER_EPOCH": str(steps)},
        train_minibatch_fn=estimator_fns.killing_minibatch(str(tmp_path), kill_epoch=2),
        max_failures=0)   # no retry: the fit fails (tests/test_fit_retry.py: it goes on)
    with pytest.raises(RunError):
        estimator.fit(regression_df)
    saved = store.list_checkpoints("resumable")
    assert [e for e, _ in saved] == [0, 1]          # epoch 2 never finished
    for _, path in saved:                            # and every checkpoint loads
        state = torch.load(io.BytesIO(store.read_bytes(path)), weights_only=False)
        assert set(state) >= {"epoch", "model", "optimizer", "history"}
    assert not [n for n in store.listdir(store.get_checkpoint_path("resumable"))
                if not n.startswith("epoch-")]      # no temporary leftovers
    model = estimator.fit(regression_df)            # same run_id: resumes at epoch 2
    history = model.getHistory()
    assert len(history["loss"]) == 4
    assert [e for e, _ in store.list_checkpoints("resumable")][-1] == 3


def test_two_inputs_two_outputs_and_output_cols(spark, tmp_path, two_inputs_df):
    df = two_inputs_df
    model = estimator_fns.TwoInputs()
    logs = tmp_path / "callbacks"
    logs.mkdir()
    estimator = TorchEstimator(callbacks=[estimator_fns.RecordingCallback(str(logs))],
        num_proc=2, store=Store.create(str(tmp_path / "store")), model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.05),
        loss=[torch.nn.functional.mse_loss, torch.nn.functional.mse_loss],
        loss_weights=[1.0, 0.5], feature_cols=["vec", "grid"], label_cols=["y1", "y2"],
        input_shapes=[[-1, 4], [-1, 2, 3]], batch_size=16, epochs=2, random_seed=1,
        verbose=0)
    fitted = estimator.fit(df)
    fitted.setOutputCols(["p1", "p2"])
    scored = fitted.transform(df).select("y1", "y2", "p1", "p2").toPandas()
    assert list(scored.columns) == ["y1", "y2", "p1", "p2"] and len(scored) == 256
    assert scored["p1"].dtype == np.float64
    for rank in (0, 1):
        seen = (logs / f"rank{rank}.log").read_text().splitlines()
        assert seen[0].startswith("train_begin TwoInputs ") and seen[-1] == "train_end"
        assert seen[1:-1] == ["epoch_begin 0", "epoch_end 0 ['loss']", "epoch_begin 1",
                              "epoch_end 1 ['loss']"]


def test_connect_session_fit_and_transform(connect, regression_df, tmp_path):
    regression_df.write.parquet(str(tmp_path / "data.parquet"))
    df = connect.read.parquet(str(tmp_path / "data.parquet"))
    estimator = make_estimator(Store.create(str(tmp_path / "store")), epochs=1, verbose=0)
    model = estimator.fit(df)
    scored = model.transform(df.limit(10)).toPandas()
    assert len(scored) == 10 and "label__output" in scored.columns
    # Persistence goes through the Connect session too.
    path = str(tmp_path / "model")
    model.write().session(connect).save(path)
    loaded = TorchModel.read().session(connect).load(path)
    again = loaded.transform(df.limit(10)).toPandas()
    np.testing.assert_array_equal(scored["label__output"], again["label__output"])


def test_param_errors(spark, regression_df, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    with pytest.raises(ValueError, match="store is not set"):
        make_estimator(None).fit(regression_df)
    with pytest.raises(ValueError, match="num_proc or backend"):
        make_estimator(store, backend=SparkBackend(num_proc=2)).fit(regression_df)
    with pytest.raises(ValueError, match="exactly one of loss and loss_constructors"):
        make_estimator(store, loss_constructors=[lambda: torch.nn.MSELoss()]).fit(regression_df)
    with pytest.raises(ValueError, match="model must be a torch.nn.Module"):
        make_estimator(store, model="not a model").fit(regression_df)
    with pytest.raises(TypeError, match="unknown parameter"):
        TorchEstimator(num_procs=2)
    with pytest.raises(ValueError, match="'nope'"):
        make_estimator(store, feature_cols=["nope"]).fit(regression_df)
