"""Horovod's ``horovod.runner.gloo_run``, for the one function its elastic tests patch."""


def _get_min_start_hosts(settings):
    """Horovod: how many hosts an elastic job waits for before it starts (2 with elastic
    settings and no NICs given). spark_hvd's driver waits for ``-np`` slots instead, on any
    number of hosts; kept so that code patching it keeps working."""
    return 2 if getattr(settings, "elastic", False) and not getattr(settings, "nics", None) else 1
