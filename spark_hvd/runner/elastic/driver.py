"""Horovod's ``horovod.runner.elastic.driver`` constants: ``spark_hvd.runner.launch.
_run_elastic`` reads them when it starts a job, so tests may patch them as Horovod's do.

``DISCOVER_HOSTS_FREQUENCY_SECS``: seconds between two runs of the discovery (at least 0.1 s is
used). ``ELASTIC_TIMEOUT_SECS``: the elastic timeout when neither ``--elastic-timeout`` nor
``$SPARK_HVD_ELASTIC_TIMEOUT`` / ``$HOROVOD_ELASTIC_TIMEOUT`` is given.
"""

from spark_hvd.launch.elastic.driver import ElasticDriver  # noqa: F401

DISCOVER_HOSTS_FREQUENCY_SECS = 1.0
ELASTIC_TIMEOUT_SECS = 600
