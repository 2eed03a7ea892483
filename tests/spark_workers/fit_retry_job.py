"""A spark-submit application for tests/test_fit_retry.py: fits that lose an executor.

    spark-submit --master local-cluster[2,1,1024] fit_retry_job.py REPORT.json WORKDIR KINDS

KINDS: a comma list of torch, keras, lightning. Each estimator fits 4 epochs on 2 ranks; rank 1
kills its own executor JVM at the start of epoch 1 (once). Writes, per kind, the history, the
epochs of the checkpoints left, the seconds the fit took, or the error, to REPORT.json; the
driver's lines (the resets and their causes) go to this process's stdout/stderr.
"""

import json
import os
import sys
import time

import cloudpickle
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fit_retry_fns  # noqa: E402

cloudpickle.register_pickle_by_value(fit_retry_fns)

W = [1.0, -2.0, 0.5, 3.0]


def dataframe(spark):
    from pyspark.ml.linalg import Vectors
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 4)).astype(np.float32)
    y = x @ np.array(W, dtype=np.float32) + 0.25
    return spark.createDataFrame([(Vectors.dense(a.tolist()), float(b)) for a, b in zip(x, y)],
                                 ["features", "label"]).repartition(4)


def estimator(kind, store, marker):
    common = dict(num_proc=2, store=store, feature_cols=["features"], label_cols=["label"],
                  batch_size=16, epochs=4, random_seed=1, verbose=1, partitions_per_process=2,
                  run_id=f"retry_{kind}", validation=0.1)
    if kind == "torch":
        import torch
        from spark_hvd.estimators import TorchEstimator
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Flatten(0))
        return TorchEstimator(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.05),
                              loss=torch.nn.functional.mse_loss,
                              callbacks=[fit_retry_fns.KillExecutorTorch(marker)], **common)
    if kind == "keras":
        import keras
        from spark_hvd.estimators import KerasEstimator
        keras.utils.set_random_seed(0)
        x = keras.Input((4,), name="features")
        model = keras.Model(x, keras.layers.Reshape(())(keras.layers.Dense(1)(x)))
        return KerasEstimator(model=model, optimizer=keras.optimizers.SGD(0.05), loss="mse",
                              callbacks=[fit_retry_fns.keras_killer(
                                  marker, store, common["run_id"])], **common)
    import torch
    from spark_hvd.estimators.lightning import LightningEstimator
    import lightning_fns
    cloudpickle.register_pickle_by_value(lightning_fns)
    torch.manual_seed(0)
    return LightningEstimator(model=lightning_fns.Regressor(lr=0.05),
                              callbacks=[fit_retry_fns.lightning_killer(
                                  marker, store, common["run_id"])], **common)


def main():
    out_path, workdir, kinds = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    from pyspark.sql import SparkSession

    from spark_hvd.estimators import Store
    spark = SparkSession.builder.appName("spark_hvd fit retry test").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    df = dataframe(spark)
    report = {}
    for kind in kinds:
        store = Store.create(os.path.join(workdir, f"store_{kind}"))
        marker = os.path.join(workdir, f"killed_{kind}")
        t0 = time.monotonic()
        entry = report[kind] = {}
        print(f"=== fit {kind}", flush=True)
        try:
            model = estimator(kind, store, marker).fit(df)
            entry["history"] = model.getHistory()
            entry["checkpoints"] = [e for e, _ in store.list_checkpoints(f"retry_{kind}")]
        except Exception as e:  # noqa: BLE001 - reported to the test
            entry["error"] = f"{type(e).__name__}: {e}"
        entry["seconds"] = time.monotonic() - t0
        entry["killed"] = os.path.exists(marker)
        print(f"=== end {kind}", flush=True)
    with open(out_path, "w") as f:
        json.dump(report, f)
    spark.stop()


if __name__ == "__main__":
    main()
