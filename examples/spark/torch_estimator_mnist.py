"""Train a PyTorch classifier on a Spark DataFrame with TorchEstimator, inside a Pipeline.

    python examples/spark/torch_estimator_mnist.py                  # local[2], synthetic data
    spark-submit --master local[2] examples/spark/torch_estimator_mnist.py
    python examples/spark/torch_estimator_mnist.py --data mnist_train.csv   # real MNIST (CSV:
                                                     # label,pixel0..pixel783 with a header)

The synthetic data are MNIST-like 8x8 "digits" (a noisy template per class) plus a categorical
"scanner" column. The Pipeline assembles the pixels and the one-hot scanner into one feature
vector, the TorchEstimator trains an MLP on 2 Spark tasks, the fitted PipelineModel is
evaluated with Spark's MulticlassClassificationEvaluator, saved, loaded back and checked to
predict the same. The training history is drawn to a PNG (``--plot``; needs matplotlib), and the
TensorBoard event files every fit writes are under the Store's ``runs/``. With an MLflow run
active or ``MLFLOW_TRACKING_URI`` set, the fit is also logged to MLflow (Params, per-epoch
metrics, the model).
"""

import argparse
import os
import sys
import tempfile

import numpy as np
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import OneHotEncoder, StringIndexer, VectorAssembler
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from spark_hvd.estimators import Store, TorchEstimator


def synthetic_digits(spark, rows, side=8, seed=0):
    """A DataFrame of ``rows`` noisy ``side``x``side`` digit images: px0.. columns, a
    categorical ``scanner`` column and the integer ``label``."""
    rng = np.random.default_rng(seed)
    templates = rng.random((10, side * side)) > 0.6
    labels = rng.integers(0, 10, rows)
    images = templates[labels] * 0.8 + rng.normal(0, 0.9, (rows, side * side))
    scanners = rng.choice(["flatbed", "phone", "fax"], rows)
    names = [f"px{i}" for i in range(side * side)]
    records = [tuple(float(v) for v in image) + (str(s), int(l))
               for image, s, l in zip(images.astype(np.float32), scanners, labels)]
    return spark.createDataFrame(records, names + ["scanner", "label"]), names


def csv_digits(spark, path):
    df = spark.read.csv(path, header=True, inferSchema=True)
    label, *pixels = df.columns
    df = df.withColumnRenamed(label, "label").withColumn("scanner", F.lit("flatbed"))
    return df, pixels


class MLP(torch.nn.Module):
    def __init__(self, inputs, hidden=64, classes=10):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.ReLU(),
                                          torch.nn.Linear(hidden, classes))

    def forward(self, features):
        return self.layers(features)


def accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="MNIST CSV (label,pixel0,...) instead of synthetic")
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--store", help="Store URL (default: a temporary directory)")
    parser.add_argument("--plot", help="where to draw the training history (default: "
                        "history.png in the temporary directory)")
    args = parser.parse_args()

    builder = SparkSession.builder.appName("spark_hvd TorchEstimator example")
    if "PYSPARK_GATEWAY_PORT" not in os.environ:   # plain `python`: no spark-submit master
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        builder = (builder.master(f"local[{args.num_proc}]")
                   .config("spark.driver.host", "127.0.0.1")
                   .config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false"))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    workdir = tempfile.mkdtemp(prefix="spark_hvd_example_")

    df, pixels = csv_digits(spark, args.data) if args.data else synthetic_digits(spark, args.rows)
    train_df, test_df = df.randomSplit([0.8, 0.2], seed=1)

    features = len(pixels) + 2                      # + one-hot scanner (3 values, last dropped)
    model = MLP(features)
    estimator = TorchEstimator(
        num_proc=args.num_proc, store=Store.create(args.store or f"{workdir}/store"),
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=3e-3),
        loss=torch.nn.functional.cross_entropy, metrics=[accuracy],
        feature_cols=["features"], label_cols=["label"], validation=0.1,
        batch_size=64, epochs=args.epochs, random_seed=1, verbose=1)
    pipeline = Pipeline(stages=[
        StringIndexer(inputCol="scanner", outputCol="scanner_index"),
        OneHotEncoder(inputCol="scanner_index", outputCol="scanner_onehot"),
        VectorAssembler(inputCols=pixels + ["scanner_onehot"], outputCol="features"),
        estimator,
    ])
    fitted = pipeline.fit(train_df)
    torch_model = fitted.stages[-1]
    history = torch_model.getHistory()
    print("history:", {k: [round(v, 4) for v in vs] for k, vs in history.items()})
    try:
        plot = torch_model.plot_history(args.plot or f"{workdir}/history.png")
        print(f"history plot: {plot}")
    except ImportError as error:         # matplotlib is optional
        print(f"history plot: skipped ({error})")
    runs = estimator.getStore().get_runs_path()
    print(f"TensorBoard: tensorboard --logdir {runs}   (run {torch_model.getRunId()})")
    if torch_model.getMlflowRunId():
        print(f"MLflow run: {torch_model.getMlflowRunId()}")

    def predictions(pipeline_model):
        scored = pipeline_model.transform(test_df)
        return scored.withColumn("prediction", F.expr(
            "cast(array_position(label__output, array_max(label__output)) - 1 as double)"))

    evaluator = MulticlassClassificationEvaluator(labelCol="label", predictionCol="prediction",
                                                  metricName="accuracy")
    test_accuracy = evaluator.evaluate(predictions(fitted))
    print(f"test accuracy: {test_accuracy:.4f}")

    saved = f"{workdir}/pipeline_model"
    fitted.write().overwrite().save(saved)
    reloaded = PipelineModel.load(saved)
    reloaded_accuracy = evaluator.evaluate(predictions(reloaded))
    print(f"reloaded from {saved}: test accuracy {reloaded_accuracy:.4f}")
    if abs(reloaded_accuracy - test_accuracy) > 1e-9:
        raise SystemExit("the reloaded PipelineModel predicts differently")
    spark.stop()


if __name__ == "__main__":
    main()
