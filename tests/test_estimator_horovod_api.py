"""Horovod's estimator API end to end on a real local Spark (ported from what Horovod's
test_spark_torch.py, test_spark_keras.py and test_spark.py check that applies here):
``util.prepare_data`` preparing once for two estimators, ``fit_on_parquet`` on Parquet that
Spark wrote, with a Store made with Horovod's keywords and a Horovod-style (pandas)
``transformation_fn``, ``TorchModel.getOptimizer()`` / ``getLoss()`` and Horovod's model
keywords, and the Params that act on every rank (``mp_start_method``, ``reader_pool_type``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyspark")
torch = pytest.importorskip("torch")

import cloudpickle  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "spark_workers"))
import estimator_fns  # noqa: E402
import horovod_api_fns  # noqa: E402

from spark_hvd.estimators import LocalStore, Store, TorchEstimator, TorchModel  # noqa: E402
from spark_hvd.spark.common import util  # noqa: E402

from conftest import REGRESSION_W as TRUE_W  # noqa: E402

cloudpickle.register_pickle_by_value(estimator_fns)
cloudpickle.register_pickle_by_value(horovod_api_fns)
pytestmark = pytest.mark.timeout(420)


def torch_estimator(store, optimizer_class=torch.optim.SGD, lr=0.1, **params):
    torch.manual_seed(0)
    model = estimator_fns.Linear()
    defaults = dict(num_proc=2, store=store, model=model,
                    optimizer=optimizer_class(model.parameters(), lr=lr),
                    loss=torch.nn.functional.mse_loss, feature_cols=["features"],
                    label_cols=["label"], batch_size=16, epochs=3, random_seed=7, verbose=0)
    defaults.update(params)
    return TorchEstimator(**defaults)


def weights_and_bias(torch_model):
    fc = torch_model.getModel().fc
    return fc.weight.detach().numpy().ravel(), float(fc.bias.detach())


def test_prepare_data_once_then_fit_two_estimators(spark, regression_df, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    with util.prepare_data(2, store, regression_df, label_columns=["label"],
                           feature_columns=["features"], validation="is_val",
                           partitions_per_process=2) as dataset_idx:
        assert store.is_parquet_dataset(store.get_train_data_path(dataset_idx))
        assert store.is_parquet_dataset(store.get_val_data_path(dataset_idx))
        train_rows, val_rows, metadata, row_size = util.get_dataset_properties(dataset_idx)
        assert (train_rows, val_rows) == (448, 64)      # every 8th row is marked is_val
        assert row_size == 4 * 4 + 8                    # float32[4] features + double label
        prepared = store.listdir(store.prefix_path)
        # Horovod's docs example: fit_on_parquet() inside the block trains on its data.
        sgd = torch_estimator(store, mp_start_method="spawn", reader_pool_type="dummy",
                              callbacks=[horovod_api_fns.StartMethodRecorder(str(tmp_path))])
        first = sgd.fit_on_parquet()
        adam = torch_estimator(store, torch.optim.Adam, lr=0.1, epochs=4)
        second = adam.fit_on_parquet(dataset_idx=dataset_idx)
    assert sorted(prepared) == sorted([f"intermediate_train_data.{dataset_idx}",
                                       f"intermediate_val_data.{dataset_idx}"])
    assert [n for n in store.listdir(store.prefix_path) if n.startswith("intermediate")] == \
        sorted(prepared)                               # the fits prepared nothing more
    for model, epochs in ((first, 3), (second, 4)):
        history = model.getHistory()
        assert len(history["loss"]) == len(history["val_loss"]) == epochs
        assert history["val_loss"][-1] < history["val_loss"][0]
        np.testing.assert_allclose(weights_and_bias(model)[0], TRUE_W, atol=0.3)
    assert first.getRunId() != second.getRunId()
    for rank in (0, 1):       # mp_start_method was set on every rank before training
        assert (tmp_path / f"rank{rank}.txt").read_text() == "spawn"

    # Horovod's TorchModel accessors: the optimizer on the trained model, with its state.
    optimizer = second.getOptimizer()
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.defaults["lr"] == 0.1
    trained = list(second.getModel().parameters())
    assert all(p is q for p, q in zip(optimizer.param_groups[0]["params"], trained))
    steps = 4 * (448 // (16 * 2))                   # epochs * steps per epoch
    assert [float(s["step"]) for s in optimizer.state_dict()["state"].values()] == \
        [steps] * len(trained)
    assert second.getOptimizer() is not optimizer   # a new one per call, as in Horovod
    assert first.getLoss() is torch.nn.functional.mse_loss
    assert first.getLossConstructors() is None

    # Horovod's model keywords build the same Transformer.
    same = TorchModel(model=first.getModel(), feature_columns=["features"],
                      label_columns=["label"], _metadata=first._get_metadata())
    rows = regression_df.limit(40)
    expected = first.transform(rows).select("label__output").toPandas()
    got = same.transform(rows).select("label__output").toPandas()
    np.testing.assert_allclose(got.to_numpy(), expected.to_numpy(), rtol=1e-6)


def test_fit_on_parquet_written_by_spark_with_horovod_transformation(spark, regression_df,
                                                                     tmp_path):
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F
    df = regression_df.select(vector_to_array("features", "float32").alias("x"), "label",
                              "is_val", F.lit("not trained on").alias("name"))
    train_dir, val_dir = str(tmp_path / "train"), str(tmp_path / "val")
    df.filter(~df.is_val).repartition(4).write.parquet(train_dir)
    df.filter(df.is_val).repartition(2).write.parquet(val_dir)
    before = sorted(os.listdir(train_dir))
    # Horovod's docs: a Store whose train_path / val_path hold existing Parquet data.
    store = LocalStore(str(tmp_path / "store"), train_path=train_dir, val_path=val_dir,
                       save_runs=False)
    estimator = torch_estimator(store, feature_cols=["x"], verbose=1,
                                transformation_fn=horovod_api_fns.horovod_style_transform)
    model = estimator.fit_on_parquet()
    # The pandas function ran on every batch: the model learned 2·y = x·(2w) + 0.5.
    weights, bias = weights_and_bias(model)
    np.testing.assert_allclose(weights, 2 * np.array(TRUE_W), atol=0.4)
    assert abs(bias - 0.5) < 0.2
    assert len(model.getHistory()["val_loss"]) == 3
    scored = model.transform(df.limit(50)).toPandas()
    assert np.abs(scored["label__output"] - 2 * scored["label"]).mean() < 0.5
    assert sorted(os.listdir(train_dir)) == before        # the user's data is left alone
    assert not os.path.exists(tmp_path / "store" / "runs")  # save_runs=False: no checkpoints

    # What cannot be trained on is refused on the driver, before any rank starts.
    one_file = str(tmp_path / "one.parquet")
    pq.write_table(pa.table({"x": pa.array([[1.0, 2.0]] * 8, pa.list_(pa.float32())),
                             "label": np.arange(8.0)}), one_file)
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] of num_proc=2 would get no rows"):
        estimator.fit_on_parquet(one_file)
    vectors = str(tmp_path / "vectors")
    regression_df.select("features", "label").write.parquet(vectors)
    with pytest.raises(ValueError, match="column 'features'.*Spark ML vectors"):
        torch_estimator(store).fit_on_parquet(train_data=vectors)
    with pytest.raises(ValueError, match="does not exist"):
        estimator.fit_on_parquet(str(tmp_path / "missing"))


def test_keras_fit_on_parquet_paths(spark, regression_df, tmp_path):
    keras = pytest.importorskip("keras")
    from spark_hvd.estimators import KerasEstimator
    with util.prepare_data(2, Store.create(str(tmp_path / "prep")), regression_df,
                           label_columns=["label"], feature_columns=["features"],
                           validation=0.2) as dataset_idx:
        prep = Store.create(str(tmp_path / "prep"))
        train_dir = prep.get_train_data_path(dataset_idx)
        val_dir = prep.get_val_data_path(dataset_idx)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    estimator = KerasEstimator(
        num_proc=2, store=Store.create(str(tmp_path / "store")), model=model,
        optimizer=keras.optimizers.SGD(0.05), loss="mse", feature_cols=["features"],
        label_cols=["label"], batch_size=16, epochs=3, random_seed=7, verbose=0,
        tensorflow_dataset_prefetch_buffer_size=0, backend_env={"TF_CPP_MIN_LOG_LEVEL": "3"})
    # Horovod's positional form of another data set's directories.
    fitted = estimator.fit_on_parquet(train_dir, val_dir)
    history = fitted.getHistory()
    assert len(history["val_loss"]) == 3 and history["loss"][-1] < history["loss"][0]
    kernel = fitted.getModel().layers[-1].get_weights()[0].ravel()
    np.testing.assert_allclose(kernel, TRUE_W, atol=0.4)
