"""Joins the job that started this process, whichever launcher that was, and checks it.

Prints one line: ``OK rank=R size=S local_rank=L local_size=M cross_rank=C cross_size=D sum=X
ranks=a,b,..`` after an allreduce (sum of rank + 1) and an allgather of the ranks, or
``ERROR <message>`` and exit 3 when ``init`` refuses. Options (argv):

- ``reinit``: shut down and init again (fresh rendezvous keys), and check again.
- ``torch-after``: then ``torch.distributed.init_process_group("gloo")`` from the same
  variables, as a script that uses both would: the store spark_hvd used must not be in the way.
"""
import sys

import numpy as np

import spark_hvd.numpy as hvd


def check():
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(np.array([rank + 1.0]), op=hvd.Sum)[0]
    ranks = hvd.allgather(np.array([rank], dtype=np.int64)).tolist()
    print(f"OK rank={rank} size={size} local_rank={hvd.local_rank()} "
          f"local_size={hvd.local_size()} cross_rank={hvd.cross_rank()} "
          f"cross_size={hvd.cross_size()} sum={total:g} ranks={','.join(map(str, ranks))}",
          flush=True)


try:
    hvd.init()
except RuntimeError as e:
    print(f"ERROR {e}", flush=True)
    sys.exit(3)
check()
if "reinit" in sys.argv:
    hvd.shutdown()
    hvd.init()
    check()
hvd.shutdown()
if "torch-after" in sys.argv:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"TORCH sum={t.item():g}", flush=True)
    dist.destroy_process_group()
