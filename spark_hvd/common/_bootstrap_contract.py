"""The bootstrap contract: what a launcher hands each rank, and where the ranks meet.

Every way a job starts (``spark-hvd-run``, ``spark_hvd.run``, ``spark_hvd.spark.run`` and the
estimators on top of it) gives each rank the environment variables named here, and every rank's
``init()`` reads them (``common/_bootstrap.py``). The ranks then meet in the launcher's
rendezvous store (``common/_rendezvous.py``) under the keys laid out here:

    scope  <job id>/init.<generation>      one per init() of the job's processes (a re-init
                                           after shutdown() is the next generation)
    key    allgather.<round>/<rank>        one per rank and allgather round within the scope

``init()`` gathers once, in round :data:`INIT_ROUND` of its scope: that is the round a Spark
task relays between executors (``spark/_task.py``). This module is the only place that spells
these names; the launchers that write them and the bootstrap that reads them import it.

Elastic jobs (``SPARK_HVD_ELASTIC=1``) do not gather: the elastic driver assigns every round's
ranks. Each worker talks to it in the scope ``<job id>/elastic`` (see :func:`elastic_scope` and
``common/_elastic_protocol.py``), and the core of round R runs under the job id
``<job id>.r<R>`` (:func:`round_job_id`), so no shared-memory name of a dead round is reused.

Users may set Horovod's name for a variable (``HOROVOD_<name>`` for ``SPARK_HVD_<name>``); ours
wins when both are set. The launcher always sets ours.
"""

from __future__ import annotations

import os

PREFIX = "SPARK_HVD_"
HOROVOD_PREFIX = "HOROVOD_"
# Lookup order of a user-set variable: ours, then Horovod's alias.
ENV_PREFIXES = (PREFIX, HOROVOD_PREFIX)

# -- what the launcher gives every rank ------------------------------------------------------

RANK = "SPARK_HVD_RANK"
SIZE = "SPARK_HVD_SIZE"
LOCAL_RANK = "SPARK_HVD_LOCAL_RANK"
LOCAL_SIZE = "SPARK_HVD_LOCAL_SIZE"
CROSS_RANK = "SPARK_HVD_CROSS_RANK"
CROSS_SIZE = "SPARK_HVD_CROSS_SIZE"
# host:port of the rendezvous store the ranks meet in.
RENDEZVOUS_ADDR = "SPARK_HVD_RENDEZVOUS_ADDR"
# The job secret, hex (see _secret.py); it authenticates every connection of the job.
SECRET = "SPARK_HVD_SECRET"
# The first part of every rendezvous scope of the job.
JOB_ID = "SPARK_HVD_JOB_ID"
# The rank's host identity: ranks with equal values share a host (local ranks, shared memory).
HOSTNAME = "SPARK_HVD_HOSTNAME"
# The address the rank's listeners bind to ("" or 0.0.0.0: every interface).
BIND_ADDR = "SPARK_HVD_BIND_ADDR"
# Seconds the ranks wait for each other at start (rendezvous and the core's connections).
START_TIMEOUT = "SPARK_HVD_START_TIMEOUT"

# The network interface (a name, or a comma list of alternatives) every rank's listener binds
# to and advertises, resolved on the rank's own host; set by --network-interface, by the Spark
# configuration, or by the user (HOROVOD_NETWORK_INTERFACE, and Horovod's per-rank
# HOROVOD_GLOO_IFACE, mean the same). Not a bootstrap variable: unset, ranks choose.
NETWORK_INTERFACE = "SPARK_HVD_NETWORK_INTERFACE"

# -- elastic jobs ---------------------------------------------------------------------------

