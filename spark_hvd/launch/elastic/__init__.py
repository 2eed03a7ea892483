"""Elastic jobs, shared by ``spark-hvd-run`` and ``spark_hvd.spark.run_elastic``:
the driver's state machine (``driver``), rank planning (``planner``), the failure policy
(``policy``), hosts and their blacklist (``hosts``), and processes as workers (``spawner``).
Standard library only, like the rest of ``launch``.
"""
