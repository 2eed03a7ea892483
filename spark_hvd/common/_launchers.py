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

Two launchers that disagree on the job size, one that says size > 1 but gives no way to
reach the other ranks, or one whose variables are incomplete (a rank without the size it counts
in), are a ``RuntimeError`` naming the variables seen, what is missing and the fix; every rank
sees the same variables, so every rank raises. What follows from the others is derived instead:
torchrun runs as many ranks on every host, so ``GROUP_WORLD_SIZE`` is ``WORLD_SIZE /
LOCAL_WORLD_SIZE`` (and back); a local or cross size without its rank, or neither, comes with
the rank from the hosts the ranks report (``_bootstrap.Placement``).
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

# Each launcher's variables for the fields of Launch it gives.
_SPARK_HVD_NAMES = {"rank": contract.RANK, "size": contract.SIZE,
                    "local_rank": contract.LOCAL_RANK, "local_size": contract.LOCAL_SIZE,
                    "cross_rank": contract.CROSS_RANK, "cross_size": contract.CROSS_SIZE}
_OPEN_MPI_NAMES = {"rank": OMPI_RANK, "size": OMPI_SIZE}
_TORCH_NAMES = {"rank": TORCH_RANK, "size": TORCH_SIZE, "local_rank": TORCH_LOCAL_RANK,
                "local_size": TORCH_LOCAL_SIZE, "cross_rank": TORCH_GROUP_RANK,
                "cross_size": TORCH_GROUP_SIZE}
_PMI_NAMES = {"rank": PMI_RANK, "size": PMI_SIZE, "local_rank": MPI_LOCALRANKID,
              "local_size": MPI_LOCALNRANKS}
_HOROVOD_NAMES = {"rank": HOROVOD_RANK, "size": HOROVOD_SIZE, "local_rank": HOROVOD_LOCAL_RANK,
                  "local_size": HOROVOD_LOCAL_SIZE, "cross_rank": HOROVOD_CROSS_RANK,
                  "cross_size": HOROVOD_CROSS_SIZE}
# Each rank field of Launch, the size it counts in, and the other size (hosts x ranks per host
# = the job's size where every host runs as many ranks); what each size counts, for messages.
_PAIRS = (("local_rank", "local_size", "cross_size"), ("cross_rank", "cross_size", "local_size"))
_COUNTS = {"local_size": "ranks on this host", "cross_size": "hosts"}


