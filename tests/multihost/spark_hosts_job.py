"""The driver of test_spark_hosts.py, spark-submit'ed in the root namespace of the bed.

    spark-submit ... spark_hosts_job.py MODE DIR

MODE ``run``: ``spark_hvd.spark.run`` on 4 ranks (where each rank is, an allreduce) and a small
``TorchEstimator.fit``; writes DIR/result.json.

MODE ``lose-run``: 4 ranks allreduce in a loop; once every rank has done one, DIR/ready is
written and the test kills one host; the RunError goes to DIR/result.json (with the time it
was raised).

MODE ``lose-fit``: a slow ``TorchEstimator.fit`` with a fixed ``run_id``; DIR/ready is written
once its first checkpoint exists, the test kills one host; the RunError goes to
DIR/failed.json; once the test brings the host back (DIR/back), the same fit again, which must
resume; DIR/result.json.

MODE ``survive-fit``: the same slow fit with its retries (in memory on ``run_elastic``); the
test kills one host after the first checkpoint; the fit goes on; DIR/result.json.

MODE ``elastic-run``: ``spark.run_elastic`` of NumPy SGD under ``hvd.elastic.run`` with 4 ranks
(min 2); DIR/ready.R once rank R trained 5 steps, then the test kills one host; the results of
the ranks that finish go to DIR/result.json.

MODE ``iface``: ``spark.run`` with ``spark.spark_hvd.networkInterface`` eth0, then mgmt0 (an
interface that does not connect the hosts); DIR/result.json.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np
import torch
from pyspark.sql import SparkSession

import spark_hvd.spark

NUM_PROC = 4
EPOCHS = 5   # of the fit that loses a host


def rank_place():
    """Where this rank runs and an allreduce across all of them."""
    import socket

    import spark_hvd.numpy as hvd
    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="place")
    info = {"rank": hvd.rank(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
            "hostname": socket.gethostname(), "sum": float(total[0]),
            "bind": os.environ.get("SPARK_HVD_BIND_ADDR"),
            "iface": os.environ.get("SPARK_HVD_NETWORK_INTERFACE")}
    hvd.shutdown()
    return info


def allreduce_forever(ready_path):
    """Allreduces until the job is stopped; the first step of every rank marks ``ready``."""
    import spark_hvd.numpy as hvd
    hvd.init()
    step = 0
    while True:
        hvd.allreduce(np.ones(1024, np.float32), op=hvd.Sum, name=f"step{step % 8}")
        if step == 1:
            with open(f"{ready_path}.{hvd.rank()}", "w") as f:
                f.write(str(time.time()))
        step += 1
        time.sleep(0.01)


def elastic_train(ready_path, steps):
    """NumPy SGD under hvd.elastic.run, every step committed; after step 5 each rank marks
    ``ready``. Returns this rank's final weights' digest and the sizes of its committed steps."""
    import hashlib

    import spark_hvd.numpy as hvd
    from spark_hvd.common.elastic import ObjectState, run_fn
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8))
    y = x @ rng.normal(size=8)
    hvd.init()
    state = ObjectState(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, w=np.zeros(8),
                        step=0, sizes=[])

    def train(state):
        while state.step < steps:
            idx = np.random.default_rng(state.step * 1000 + hvd.rank()).integers(0, 512, 16)
            grad = 2 * x[idx].T @ (x[idx] @ state.w - y[idx]) / 16
            state.w = state.w - 0.05 * hvd.allreduce(grad, name="grad", op=hvd.Average)
            state.step += 1
            state.sizes = state.sizes + [hvd.size()]
            if state.step == 5:
                with open(f"{ready_path}.{hvd.rank()}", "w") as f:
                    f.write(str(time.time()))
            time.sleep(0.05)
            state.commit()

    run_fn(train)(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "steps": state.step,
            "sizes": state.sizes, "loss": float(np.mean((x @ state.w - y) ** 2)),
            "hash": hashlib.sha256(np.ascontiguousarray(state.w).tobytes()).hexdigest()[:16]}


class SlowLinear(torch.nn.Module):
    """A linear model whose forward sleeps, so a fit lasts long enough to lose a host in."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        time.sleep(self.seconds)
        return self.linear(x)


class EpochLog:
    """A TorchEstimator callback that appends each epoch rank 0 begins to a file."""

    def __init__(self, path):
        self.path = path

    def on_epoch_begin(self, epoch, *args, **kwargs):
        import spark_hvd.torch as hvd
        if hvd.rank() == 0:
            with open(self.path, "a") as f:
                f.write(f"{epoch}\n")


def regression_df(spark, rows=512):
    from pyspark.ml.linalg import Vectors
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.1
    return spark.createDataFrame([(Vectors.dense(a), float(b)) for a, b in zip(x, y)],
                                 ["features", "label"]).repartition(NUM_PROC)


def estimator(out_dir, epochs, sleep, run_id=None, callbacks=None, **params):
    from spark_hvd.estimators import Store, TorchEstimator
    torch.manual_seed(0)
    model = SlowLinear(sleep)
    return TorchEstimator(
        num_proc=NUM_PROC, store=Store.create(os.path.join(out_dir, "store")), model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.functional.mse_loss, feature_cols=["features"], label_cols=["label"],
        batch_size=16, epochs=epochs, random_seed=7, verbose=1, run_id=run_id,
        callbacks=callbacks or [], **params)


def error_report(e, since=None) -> dict:
    return {"type": type(e).__name__, "message": str(e), "rank": getattr(e, "rank", None),
            "host": getattr(e, "host", None), "kind": getattr(e, "kind", None),
            "lost_ranks": getattr(e, "lost_ranks", None), "time": time.time(),
            "seconds": None if since is None else time.time() - since}


