"""The smallest spark_hvd job: every rank contributes its rank, everyone gets the sum.

    spark-hvd-run -np 2 python examples/numpy_allreduce.py
"""
import numpy as np

import spark_hvd.numpy as hvd

hvd.init()
values = np.full(4, hvd.rank() + 1, dtype=np.float32)
total = hvd.allreduce(values, op=hvd.Sum, name="demo")
expected = hvd.size() * (hvd.size() + 1) / 2
assert np.all(total == expected), (total, expected)
gathered = hvd.allgather(np.array([hvd.rank()]), name="ranks")
print(f"rank {hvd.rank()} of {hvd.size()} (local {hvd.local_rank()}/{hvd.local_size()}): "
      f"sum={total.tolist()} ranks={gathered.tolist()} shared_memory={hvd.shared_memory_enabled()}")
hvd.shutdown()
