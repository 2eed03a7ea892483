"""Which launcher started this process: the one module that reads launchers' variables.

``init()`` must join the job the process belongs to, whoever started it, and never mistake a
rank of a larger job for a job of size 1. Each launcher announces itself through environment
variables; :func:`identify` reads them in this order of precedence:

1. ``SPARK_HVD_*``: spark-hvd-run or ``spark_hvd.spark.run`` (joined by the bootstrap itself).
2. ``OMPI_COMM_WORLD_*``: Open MPI's ``mpirun`` (joined through mpi4py by the bootstrap).
3. ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``: ``torchrun``, or torch's
   ``env://`` convention; joined through a ``torch.distributed.TCPStore``.
4. ``PMI_*``: MPICH's or Intel MPI's ``mpiexec`` (Hydra), ``srun --mpi=pmi2``; joined through
   the PMI-1 protocol on ``PMI_FD`` or ``PMI_PORT``.
5. ``HOROVOD_RANK``/``HOROVOD_SIZE``: ``horovodrun`` (Gloo mode); joined through its HTTP
   rendezvous at ``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``_PORT``.
6. ``SLURM_*``: a Slurm task. Slurm is the allocation the launchers above run inside, so its
   variables count only when none of theirs is present; joined through a TCPStore when
   ``MASTER_ADDR``/``MASTER_PORT`` are exported, otherwise an error saying how to start.

Two launchers that disagree on the job size, or one that says size > 1 but gives no way to
reach the other ranks, are a ``RuntimeError`` naming the variables seen and the fix; every rank
sees the same variables, so every rank raises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from . import _bootstrap_contract as contract

# -- the variables, by launcher -----------------------------------------------------------------

# spark-hvd-run and spark_hvd.spark: contract.RANK and contract.SIZE (_bootstrap_contract).

# Open MPI's mpirun.
OMPI_RANK, OMPI_SIZE = "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"

# torchrun (torch.distributed.run) and torch.distributed's env:// convention.
TORCH_RANK, TORCH_SIZE = "RANK", "WORLD_SIZE"
TORCH_LOCAL_RANK, TORCH_LOCAL_SIZE = "LOCAL_RANK", "LOCAL_WORLD_SIZE"
TORCH_GROUP_RANK, TORCH_GROUP_SIZE = "GROUP_RANK", "GROUP_WORLD_SIZE"
MASTER_ADDR, MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
# "True" when torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT; otherwise rank 0
# is expected to host it (what init_process_group(init_method="env://") does).
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"

# The PMI-1 process-manager interface: MPICH / Intel MPI's Hydra, Slurm's pmi2 plugin.
PMI_RANK, PMI_SIZE = "PMI_RANK", "PMI_SIZE"
PMI_FD, PMI_PORT, PMI_ID = "PMI_FD", "PMI_PORT", "PMI_ID"
MPI_LOCALRANKID, MPI_LOCALNRANKS = "MPI_LOCALRANKID", "MPI_LOCALNRANKS"

# horovodrun (Gloo mode).
HOROVOD_RANK, HOROVOD_SIZE = "HOROVOD_RANK", "HOROVOD_SIZE"
HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE = "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"
HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE = "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE"
HOROVOD_RENDEZVOUS_ADDR = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
HOROVOD_RENDEZVOUS_PORT = "HOROVOD_GLOO_RENDEZVOUS_PORT"
HOROVOD_ELASTIC = "HOROVOD_ELASTIC"

# Slurm. A srun step's tasks get SLURM_STEP_NUM_TASKS; SLURM_NTASKS (or the older
# SLURM_NPROCS) is what sbatch's script sees, the allocation's task count.
SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID = "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"
SLURM_SIZES = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
SLURM_JOB_ID, SLURM_STEP_ID = "SLURM_JOB_ID", "SLURM_STEP_ID"

# Names the bootstrap compares against to pick its own join paths.
SPARK_HVD_RUN = "spark-hvd-run"
OPEN_MPI = "Open MPI's mpirun"

_OTHER_LAUNCHERS_HINT = ("spark-hvd-run -np N ..., Open MPI's mpirun, torchrun, MPICH's "
                         "mpiexec or srun --mpi=pmi2")


@dataclass
class Launch:
    """What one launcher's variables say about this process.

    ``connect(generation, timeout)`` returns the :class:`~._rendezvous.Rendezvous` to the other
    ranks (with ``rank``, ``size`` and ``route_host``); it is None for the two launchers the
    bootstrap joins itself. ``cannot_join`` says why no rendezvous is reachable, fix included.
    """

    launcher: str
    seen: dict[str, str]
    rank: int | None
    size: int | None  # None: learnt only on connecting (PMI over PMI_PORT)
    local_rank: int | None = None
    local_size: int | None = None
    cross_rank: int | None = None
    cross_size: int | None = None
    connect: Callable | None = field(default=None, repr=False)
    cannot_join: str | None = None

    def describe(self) -> str:
        """The launcher and the variables that named it, e.g. ``torchrun (RANK=1, ...)``."""
        return f"{self.launcher} ({', '.join(f'{k}={v}' for k, v in self.seen.items())})"


def _seen(env, names) -> dict[str, str]:
    return {n: env[n] for n in names if n in env}


def _int(env, name, launch_name) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"{name}={value!r} (set by {launch_name}) is not an integer") from None


def _port(env, name, who) -> int:
    port = _int(env, name, who)
    if port is None or not 0 < port < 65536:
        raise RuntimeError(f"{name}={env.get(name)!r} (from {who}) is not a TCP port")
    return port


def _spark_hvd(env) -> Launch | None:
    if contract.RANK not in env:
        return None
    return Launch(SPARK_HVD_RUN, _seen(env, (contract.RANK, contract.SIZE)),
                  _int(env, contract.RANK, SPARK_HVD_RUN), _int(env, contract.SIZE, SPARK_HVD_RUN))


def _open_mpi(env) -> Launch | None:
    if OMPI_RANK not in env:
        return None
    return Launch(OPEN_MPI, _seen(env, (OMPI_RANK, OMPI_SIZE)), _int(env, OMPI_RANK, OPEN_MPI),
                  _int(env, OMPI_SIZE, OPEN_MPI))


def _torch_store_connect(env, who, rank, size, prefix, is_master):
    """A ``connect`` that meets the other ranks in the TCPStore at MASTER_ADDR:MASTER_PORT."""
    host, port = env[MASTER_ADDR], _port(env, MASTER_PORT, who)

    def connect(generation, timeout):
        from ._launcher_channels import TorchStoreRendezvous
        return TorchStoreRendezvous(host, port, rank, size, f"{prefix}/{generation}/",
                                    is_master, timeout, who)
    return connect


def _torch(env) -> Launch | None:
    if TORCH_SIZE not in env and TORCH_RANK not in env:
        return None
    names = (TORCH_RANK, TORCH_SIZE, TORCH_LOCAL_RANK, TORCH_LOCAL_SIZE, TORCH_GROUP_RANK,
             MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID)
    who = "torchrun" if TORCHELASTIC_RUN_ID in env else "torch.distributed's env:// variables"
    launch = Launch(who, _seen(env, names), _int(env, TORCH_RANK, who),
                    _int(env, TORCH_SIZE, who), _int(env, TORCH_LOCAL_RANK, who),
                    _int(env, TORCH_LOCAL_SIZE, who), _int(env, TORCH_GROUP_RANK, who),
                    _int(env, TORCH_GROUP_SIZE, who))
    if launch.rank is None or launch.size is None:
        launch.cannot_join = (f"{launch.describe()}: {TORCH_RANK} and {TORCH_SIZE} must both be "
                              "set; start the job with torchrun or set both")
    elif not env.get(MASTER_ADDR) or not env.get(MASTER_PORT):
        launch.cannot_join = (
            f"{launch.describe()} says this is rank {launch.rank} of {launch.size}, but "
            f"{MASTER_ADDR} and {MASTER_PORT} are not both set, so the other ranks cannot be "
            f"found: start the job with torchrun, or export {MASTER_ADDR} (rank 0's host) and "
            f"{MASTER_PORT} (a free port there) for every rank, or use spark-hvd-run")
    else:
        agent_store = env.get(TORCHELASTIC_USE_AGENT_STORE, "").lower() == "true"
        # One prefix per torchrun job and restart: the agent's store outlives its workers.
        prefix = (f"spark_hvd/{env.get(TORCHELASTIC_RUN_ID, 'env')}/"
                  f"{env.get(TORCHELASTIC_RESTART_COUNT, '0')}")
        launch.connect = _torch_store_connect(env, who, launch.rank, launch.size, prefix,
                                              is_master=not agent_store and launch.rank == 0)
    return launch


def _pmi(env) -> Launch | None:
    if not any(n in env for n in (PMI_RANK, PMI_SIZE, PMI_FD, PMI_PORT)):
        return None
    who = "MPICH / Intel MPI mpiexec or srun --mpi=pmi2"
    launch = Launch(who, _seen(env, (PMI_RANK, PMI_SIZE, PMI_FD, PMI_PORT, PMI_ID)),
                    _int(env, PMI_RANK, who), _int(env, PMI_SIZE, who),
                    _int(env, MPI_LOCALRANKID, who), _int(env, MPI_LOCALNRANKS, who))
    fd_value, port = env.get(PMI_FD), env.get(PMI_PORT)
    if not fd_value and not port:
        launch.cannot_join = (
            f"{launch.describe()} says this is rank {launch.rank} of {launch.size}, but neither "
            f"{PMI_FD} nor {PMI_PORT} is set, so spark_hvd cannot reach the process manager to "
            "find the other ranks: start the job directly with mpiexec (Hydra) or srun "
            "--mpi=pmi2 (no wrapper that drops PMI_FD/PMI_PORT), or with spark-hvd-run")
        return launch
    pmi_id = env.get(PMI_ID)

    def connect(generation, timeout):
        from ._launcher_channels import PmiRendezvous, pmi_connection, pmi_fd_from_env
        conn = pmi_connection(pmi_fd_from_env(fd_value) if fd_value else None, port, pmi_id,
                              who, timeout)
        rank = launch.rank if conn.rank is None else conn.rank
        size = launch.size if conn.size is None else conn.size
        if rank is None or size is None:
            raise RuntimeError(f"{launch.describe()}: the process manager did not say which "
                               f"rank this is ({PMI_RANK}/{PMI_SIZE} unset)")
        route = port.rpartition(":")[0] if port else None
        return PmiRendezvous(conn, rank, size, generation, route_host=route)
    launch.connect = connect
    return launch


def _horovod(env) -> Launch | None:
    if HOROVOD_RANK not in env and HOROVOD_SIZE not in env:
        return None
    who = "horovodrun"
    names = (HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE,
             HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE, HOROVOD_RENDEZVOUS_ADDR,
             HOROVOD_RENDEZVOUS_PORT)
    launch = Launch(who, _seen(env, names), _int(env, HOROVOD_RANK, who),
                    _int(env, HOROVOD_SIZE, who), _int(env, HOROVOD_LOCAL_RANK, who),
                    _int(env, HOROVOD_LOCAL_SIZE, who), _int(env, HOROVOD_CROSS_RANK, who),
                    _int(env, HOROVOD_CROSS_SIZE, who))
    addr = env.get(HOROVOD_RENDEZVOUS_ADDR)
    if launch.rank is None or launch.size is None:
        launch.cannot_join = (f"{launch.describe()}: {HOROVOD_RANK} and {HOROVOD_SIZE} must "
                              "both be set; start the job with horovodrun or spark-hvd-run")
    elif env.get(HOROVOD_ELASTIC, "0") not in ("", "0"):
        launch.cannot_join = (f"{launch.describe()} with {HOROVOD_ELASTIC}=1: elastic Horovod "
                              "jobs cannot be joined by spark_hvd; run without --elastic or "
                              "use spark-hvd-run")
    elif not addr or not env.get(HOROVOD_RENDEZVOUS_PORT):
        launch.cannot_join = (
            f"{launch.describe()} says this is rank {launch.rank} of {launch.size}, but "
            f"{HOROVOD_RENDEZVOUS_ADDR} and {HOROVOD_RENDEZVOUS_PORT} are not both set, so the "
            "other ranks cannot be found: start the job with horovodrun (Gloo mode, the "
            "default), with mpirun, or with spark-hvd-run")
    else:
        port, rank, size = _port(env, HOROVOD_RENDEZVOUS_PORT, who), launch.rank, launch.size

        def connect(generation, timeout):
            from ._launcher_channels import HorovodHttpRendezvous
            return HorovodHttpRendezvous(addr, port, rank, size, f"spark_hvd.{generation}",
                                         timeout, who)
        launch.connect = connect
    return launch


def _slurm(env) -> Launch | None:
    size_name = next((n for n in SLURM_SIZES if env.get(n)), None)
    if SLURM_PROCID not in env or size_name is None:
        return None
    who = "Slurm"
    seen_names = (SLURM_PROCID, size_name, SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_ID,
                  MASTER_ADDR, MASTER_PORT)
    # Local and cross ranks come from the hosts the ranks report (SLURM_LOCALID alone gives
    # no local size).
    launch = Launch(who, _seen(env, seen_names), _int(env, SLURM_PROCID, who),
                    _int(env, size_name, who))
    if env.get(MASTER_ADDR) and env.get(MASTER_PORT):
        prefix = f"spark_hvd/slurm.{env.get(SLURM_JOB_ID, '')}.{env.get(SLURM_STEP_ID, '')}"
        launch.connect = _torch_store_connect(env, who, launch.rank, launch.size, prefix,
                                              is_master=launch.rank == 0)
        return launch
    step = ("" if SLURM_STEP_ID in env else
            " (no SLURM_STEP_ID: this looks like the batch script itself, a single process)")
    launch.cannot_join = (
        f"{launch.describe()} says this is task {launch.rank} of {launch.size}{step}, but "
        "Slurm gave no way to reach the other tasks. Start the job with one of: "
        "srun --mpi=pmi2 ... (spark_hvd joins through PMI); srun ... with MASTER_ADDR (the "
        "first node's address) and MASTER_PORT (a free port there) exported (joined through a "
        "torch TCPStore that task 0 hosts); mpirun or spark-hvd-run -np N inside the "
        f"allocation. To run one process alone, start it with srun -n 1 or unset {size_name}")
    return launch


# Launchers in precedence order; Slurm comes after them all (see the module docstring).
_LAUNCHERS = (_spark_hvd, _open_mpi, _torch, _pmi, _horovod)


def identify(env=None) -> Launch | None:
    """The launcher that started this process, or None for a process started on its own.

    Raises ``RuntimeError`` when launchers' variables disagree on the job size, or when the
    chosen launcher says size > 1 but gives no way to reach the other ranks.
    """
    env = os.environ if env is None else env
    found = [launch for launch in (detect(env) for detect in _LAUNCHERS) if launch]
    if not found:
        slurm = _slurm(env)
        found = [slurm] if slurm else []
    if not found:
        return None
    chosen = found[0]
    for other in found[1:]:
        if None not in (chosen.size, other.size) and chosen.size != other.size:
            raise RuntimeError(
                f"spark_hvd.init: launchers disagree about the job size: {chosen.describe()} "
                f"says {chosen.size} but {other.describe()} says {other.size}. One set of "
                "variables was probably inherited from an enclosing job: start this process "
                "with one launcher, or unset the other's variables")
    if chosen.cannot_join and (chosen.size is None or chosen.size > 1):
        raise RuntimeError(f"spark_hvd.init: {chosen.cannot_join}")
    if chosen.size is not None and chosen.rank is not None and not (
            0 <= chosen.rank < chosen.size):
        raise RuntimeError(f"spark_hvd.init: {chosen.describe()}: rank {chosen.rank} is not in "
                           f"[0, {chosen.size})")
    if chosen.size is not None and chosen.size < 1:
        raise RuntimeError(f"spark_hvd.init: {chosen.describe()}: a job size below 1")
    return chosen
