"""Train a PyTorch Lightning classifier on a Spark DataFrame with LightningEstimator, inside a
Pipeline.

    python examples/spark/lightning_estimator.py                  # local[2], synthetic data
    spark-submit --master local[2] examples/spark/lightning_estimator.py

The synthetic data are readings of 16 noisy sensors in one of 10 machine states. The Pipeline
assembles the readings into one feature vector; the LightningEstimator trains a LightningModule
on 2 Spark tasks, each running a Lightning Trainer (its loop, callbacks and logger) over
spark_hvd; the fitted PipelineModel is scored on held-out rows, saved, loaded back and checked
to predict the same. TensorBoard logs of the run are in the Store:
``tensorboard --logdir <store>/runs``.
"""

import argparse
import os
import sys
import tempfile

import lightning as L
import numpy as np
import pandas as pd
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.feature import VectorAssembler
from pyspark.sql import SparkSession

from spark_hvd.estimators import Store
from spark_hvd.estimators.lightning import LightningEstimator


def sensor_readings(spark, rows, sensors=16, seed=0):
    """A DataFrame of ``rows`` readings of ``sensors`` noisy sensors (s0.. columns) taken in one
    of 10 machine states (the integer ``label``), each state with its own mean reading."""
    rng = np.random.default_rng(seed)
    state_means = rng.normal(0, 1.2, (10, sensors))
    labels = rng.integers(0, 10, rows)
    readings = state_means[labels] + rng.normal(0, 1.0, (rows, sensors))
    frame = pd.DataFrame(readings.astype(np.float32), columns=[f"s{i}" for i in range(sensors)])
    frame["label"] = labels
    return spark.createDataFrame(frame), list(frame.columns[:-1])


class StateClassifier(L.LightningModule):
    """An MLP; batches arrive as {"features": tensor, "label": tensor}."""

    def __init__(self, inputs, hidden=64, classes=10, lr=1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.layers = torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.ReLU(),
                                          torch.nn.Linear(hidden, classes))

    def forward(self, features):
        return self.layers(features)

    def _step(self, batch, prefix):
        logits = self(batch["features"])
        loss = torch.nn.functional.cross_entropy(logits, batch["label"])
        accuracy = (logits.argmax(dim=1) == batch["label"]).float().mean()
        self.log(f"{prefix}loss", loss, on_step=False, on_epoch=True)
        self.log(f"{prefix}accuracy", accuracy, on_step=False, on_epoch=True)
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val_")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def spark_session(num_proc):
    """spark-submit's session, or with plain ``python`` a local[num_proc] one."""
    builder = SparkSession.builder.appName("spark_hvd LightningEstimator example")
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        settings = {"spark.driver.host": "127.0.0.1", "spark.ui.enabled": "false",
                    "spark.ui.showConsoleProgress": "false"}
        builder = builder.master(f"local[{num_proc}]").config(map=settings)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("--rows", 4000), ("--epochs", 4), ("--num-proc", 2)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--store", help="Store URL (default: a temporary directory)")
    args = parser.parse_args()
    spark = spark_session(args.num_proc)
    workdir = tempfile.mkdtemp(prefix="spark_hvd_example_")

    df, sensors = sensor_readings(spark, args.rows)
    train_df, test_df = df.randomSplit([0.8, 0.2], seed=1)

    store = Store.create(args.store or f"{workdir}/store")
    estimator = LightningEstimator(
        num_proc=args.num_proc, store=store, model=StateClassifier(len(sensors)),
        feature_cols=["features"], label_cols=["label"], validation=0.1, batch_size=64,
        epochs=args.epochs, random_seed=1, verbose=1)
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=sensors, outputCol="features"),
                                estimator])
    fitted = pipeline.fit(train_df)
    lightning_model = fitted.stages[-1]
    history = lightning_model.getHistory()
    print("history:", {k: [round(v, 4) for v in vs] for k, vs in history.items()})
    print(f"TensorBoard logs: {store.get_logs_path(lightning_model.getRunId())}")

    def predicted_states(pipeline_model):
        scored = pipeline_model.transform(test_df).select("label", "label__output").toPandas()
        return scored["label"].to_numpy(), np.stack(scored["label__output"]).argmax(axis=1)

    labels, predicted = predicted_states(fitted)
    print(f"test accuracy: {np.mean(predicted == labels):.4f}")

    saved = f"{workdir}/pipeline_model"
    fitted.write().overwrite().save(saved)
    _, predicted_again = predicted_states(PipelineModel.load(saved))
    print(f"reloaded from {saved}: {np.sum(predicted_again == predicted)} of {len(predicted)} "
          f"predictions unchanged")
    if not np.array_equal(predicted_again, predicted):
        raise SystemExit("the reloaded PipelineModel predicts differently")
    spark.stop()


if __name__ == "__main__":
    main()
