"""LightningEstimator → LightningModel end to end on a real local Spark (local[2], 2 ranks): fit,
Lightning callbacks on every rank, checkpoints and logs in the Store, resume by run_id inside a
Pipeline, transform, save/load of the PipelineModel; Horovod's module path with a data_module
class, gradient accumulation, ModelCheckpoint and terminate_on_nan; Param errors; the error
when Lightning is missing; the example."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyspark")
torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

import cloudpickle  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "spark_workers"))
import lightning_fns  # noqa: E402

from spark_hvd.estimators import Store  # noqa: E402
from spark_hvd.estimators.lightning import LightningEstimator, LightningModel  # noqa: E402
from spark_hvd.spark import RunError  # noqa: E402

from conftest import REGRESSION_W as TRUE_W, REPO, job_env  # noqa: E402

cloudpickle.register_pickle_by_value(lightning_fns)
pytestmark = pytest.mark.timeout(400)


def make_estimator(store, **overrides):
    torch.manual_seed(0)
    params = dict(num_proc=2, store=store, model=lightning_fns.Regressor(lr=0.1),
                  feature_cols=["features"], label_cols=["label"], batch_size=16, epochs=2,
                  random_seed=3, verbose=1, partitions_per_process=2)
    params.update(overrides)
    return LightningEstimator(**params)


def epochs_seen(logs, rank, event):
    return [e["epoch"] for e in lightning_fns.read_rank_logs(logs, rank) if e["event"] == event]


def test_fit_callbacks_resume_transform_and_pipeline_save_load(spark, regression_df, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    store = Store.create(str(tmp_path / "store"))
    logs = tmp_path / "callbacks"
    logs.mkdir()
    estimator = make_estimator(store, validation="is_val", run_id="lit_run",
                               callbacks=[lightning_fns.RankRecorder(str(logs))])
    first = estimator.fit(regression_df)
    assert isinstance(first, LightningModel)
    history = first.getHistory()
    assert {"train_loss", "val_loss"} <= set(history)
    assert len(history["train_loss"]) == 2 and len(history["val_loss"]) == 2
    # Lightning's loop and the user's callback ran on both ranks, through our strategy, with
    # the ranks the strategy gives Lightning; gradients were averaged: equal weights.
    weights = []
    for rank in (0, 1):
        seen = lightning_fns.read_rank_logs(str(logs), rank)
        start = seen[0]
        assert start["event"] == "fit_start" and start["strategy"] == "SparkHvdStrategy"
        assert (start["rank"], start["hvd_rank"], start["world"]) == (rank, rank, 2)
        assert epochs_seen(str(logs), rank, "epoch_start") == [0, 1]
        assert "val_loss" in seen[-2]["metrics"]
        weights.append(seen[-1]["weights"])
    assert weights[0] == weights[1]
    np.testing.assert_allclose(weights[0], torch.cat(
        [p.detach().flatten() for p in first.getModel().parameters()]).tolist(), rtol=1e-6)
    # Lightning's checkpoints of every epoch and the TensorBoard logs are in the Store.
    assert [(e, p.rsplit(".", 1)[1]) for e, p in store.list_checkpoints("lit_run")] == \
        [(0, "ckpt"), (1, "ckpt")]
    version_0 = store.join(store.get_logs_path("lit_run"), "lightning_logs", "version_0")
    assert any(n.startswith("events.out.tfevents") for n in store.listdir(version_0))

    # The same run_id, inside a Pipeline, with 4 epochs: resumes after epoch 1.
    for f in logs.iterdir():
        f.unlink()
    estimator.setEpochs(4)
    fitted = Pipeline(stages=[estimator]).fit(regression_df)
    model = fitted.stages[-1]
    for rank in (0, 1):
        assert epochs_seen(str(logs), rank, "epoch_start") == [2, 3]
    history = model.getHistory()
    assert len(history["train_loss"]) == 4 and history["train_loss"][:2] == \
        first.getHistory()["train_loss"]
    assert history["train_loss"][-1] < history["train_loss"][0] * 0.5
    assert [e for e, _ in store.list_checkpoints("lit_run")] == [2, 3]
    assert store.exists(store.join(store.get_logs_path("lit_run"), "lightning_logs",
                                   "version_1"))
    np.testing.assert_allclose(
        model.getModel().fc.weight.detach().numpy().ravel(), TRUE_W, atol=0.3)

    scored = fitted.transform(regression_df).select("features", "label", "label__output") \
        .toPandas()
    x = np.stack(scored["features"].map(lambda v: v.toArray()).to_numpy()).astype(np.float32)
    with torch.no_grad():
        expected = model.getModel()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(scored["label__output"].to_numpy(), expected, rtol=1e-5,
                               atol=1e-5)
    fitted.write().overwrite().save(str(tmp_path / "fitted"))
    store.delete(store.prefix_path)                  # the weights live in the saved model
    reloaded = PipelineModel.load(str(tmp_path / "fitted"))
    assert isinstance(reloaded.stages[-1], LightningModel)
    assert reloaded.stages[-1].getHistory() == history
    again = reloaded.transform(regression_df).select("label__output").toPandas()
    np.testing.assert_array_equal(again["label__output"].to_numpy(),
                                  scored["label__output"].to_numpy())


def test_horovod_path_data_module_accumulation_and_model_checkpoint(spark, regression_df,
                                                                     tmp_path):
    import lightning as L
    import spark_hvd.spark.lightning as hvd_spark
    logs = tmp_path / "callbacks"
    logs.mkdir()
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=str(tmp_path / "best"), monitor="train_loss", mode="min", save_top_k=1)
    estimator = hvd_spark.TorchEstimator(
        num_proc=2, store=Store.create(str(tmp_path / "store")),
        model=lightning_fns.Regressor(lr=0.05), feature_cols=["features"],
        label_cols=["label"], batch_size=16, epochs=3, random_seed=1, verbose=0,
        data_module=lightning_fns.ParquetDataModule, limit_train_batches=6,
        backward_passes_per_step=2, checkpoint_callback=checkpoint,
        callbacks=[lightning_fns.RankRecorder(str(logs))],
        # The data module reads this rank's shards: no DistributedSampler on top.
        trainer_args={"use_distributed_sampler": False})
    assert estimator.getNumGPUs() is None and estimator.getLogEveryNSteps() == 50
    model = estimator.fit(regression_df)
    assert isinstance(model, hvd_spark.TorchModel)
    ends = [lightning_fns.read_rank_logs(str(logs), r)[-1] for r in (0, 1)]
    assert ends[0]["weights"] == ends[1]["weights"]
    # 6 batches per epoch, accumulated by 2: 3 optimizer steps per epoch.
    assert [e["global_step"] for e in ends] == [9, 9]
    best = sorted((tmp_path / "best").glob("*.ckpt"))
    assert len(best) == 1, best
    state = torch.load(best[0], map_location="cpu", weights_only=False)["state_dict"]
    for name, value in model.getModel().state_dict().items():
        torch.testing.assert_close(value, state[name])
    assert len(model.getHistory()["train_loss"]) == 3


def test_lr_monitor_early_stopping_profiler_and_sample_weights(spark, regression_df, tmp_path):
    """Horovod's callback tests that Lightning 2 can run: LearningRateMonitor with an LR
    scheduler, EarlyStopping (its decision reduced over the ranks by the strategy), a
    profiler; plus sample weights in the batch, input_shapes and inmemory_cache_all."""
    import lightning as L
    store = Store.create(str(tmp_path / "store"))
    logs = tmp_path / "callbacks"
    logs.mkdir()
    lr_monitor = L.pytorch.callbacks.LearningRateMonitor(logging_interval="epoch")
    # mode="max" on a falling val_loss: no improvement after the first epoch, so it stops
    # after the second.
    early_stop = L.pytorch.callbacks.EarlyStopping(monitor="val_loss", mode="max", patience=0)
    estimator = make_estimator(
        store, model=lightning_fns.ScheduledWeightedRegressor(lr=0.1), epochs=5,
        validation=0.25, sample_weight_col="weight", input_shapes=[[-1, 4]],
        inmemory_cache_all=True, profiler=L.pytorch.profilers.SimpleProfiler(filename="perf"),
        callbacks=[lr_monitor, early_stop, lightning_fns.RankRecorder(str(logs))])
    model = estimator.fit(regression_df)
    history = model.getHistory()
    assert len(history["val_loss"]) == 2, history
    assert history["lr-SGD"] == pytest.approx([0.1, 0.05])
    for rank in (0, 1):
        assert epochs_seen(str(logs), rank, "epoch_end") == [0, 1]
    # Rank 0's profile, next to the TensorBoard logs in the Store.
    assert "fit-perf-0.txt" in store.listdir(store.get_logs_path(model.getRunId()))


def test_terminate_on_nan_fails_the_fit_naming_the_batch(spark, regression_df, tmp_path):
    estimator = make_estimator(Store.create(str(tmp_path / "store")), epochs=1,
                               model=lightning_fns.NanRegressor(), terminate_on_nan=True,
                               verbose=0)
    with pytest.raises(RunError, match="terminate_on_nan: the training loss is nan at epoch "
                                       "0, batch 2"):
        estimator.fit(regression_df)


def test_param_errors(spark, regression_df, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    model = lightning_fns.Regressor()
    with pytest.raises(ValueError, match="optimizer cannot be set with a LightningModule"):
        make_estimator(store, optimizer=torch.optim.SGD(model.parameters(), lr=1)) \
            .fit(regression_df)
    with pytest.raises(ValueError, match="model must be a LightningModule"):
        make_estimator(store, model=torch.nn.Linear(4, 1)).fit(regression_df)
    with pytest.raises(ValueError, match="num_gpus must be 0 or 1"):
        make_estimator(store, num_gpus=2).fit(regression_df)
    with pytest.raises(ValueError, match=r"trainer_args cannot set \['strategy'\]"):
        make_estimator(store, trainer_args={"strategy": "ddp"}).fit(regression_df)
    with pytest.raises(TypeError, match="unknown parameter"):
        make_estimator(store, no_such_param=1)
    assert not store.exists(store.join(store.prefix_path, "data"))   # nothing was prepared


def test_estimator_save_load_keeps_lightning_params(spark, tmp_path):
    import lightning as L
    estimator = make_estimator(
        Store.create(str(tmp_path / "store")), logger=False, trainer_args={"precision": 32},
        callbacks=[lightning_fns.RankRecorder("/somewhere")], limit_val_batches=0.5,
        checkpoint_callback=L.pytorch.callbacks.ModelCheckpoint(monitor="val_loss"),
        terminate_on_nan=True, num_gpus=0)
    estimator.save(str(tmp_path / "estimator"))
    loaded = LightningEstimator.load(str(tmp_path / "estimator"))
    assert loaded.getTrainerArgs() == {"precision": 32} and loaded.getLogger() is False
    assert loaded.getLimitValBatches() == 0.5 and loaded.getTerminateOnNan() is True
    assert loaded.getNumGPUs() == 0
    assert [type(c).__name__ for c in loaded.getCallbacks()] == ["RankRecorder"]
    assert loaded.getCallbacks()[0].directory == "/somewhere"
    assert loaded.getCheckpointCallback().monitor == "val_loss"
    assert isinstance(loaded.getModel(), lightning_fns.Regressor)
    torch.testing.assert_close(loaded.getModel().state_dict(),
                               estimator.getModel().state_dict())


def test_missing_lightning_is_a_clear_error():
    script = textwrap.dedent("""
        import sys

        class HideLightning:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("lightning", "pytorch_lightning"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, HideLightning())
        from spark_hvd.estimators.lightning import LightningEstimator
        for attempt in (lambda: LightningEstimator(num_proc=2),
                        lambda: __import__("spark_hvd.lightning").lightning.SparkHvdStrategy):
            try:
                attempt()
            except ImportError as error:
                print("ERROR:", error)
            else:
                print("NO ERROR")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=job_env(), cwd=str(REPO), timeout=120)
    assert result.returncode == 0, result.stderr
    errors = result.stdout.splitlines()
    assert len(errors) == 2 and all(e.startswith("ERROR:") for e in errors), result.stdout
    assert "pip install lightning" in errors[0] and "LightningEstimator" in errors[0]
    assert "pip install lightning" in errors[1] and "lightning.pytorch" in errors[1]


def test_example_runs(tmp_path):
    example = REPO / "examples" / "spark" / "lightning_estimator.py"
    result = subprocess.run(
        [sys.executable, str(example), "--rows", "1200", "--epochs", "3",
         "--store", str(tmp_path / "store")],
        capture_output=True, text=True, env=job_env(), cwd=str(tmp_path), timeout=360)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert [l.split(" - ")[0] for l in lines if l.startswith("Epoch ")] == \
        ["Epoch 1/3", "Epoch 2/3", "Epoch 3/3"]
    accuracy = [float(l.split()[-1]) for l in lines if l.startswith("test accuracy:")]
    assert accuracy and accuracy[0] > 0.7, result.stdout[-3000:]
    assert any(l.startswith("reloaded") for l in lines)


def test_strategy_in_a_script_run_by_the_launcher():
    from conftest import run_job
    script = Path(__file__).resolve().parent / "spark_workers" / "lightning_strategy_job.py"
    result = run_job(2, str(script), timeout=300)
    result.assert_ok(2)
