"""What ``run`` needs to know about a SparkSession, for classic and Spark Connect sessions alike.

The barrier stage itself is launched through DataFrame APIs only (``mapInArrow(...,
barrier=True)``), which both kinds of session have. SparkContext (absent under Connect) is used
only for better answers where it exists: the exact number of task slots.
"""

from __future__ import annotations

import contextlib
import os

from spark_hvd.common._network import route_address
from spark_hvd.spark import _placement

TRUE = ("1", "true", "yes", "on")


def active_session(spark=None):
    """``spark``, else the active SparkSession (a Spark Connect one first, then classic)."""
    if spark is not None:
        return spark
    try:
        from pyspark.sql.connect.session import SparkSession as ConnectSession
        session = ConnectSession.getActiveSession()
        if session is not None:
            return session
    except ImportError:  # pyspark without the connect extra
        pass
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise RuntimeError("spark_hvd.spark needs PySpark 4 with PyArrow: "
                           "pip install 'spark-hvd[spark]'") from None
    session = SparkSession.getActiveSession()
    if session is None:
        raise RuntimeError("spark_hvd.spark.run needs a SparkSession: create one first "
                           "(SparkSession.builder...getOrCreate()) or pass spark=")
    return session


def is_connect(spark) -> bool:
    """True for a Spark Connect session (no SparkContext on this side)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


@contextlib.contextmanager
def tagged_jobs(spark, tag: str):
    """Tags the Spark jobs this thread starts inside the block with ``tag``, so that
    :func:`cancel_tagged` cancels them from any thread.

    Classic sessions tag through the SparkContext: a classic ``SparkSession.interruptTag``
    only finds the tags its own thread added (Spark 4.x keeps them per thread), so a watcher
    thread's interrupt cancelled nothing. Spark Connect interrupts by tag on the server,
    whichever thread asks."""
    connect = is_connect(spark)
    if connect:
        spark.addTag(tag)
    else:
        spark.sparkContext.addJobTag(tag)
    try:
        yield
    finally:
        try:
            if connect:
                spark.removeTag(tag)
            else:
                spark.sparkContext.removeJobTag(tag)
        except Exception:  # noqa: BLE001 - a stopped session
            pass


def cancel_tagged(spark, tag: str) -> None:
    """Cancels the running and pending jobs tagged ``tag`` (:func:`tagged_jobs`); any thread.
    Best effort: a stopped session has nothing left to cancel."""
    try:
        if is_connect(spark):
            spark.interruptTag(tag)
        else:
            spark.sparkContext.cancelJobsWithTag(tag)
    except Exception:  # noqa: BLE001 - Py4J, Connect and Spark errors alike
        pass


def conf(spark, key: str, default: str | None = None) -> str | None:
    """A Spark configuration value as the session sees it, ``default`` when unset."""
    try:
        value = spark.conf.get(key, default)
    except Exception:  # noqa: BLE001 - unknown keys, or a session that cannot tell
        return default
    return default if value is None else str(value)


def conf_flag(spark, key: str) -> bool:
    return (conf(spark, key, "false") or "false").strip().lower() in TRUE


def own_conf(spark, key: str) -> str | None:
    """One of spark_hvd's settings ``spark_hvd.<name>``, given in the Spark configuration as
    ``spark.spark_hvd.<name>`` (the form ``spark-submit --conf`` and ``spark-defaults.conf``
    pass on: they drop keys without the ``spark.`` prefix) or as ``spark_hvd.<name>`` (set on
    the session)."""
    return conf(spark, "spark." + key) or conf(spark, key)


def own_flag(spark, key: str) -> bool:
    """:func:`own_conf` read as a flag (``true``, ``1``, ``yes``, ``on``)."""
    return (own_conf(spark, key) or "").strip().lower() in TRUE


def master(spark) -> str:
    if not is_connect(spark):
        return spark.sparkContext.master
    return conf(spark, "spark.master", "") or ""


def task_cpus(spark) -> int:
    try:
        return max(1, int(conf(spark, "spark.task.cpus", "1") or "1"))
    except ValueError:
        return 1


def default_num_proc(spark) -> int:
    """``spark.default.parallelism`` (what Horovod's ``run`` used when num_proc is None)."""
    if not is_connect(spark):
        return int(spark.sparkContext.defaultParallelism)
    value = conf(spark, "spark.default.parallelism")
    if value:
        return int(value)
    slots = _placement.parse_master_slots(master(spark), task_cpus(spark))
    if slots:
        return slots
    raise ValueError("num_proc is not given and this Spark Connect session does not tell "
                     "spark.default.parallelism: pass num_proc=")


# What run_elastic's sizes may come from (see _elastic.elastic_sizes).
DYNAMIC_ALLOCATION_KEYS = ("spark.dynamicAllocation.enabled",
                           "spark.dynamicAllocation.minExecutors",
                           "spark.dynamicAllocation.maxExecutors",
                           "spark.dynamicAllocation.initialExecutors",
                           "spark.executor.instances", "spark.executor.cores", "spark.task.cpus")


def dynamic_allocation_conf(spark) -> dict[str, str]:
    """The Spark configuration values :data:`DYNAMIC_ALLOCATION_KEYS` that are set."""
    return {k: v for k in DYNAMIC_ALLOCATION_KEYS if (v := conf(spark, k)) is not None}


def total_slots(spark) -> int | None:
    """How many tasks the cluster can run at once right now; None when it cannot be told."""
    if not is_connect(spark):
        try:
            jsc = spark.sparkContext._jsc.sc()
            profile = jsc.resourceProfileManager().defaultResourceProfile()
            return int(jsc.maxNumConcurrentTasks(profile))
        except Exception:  # noqa: BLE001 - a Spark without this (private) method
            pass
    return _placement.parse_master_slots(master(spark), task_cpus(spark))


def executor_hosts(spark) -> set[str] | None:
    """The hosts that have a live executor (the driver's too) as Spark sees them now; None
    when the session cannot tell (Spark Connect)."""
    if is_connect(spark):
        return None
    try:
        return {info.host() for info in spark.sparkContext.statusTracker().getExecutorInfos()}
    except Exception:  # noqa: BLE001 - a stopped context, or a Spark without the tracker
        return None


def is_local_master(spark) -> bool:
    """Local masters never gain executors: a slot shortage there is final at once."""
    return master(spark).startswith("local")


def channel_hosts(spark) -> tuple[str, str]:
    """(bind, advertised) address of the driver's channel, reachable from the executors.

    Classic: ``spark.driver.bindAddress`` / ``spark.driver.host``, which Spark's executors
    already use to reach the driver. Connect: our address on the route to the Connect server
    (``SPARK_HVD_SPARK_DRIVER_ADDR`` overrides both).
    """
    override = os.environ.get("SPARK_HVD_SPARK_DRIVER_ADDR")
    if override:
        return override, override
    if not is_connect(spark):
        host = conf(spark, "spark.driver.host") or route_address("8.8.8.8")
        bind = conf(spark, "spark.driver.bindAddress") or host
        return bind, host
    server = "127.0.0.1"
    try:
        server = spark.client._builder.host or server
    except Exception:  # noqa: BLE001 - the client's layout is not a public API
        pass
    host = route_address(server.strip("[]"))
    return host, host


def ssl_enabled(spark) -> bool:
    return conf_flag(spark, "spark.ssl.enabled")
