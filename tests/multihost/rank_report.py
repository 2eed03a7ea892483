"""A rank of the launcher tests on the bed: joins the job, allreduces, and prints one JSON line
of where it ran and what it saw (``REPORT {...}``).

    rank_report.py                 every rank reports and exits 0
    rank_report.py --fail-rank R   rank R reports, then exits with code 3; every other rank
                                   reports and then sleeps, so only the launcher's teardown
                                   ends it
"""

import argparse
import json
import os
import socket
import sys
import time

import numpy as np

import spark_hvd.numpy as hvd

FAIL_CODE = 3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int)
    args = parser.parse_args()
    hvd.init()
    # Each rank contributes rank + 1: the sum is size * (size + 1) / 2 only if every rank's
    # data crossed the wire.
    total = hvd.allreduce(np.full(1024, hvd.rank() + 1, dtype=np.float32), op=hvd.Sum)
    print("REPORT " + json.dumps({
        "rank": hvd.rank(), "size": hvd.size(), "hostname": socket.gethostname(),
        "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
        "sums": sorted(set(total.tolist()))}), flush=True)
    if args.fail_rank is None:
        hvd.shutdown()
        return
    # Past this allreduce every rank has printed its report: the failure below cannot cut
    # another rank's report short.
    hvd.allreduce(np.zeros(1, dtype=np.float32), name="reported")
    if hvd.rank() == args.fail_rank:
        print(f"rank {hvd.rank()} fails on purpose", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(FAIL_CODE)  # no coordinated shutdown: the others are not coming
    time.sleep(600)


if __name__ == "__main__":
    main()
