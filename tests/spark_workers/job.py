"""A spark-submit application for the cluster tests: a job that succeeds, one that fails.

    spark-submit --master MASTER tests/spark_workers/job.py RESULT.json NUM_PROC PID_DIR

Writes {"results": [...], "failure": {...}, "seconds": [...]} to RESULT.json; the ranks'
output goes to this driver's stdout/stderr (the test checks that it arrived from the executors).
"""

import json
import os
import sys
import time

import cloudpickle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fns  # noqa: E402

cloudpickle.register_pickle_by_value(fns)


def main():
    out_path, num_proc, pid_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    from pyspark.sql import SparkSession

    import spark_hvd.spark
    spark = SparkSession.builder.appName("spark_hvd cluster test").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    report = {"seconds": []}
    t0 = time.monotonic()
    report["results"] = spark_hvd.spark.run(fns.rank_info, args=("cluster",), num_proc=num_proc,
                                            start_timeout=120)
    report["seconds"].append(time.monotonic() - t0)
    t0 = time.monotonic()
    try:
        spark_hvd.spark.run(fns.fail_on, args=(num_proc - 1, pid_dir), num_proc=num_proc)
        report["failure"] = None
    except spark_hvd.spark.RunError as e:
        report["failure"] = {"rank": e.rank, "kind": e.kind, "host": e.host, "message": str(e)}
    report["seconds"].append(time.monotonic() - t0)
    with open(out_path, "w") as f:
        json.dump(report, f)
    spark.stop()


if __name__ == "__main__":
    main()
