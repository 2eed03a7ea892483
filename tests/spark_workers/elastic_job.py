"""A spark-submit application for the run_elastic tests on multi-executor clusters.

    spark-submit --master MASTER tests/spark_workers/elastic_job.py REPORT.json MODE PID_DIR

MODE ``train``: run_elastic(elastic_train) on 2 processes, min 1 (the test kills an executor
while it trains); ``user_error``: a worker raises; ``both``: one, then the other. Writes
{"results", "error", "seconds", "user_error_seconds"} to REPORT.json; the driver's log and the
workers' output go to this process's stderr/stdout.
"""

import json
import os
import sys
import time

import cloudpickle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic_fns  # noqa: E402

cloudpickle.register_pickle_by_value(elastic_fns)


def main():
    out_path, mode, pid_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    from pyspark.sql import SparkSession

    import spark_hvd.spark
    spark = SparkSession.builder.appName("spark_hvd elastic test").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    report = {"results": None, "error": None}
    if mode in ("train", "both"):
        t0 = time.monotonic()
        report["results"] = spark_hvd.spark.run_elastic(
            elastic_fns.elastic_train, args=(20, 3000, pid_dir, 0.1), num_proc=2,
            min_num_proc=1, start_timeout=180, elastic_timeout=180)
        report["seconds"] = time.monotonic() - t0
    if mode in ("user_error", "both"):
        t0 = time.monotonic()
        try:
            spark_hvd.spark.run_elastic(elastic_fns.raise_on, args=(1, 3), num_proc=2,
                                        min_num_proc=1, start_timeout=180)
        except spark_hvd.spark.RunError as e:
            report["error"] = {"rank": e.rank, "kind": e.kind, "message": str(e),
                               "detail": e.detail}
        report["user_error_seconds"] = time.monotonic() - t0
    with open(out_path, "w") as f:
        json.dump(report, f)
    spark.stop()


if __name__ == "__main__":
    main()
