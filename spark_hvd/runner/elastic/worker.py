"""Horovod's ``horovod.runner.elastic.worker``: what a worker hears from the driver."""

from spark_hvd.common._elastic_protocol import HostUpdateResult  # noqa: F401

HOROVOD_HOSTNAME = "HOROVOD_HOSTNAME"
HOROVOD_LOCAL_RANK = "HOROVOD_LOCAL_RANK"
