"""Launch primitives shared, as peers, by the ``spark-hvd-run`` launcher (``spark_hvd.runner``)
and ``spark_hvd.spark.run`` (``spark_hvd.spark``): neither imports the other's private modules.

- ``hosts``: host lists and hostfiles, host-major rank placement (``SlotInfo``).
- ``environment``: the environment a rank starts with (the bootstrap variables of
  ``common/_bootstrap_contract``).
- ``spawn``: starting a rank in its own process group, locally or over ssh.
- ``supervise``: watching ranks, stopping the whole job when one fails.
- ``output``: forwarding a rank's output line by line with its ``[rank]<stream>:`` prefix.
- ``net``: which hosts are this machine, interface addresses.
- ``function_rank``: the rank process that runs a pickled function (``spark_hvd.run`` and
  ``spark_hvd.spark.run``).

Internal, and import-light like the launcher: the standard library only (no torch,
TensorFlow or native core).
"""
