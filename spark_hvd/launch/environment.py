"""The environment each rank starts with: the launchers' half of the bootstrap contract.

``spark-hvd-run`` and the Spark tasks of ``spark_hvd.spark.run`` build every rank's environment
here, under the names of ``common/_bootstrap_contract``; the rank's ``init()`` reads them.
"""

from __future__ import annotations

from spark_hvd.common import _bootstrap_contract as contract
from spark_hvd.launch.hosts import SlotInfo


def number(x: float) -> str:
    """A number as an environment value: ``30`` rather than ``30.0``."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def rank_env(base: dict[str, str], slot: SlotInfo, *, rendezvous_addr: str, secret_hex: str,
             job_id: str, bind_addr: str, start_timeout: float,
             config: dict[str, str]) -> dict[str, str]:
    """The full environment of one rank: ``base`` (the launcher's), the tuning ``config``, and
    the bootstrap variables."""
    env = {k: v for k, v in base.items()
           if not k.startswith("OMPI_COMM_WORLD_")}  # or the core would think it runs under MPI
    env.update(config)
    env.update({
        contract.RANK: str(slot.rank),
        contract.SIZE: str(slot.size),
        contract.LOCAL_RANK: str(slot.local_rank),
        contract.LOCAL_SIZE: str(slot.local_size),
        contract.CROSS_RANK: str(slot.cross_rank),
        contract.CROSS_SIZE: str(slot.cross_size),
        contract.RENDEZVOUS_ADDR: rendezvous_addr,
        contract.SECRET: secret_hex,
        contract.JOB_ID: job_id,
        contract.HOSTNAME: slot.hostname,
        contract.BIND_ADDR: bind_addr,
        contract.START_TIMEOUT: number(start_timeout),
        "PYTHONUNBUFFERED": "1",
    })
    return env