# "1" in every worker of an elastic job: init() joins the driver's rounds (common/_elastic_agent).
ELASTIC = "SPARK_HVD_ELASTIC"
# The worker's id, unique per spawn: "<host>/<slot>/<spawn seq>".
ELASTIC_WORKER_ID = "SPARK_HVD_ELASTIC_WORKER_ID"
# Seconds the job may spend re-forming (Horovod's HOROVOD_ELASTIC_TIMEOUT, --elastic-timeout).
ELASTIC_TIMEOUT = "SPARK_HVD_ELASTIC_TIMEOUT"
DEFAULT_ELASTIC_TIMEOUT = 600.0
# Seconds after a reset began by which every member must have rejoined; one that has not (it
# ignored the reset's abort) is frozen: stopped, its host blacklisted.
ELASTIC_REJOIN = "SPARK_HVD_ELASTIC_REJOIN_SECONDS"
DEFAULT_ELASTIC_REJOIN = 60.0
# The placement variables that Horovod's elastic workers get (its gloo_context SetEnv names);
# an elastic worker's init() keeps them, and ours, at the current round's values.
HOROVOD_MIRRORS = {RANK: "HOROVOD_RANK", SIZE: "HOROVOD_SIZE", LOCAL_RANK: "HOROVOD_LOCAL_RANK",
                   LOCAL_SIZE: "HOROVOD_LOCAL_SIZE", CROSS_RANK: "HOROVOD_CROSS_RANK",
                   CROSS_SIZE: "HOROVOD_CROSS_SIZE", HOSTNAME: "HOROVOD_HOSTNAME"}

# Set for every rank by the launcher; a value inherited from the launcher's own environment is
# replaced, and spark_hvd.spark.run never forwards the driver's.
BOOTSTRAP_VARS = (RANK, SIZE, LOCAL_RANK, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, RENDEZVOUS_ADDR,
                  SECRET, JOB_ID, HOSTNAME, BIND_ADDR, START_TIMEOUT)

DEFAULT_JOB_ID = "job"
DEFAULT_START_TIMEOUT = 30.0

# -- the rendezvous keys ---------------------------------------------------------------------

# init() gathers every rank's "host port host_id" line once, in the first round of its scope.
INIT_ROUND = 0


def init_scope(job_id: str, generation: int) -> str:
    """The rendezvous scope of the ``generation``-th ``init()`` of job ``job_id``."""
    return f"{job_id}/init.{generation}"


def allgather_key(round_: int, rank: int) -> str:
    """The key of ``rank``'s value in allgather round ``round_`` of a scope."""
    return f"allgather.{round_}/{rank}"


def elastic_scope(job_id: str) -> str:
    """The scope in which an elastic job's workers and its driver talk."""
    return f"{job_id}/elastic"


def round_job_id(job_id: str, round_: int) -> str:
    """The core's job id in round ``round_`` of elastic job ``job_id``."""
    return f"{job_id}.r{round_}"


def elastic_timeout(env=None) -> float:
    """``SPARK_HVD_ELASTIC_TIMEOUT`` (or ``HOROVOD_ELASTIC_TIMEOUT``), else 600 s."""
    return _seconds(ELASTIC_TIMEOUT, DEFAULT_ELASTIC_TIMEOUT, env)


def elastic_rejoin_timeout(env=None) -> float:
    """``SPARK_HVD_ELASTIC_REJOIN_SECONDS``, else 60 s."""
    return _seconds(ELASTIC_REJOIN, DEFAULT_ELASTIC_REJOIN, env)


def _seconds(variable: str, default: float, env=None) -> float:
    value = setting(variable[len(PREFIX):], env)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{set_name(variable[len(PREFIX):], env)}={value!r} is not a positive "
                         "number of seconds")
    return seconds


# -- reading it -----------------------------------------------------------------------------

def setting(name: str, env=None) -> str | None:
    """The value of ``SPARK_HVD_<name>``, else ``HOROVOD_<name>``, in ``env`` (default
    ``os.environ``); None when neither is set to a non-empty value."""
    env = os.environ if env is None else env
    for prefix in ENV_PREFIXES:
        value = env.get(prefix + name)
        if value is not None and value != "":
            return value
    return None


def start_timeout(env=None) -> float:
    """Seconds the ranks wait for each other at start: ``SPARK_HVD_START_TIMEOUT``, else
    ``..._GLOO_TIMEOUT_SECONDS`` (Horovod's bound on Gloo's set-up), each also under its
    ``HOROVOD_`` name, else 30. ``ValueError`` naming the variable when it is not a number."""
    for name in (START_TIMEOUT, "SPARK_HVD_GLOO_TIMEOUT_SECONDS"):
        short = name[len(PREFIX):]
        value = setting(short, env)
        if value is not None:
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{set_name(short, env)}={value!r} is not a number of "
                                 "seconds") from None
    return DEFAULT_START_TIMEOUT


def set_name(name: str, env=None) -> str:
    """The full name under which ``name`` was found (for error messages)."""
    env = os.environ if env is None else env
    return next((p + name for p in ENV_PREFIXES if env.get(p + name)), PREFIX + name)
