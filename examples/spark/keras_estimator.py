"""Train a Keras classifier on a Spark DataFrame with KerasEstimator, inside a Pipeline.

    python examples/spark/keras_estimator.py                        # local[2], synthetic data
    KERAS_BACKEND=jax python examples/spark/keras_estimator.py      # or torch: any backend
    spark-submit --master local[2] examples/spark/keras_estimator.py

The synthetic data are MNIST-like 8x8 "digits" (a noisy template per class) plus a categorical
"scanner" column. The Pipeline assembles the pixels and the one-hot scanner into one feature
vector, the KerasEstimator trains an MLP on 2 Spark tasks, the fitted PipelineModel is
evaluated with Spark's MulticlassClassificationEvaluator, saved, loaded back and checked to
predict the same. The ranks train on the Keras backend this driver runs (KERAS_BACKEND).
"""

import argparse
import os
import sys
import tempfile

import keras
import numpy as np
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import OneHotEncoder, StringIndexer, VectorAssembler
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from spark_hvd.estimators import KerasEstimator, Store


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


def mlp(inputs, hidden=64, classes=10):
    return keras.Sequential([keras.Input((inputs,)),
                             keras.layers.Dense(hidden, activation="relu"),
                             keras.layers.Dense(classes, activation="softmax")])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--store", help="Store URL (default: a temporary directory)")
    args = parser.parse_args()

    builder = SparkSession.builder.appName("spark_hvd KerasEstimator example")
    if "PYSPARK_GATEWAY_PORT" not in os.environ:   # plain `python`: no spark-submit master
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        builder = (builder.master(f"local[{args.num_proc}]")
                   .config("spark.driver.host", "127.0.0.1")
                   .config("spark.ui.enabled", "false"))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    print(f"Keras backend: {keras.backend.backend()}")
    workdir = tempfile.mkdtemp(prefix="spark_hvd_example_")

    df, pixels = synthetic_digits(spark, args.rows)
    train_df, test_df = df.randomSplit([0.8, 0.2], seed=1)

    features = len(pixels) + 2                      # + one-hot scanner (3 values, last dropped)
    keras.utils.set_random_seed(1)
    estimator = KerasEstimator(
        num_proc=args.num_proc, store=Store.create(args.store or f"{workdir}/store"),
        model=mlp(features), optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"],
        feature_cols=["features"], label_cols=["label"], validation=0.1,
        batch_size=64, epochs=args.epochs, random_seed=1, verbose=1)
    pipeline = Pipeline(stages=[
        StringIndexer(inputCol="scanner", outputCol="scanner_index"),
        OneHotEncoder(inputCol="scanner_index", outputCol="scanner_onehot"),
        VectorAssembler(inputCols=pixels + ["scanner_onehot"], outputCol="features"),
        estimator,
    ])
    fitted = pipeline.fit(train_df)
    history = fitted.stages[-1].getHistory()
    print("history:", {k: [round(v, 4) for v in vs] for k, vs in history.items()})

    def predictions(pipeline_model):
        # label__output holds the 10 class probabilities; the prediction is the largest.
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
