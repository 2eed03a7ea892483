"""spark_hvd: distributed deep-learning training for data that lives in Apache Spark.

The maintained successor of Horovod: the same script API (``import spark_hvd.torch as hvd``),
a native collective core (TCP and shared memory), the ``spark-hvd-run`` launcher, and Spark
integration. Framework-free collectives on NumPy arrays live in :mod:`spark_hvd.numpy`.
:func:`run` (Horovod's ``horovod.run``) runs a Python function on the ranks of a new job.
"""

__version__ = "0.1.0"

from spark_hvd.runner import run  # noqa: E402 - import-light: the standard library only