@dataclass
class Launch:
    """What one launcher's variables say about this process.

    ``connect(generation, timeout)`` returns the :class:`~._rendezvous.Rendezvous` to the other
    ranks (with ``rank``, ``size`` and ``route_host``); it is None for the two launchers the
    bootstrap joins itself. ``cannot_join`` says why no rendezvous is reachable, fix included.
    ``names`` maps the fields the launcher gives (``rank``, ``size``, local and cross) to its
    variables, for messages; ``uniform_hosts``: every host runs ``local_size`` ranks
    (torchrun), so the local and cross sizes follow from each other.
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
    names: dict[str, str] = field(default_factory=dict, repr=False)
    uniform_hosts: bool = False

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


def _not_set(env, names) -> str | None:
    """``"B is not set"`` (or ``"A and B are not set"``) for those of ``names`` that are unset
    or empty; None when all are set."""
    missing = [n for n in names if not env.get(n)]
    if not missing:
        return None
    return f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set"


def _read(env, who, names, more=(), fix=None) -> Launch:
    """The :class:`Launch` of launcher ``who`` from its variables ``names`` ({field: variable});
    ``more`` are further variables the messages show. With ``fix`` (how to start the job), rank
    and size are both required: a missing one is ``cannot_join``."""
    launch = Launch(who, _seen(env, (*names.values(), *more)), names=names,
                    **{f: _int(env, name, who) for f, name in names.items()})
    missing = _not_set(env, (names["rank"], names["size"]))
    if fix and missing:
        launch.cannot_join = (f"{launch.describe()}: {names['rank']} and {names['size']} must "
                              f"both be set, but {missing}: {fix}")
    return launch


def _port(env, name, who) -> int:
    port = _int(env, name, who)
    if port is None or not 0 < port < 65536:
        raise RuntimeError(f"{name}={env.get(name)!r} (from {who}) is not a TCP port")
    return port


def _spark_hvd(env) -> Launch | None:
    if contract.RANK not in env and contract.SIZE not in env:
        return None
    return _read(env, SPARK_HVD_RUN, _SPARK_HVD_NAMES,
                 fix="start the job with spark-hvd-run or spark_hvd.spark.run, which set both")


def _open_mpi(env) -> Launch | None:
    if OMPI_RANK not in env and OMPI_SIZE not in env:
        return None
    return _read(env, OPEN_MPI, _OPEN_MPI_NAMES,
                 fix="start the job with mpirun, which sets both (rank and size then come "
                     "from MPI), or unset the one that is set")


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
    who = "torchrun" if TORCHELASTIC_RUN_ID in env else "torch.distributed's env:// variables"
    launch = _read(env, who, _TORCH_NAMES, (MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID),
                   fix="start the job with torchrun, or set both for every rank")
    launch.uniform_hosts = True  # torchrun's --nproc-per-node
    if launch.cannot_join:
        return launch
    missing = _not_set(env, (MASTER_ADDR, MASTER_PORT))
    if missing:
        launch.cannot_join = (
            f"{launch.describe()} says this is rank {launch.rank} of {launch.size}, but "
            f"{missing}, so the other ranks cannot be found: start the job with torchrun, or "
            f"export {MASTER_ADDR} (rank 0's host) and {MASTER_PORT} (a free port there) for "
            f"every rank, or use spark-hvd-run")
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
    # Rank and size may come from the process manager only, on connecting.
    launch = _read(env, who, _PMI_NAMES, (PMI_FD, PMI_PORT, PMI_ID))
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
    launch = _read(env, who, _HOROVOD_NAMES, (HOROVOD_RENDEZVOUS_ADDR, HOROVOD_RENDEZVOUS_PORT),
                   fix="start the job with horovodrun or spark-hvd-run")
    if launch.cannot_join:
        return launch
    addr = env.get(HOROVOD_RENDEZVOUS_ADDR)
    missing = _not_set(env, (HOROVOD_RENDEZVOUS_ADDR, HOROVOD_RENDEZVOUS_PORT))
    if env.get(HOROVOD_ELASTIC, "0") not in ("", "0"):
        launch.cannot_join = (f"{launch.describe()} with {HOROVOD_ELASTIC}=1: elastic Horovod "
                              "jobs cannot be joined by spark_hvd; run without --elastic or "
                              "use spark-hvd-run")
    elif missing:
        launch.cannot_join = (
            f"{launch.describe()} says this is rank {launch.rank} of {launch.size}, but "
            f"{missing}, so the other ranks cannot be found: start the job with horovodrun "
            "(Gloo mode, the default), with mpirun, or with spark-hvd-run")
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
    # Local and cross ranks come from the hosts the ranks report (SLURM_LOCALID alone gives
    # no local size).
    launch = _read(env, who, {"rank": SLURM_PROCID, "size": size_name},
                   (SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_ID, MASTER_ADDR, MASTER_PORT))
    missing = _not_set(env, (MASTER_ADDR, MASTER_PORT))
    if not missing:
        prefix = f"spark_hvd/slurm.{env.get(SLURM_JOB_ID, '')}.{env.get(SLURM_STEP_ID, '')}"
        launch.connect = _torch_store_connect(env, who, launch.rank, launch.size, prefix,
                                              is_master=launch.rank == 0)
        return launch
    step = ("" if SLURM_STEP_ID in env else
            " (no SLURM_STEP_ID: this looks like the batch script itself, a single process)")
    given = [n for n in (MASTER_ADDR, MASTER_PORT) if env.get(n)]
    half = f" ({given[0]} is set, but {missing})" if given else ""
    launch.cannot_join = (
        f"{launch.describe()} says this is task {launch.rank} of {launch.size}{step}, but "
        f"Slurm gave no way to reach the other tasks{half}. Start the job with one of: "
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
    if chosen.size != 1 and not chosen.cannot_join:
        _complete_placement(chosen)
    return chosen


def _complete_placement(launch):
    """Fills in a local or cross size the launcher left out where its other variables determine
    it, and checks each local and cross rank against its size. A rank without its size raises
    ``RuntimeError`` naming the variable to set (the process could not be placed); a size
    without its rank, or neither, is left to the hosts the ranks report."""
    names, size, derived = launch.names, launch.size, {}
    if launch.uniform_hosts and size:
        # Every host runs local_size ranks: hosts = size / local_size, and back.
        for rank_field, size_field, other in _PAIRS:
            known = getattr(launch, other)
            if (getattr(launch, rank_field) is not None and getattr(launch, size_field) is None
                    and known and size % known == 0):
                setattr(launch, size_field, size // known)
                derived[size_field] = f"{names['size']} / {names[other]}"
    for rank_field, size_field, other in _PAIRS:
        rank, count = getattr(launch, rank_field), getattr(launch, size_field)
        if rank is None:
            continue
        rank_name, size_name = names[rank_field], names[size_field]
        if count is None:
            why = ""
            if launch.uniform_hosts:
                known = getattr(launch, other)
                why = (f"; it would be {names['size']} / {names[other]}, but "
                       + (f"{names[other]} is not set either" if known is None else
                          f"{names['size']}={size} is not a multiple of {names[other]}={known}"))
            raise RuntimeError(
                f"spark_hvd.init: {launch.describe()}: {rank_name} is set but {size_name} (the "
                f"number of {_COUNTS[size_field]}) is not{why}. Set {size_name} for every rank, "
                f"or unset {rank_name} so that both are derived from the hosts the ranks run on")
        if not 0 <= rank < count:
            given = (f"{size_name} derived as {derived[size_field]} = {count}"
                     if size_field in derived else f"{size_name}={count}")
            raise RuntimeError(f"spark_hvd.init: {launch.describe()}: {rank_name}={rank} is not "
                               f"in [0, {count}) ({given})")