def wait_file(path, timeout):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.2)


def mode_run(spark, out_dir):
    t0 = time.monotonic()
    places = spark_hvd.spark.run(rank_place, num_proc=NUM_PROC, start_timeout=120)
    run_seconds = time.monotonic() - t0
    t0 = time.monotonic()
    model = estimator(out_dir, epochs=2, sleep=0.0).fit(regression_df(spark))
    return {"places": places, "run_seconds": run_seconds,
            "fit_seconds": time.monotonic() - t0, "history": model.getHistory()}


def mode_lose_run(spark, out_dir):
    t0 = time.time()
    try:
        spark_hvd.spark.run(allreduce_forever, args=(os.path.join(out_dir, "ready"),),
                            num_proc=NUM_PROC, start_timeout=120)
        return {"error": None}
    except spark_hvd.spark.RunError as e:
        return {"error": error_report(e), "started": t0}


def mode_elastic_run(spark, out_dir):
    """run_elastic with 4 ranks, min 2: the test kills one host once every rank marked
    ready; training goes on at size 2 and ends."""
    t0 = time.monotonic()
    results = spark_hvd.spark.run_elastic(
        elastic_train, args=(os.path.join(out_dir, "ready"), 300), num_proc=NUM_PROC,
        min_num_proc=2, start_timeout=120, elastic_timeout=120)
    return {"results": results, "seconds": time.monotonic() - t0}


def mode_lose_fit(spark, out_dir):
    run_id = "lost_host_run"
    epochs_log = os.path.join(out_dir, "epochs")
    df = regression_df(spark)
    # No retries: this fit fails (mode survive-fit: one that goes on by itself).
    first = estimator(out_dir, epochs=EPOCHS, sleep=0.1, run_id=run_id,
                      callbacks=[EpochLog(epochs_log + ".1")], max_failures=0)
    store = first.getStore()

    def mark_ready():  # once a checkpoint exists, the test may kill the host
        while not store.list_checkpoints(run_id):
            time.sleep(0.2)
        with open(os.path.join(out_dir, "ready"), "w") as f:
            f.write(str(time.time()))

    threading.Thread(target=mark_ready, daemon=True).start()
    try:
        first.fit(df)
        failure = None
    except spark_hvd.spark.RunError as e:
        failure = error_report(e)
    checkpoints = [epoch for epoch, _ in store.list_checkpoints(run_id)]
    with open(os.path.join(out_dir, "failed.json.tmp"), "w") as f:
        json.dump({"error": failure, "checkpoints": checkpoints}, f)
    # The test reads the file as soon as it exists: it appears whole.
    os.replace(os.path.join(out_dir, "failed.json.tmp"), os.path.join(out_dir, "failed.json"))
    if failure is None:
        return {"error": None}
    wait_file(os.path.join(out_dir, "back"), 120)
    second = estimator(out_dir, epochs=EPOCHS, sleep=0.0, run_id=run_id,
                       callbacks=[EpochLog(epochs_log + ".2")])
    t0 = time.monotonic()
    model = second.fit(df)
    return {"error": failure, "checkpoints_before": checkpoints,
            "history": model.getHistory(), "run_id": model.getRunId(),
            "resumed_fit_seconds": time.monotonic() - t0}


def mode_survive_fit(spark, out_dir):
    """A slow TorchEstimator.fit (in memory, on run_elastic); DIR/ready once its first
    checkpoint exists, then the test kills one host: the fit goes on on the other."""
    run_id = "surviving_run"
    model = estimator(out_dir, epochs=EPOCHS, sleep=0.1, run_id=run_id, min_num_proc=1)
    store = model.getStore()

    def mark_ready():
        while not store.list_checkpoints(run_id):
            time.sleep(0.2)
        with open(os.path.join(out_dir, "ready"), "w") as f:
            f.write(str(time.time()))

    threading.Thread(target=mark_ready, daemon=True).start()
    t0 = time.monotonic()
    fitted = model.fit(regression_df(spark))
    return {"history": fitted.getHistory(), "fit_seconds": time.monotonic() - t0,
            "checkpoints": [epoch for epoch, _ in store.list_checkpoints(run_id)]}


def mode_iface(spark, out_dir):
    """Hosts with two interfaces of which only eth0 connects them: the ranks on eth0 (set on
    the running session), then on mgmt0, whose addresses the other host cannot reach."""
    key = "spark.spark_hvd.networkInterface"
    spark.conf.set(key, "eth0")
    places = spark_hvd.spark.run(rank_place, num_proc=NUM_PROC, start_timeout=120)
    spark.conf.set(key, "mgmt0")
    t0 = time.time()
    try:
        mgmt = {"places": spark_hvd.spark.run(rank_place, num_proc=NUM_PROC,
                                              start_timeout=20)}
    except spark_hvd.spark.RunError as e:
        mgmt = error_report(e, since=t0)
    return {"eth0": places, "mgmt0": mgmt}


def main():
    mode, out_dir = sys.argv[1], sys.argv[2]
    spark = SparkSession.builder.appName(f"spark_hvd multihost {mode}").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    result = {"run": mode_run, "lose-run": mode_lose_run,
              "lose-fit": mode_lose_fit, "elastic-run": mode_elastic_run, "survive-fit": mode_survive_fit,
              "iface": mode_iface}[mode](spark, out_dir)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)
    spark.stop()


if __name__ == "__main__":
    main()
