"""Horovod's ``horovod.runner.elastic.discovery``: hosts, discovery and the blacklist."""

from spark_hvd.launch.elastic.hosts import (  # noqa: F401
    DEFAULT_COOLDOWN_LOWER_LIMIT_SECONDS, DEFAULT_COOLDOWN_UPPER_LIMIT_SECONDS, DiscoveredHosts,
    FixedHosts, HostDiscovery, HostDiscoveryScript, HostManager, HostState)
