"""One bootstrap for every way a job starts (launcher, mpirun, Spark tasks, estimators).

Steps: learn rank and size (``SPARK_HVD_*`` from our launcher or Spark, as
``_bootstrap_contract`` lays down; ``OMPI_COMM_WORLD_*`` under mpirun, an mpi4py communicator,
or another launcher's variables: torchrun, MPICH's mpiexec, horovodrun, Slurm; see
``_launchers``), bind the native core's listener, exchange
"host port host_id hostname" with every rank through a :class:`Rendezvous`, then let the core connect its
authenticated mesh. With none of those present the process is a job of size 1.
"""

import ctypes
import logging
import os
import secrets
import socket

from . import _bootstrap_contract as contract
from . import _launchers, _mpi
from ._native import ERR_CONNECT, InitOptions, check, lib, raise_last_error
from ._network import pinned_interface_address, route_address
from ._secret import secret_from_env

_log = logging.getLogger("spark_hvd")


class Placement:
    """Where this process sits in the job (ranks are host-major)."""

    def __init__(self, rank, size, local_rank=None, local_size=None, cross_rank=None,
                 cross_size=None):
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size
        self.cross_rank, self.cross_size = cross_rank, cross_size

    def fill_from_hosts(self, host_ids):
        """Derives local/cross ranks from every rank's host id where the launcher gave none."""
        hosts = list(dict.fromkeys(host_ids))  # first-appearance order
        mine = host_ids[self.rank]
        if self.local_rank is None:
            self.local_rank = sum(1 for h in host_ids[:self.rank] if h == mine)
            self.local_size = sum(1 for h in host_ids if h == mine)
        if self.cross_rank is None:
            self.cross_rank = hosts.index(mine)
            self.cross_size = len(hosts)


class MpiRendezvous:
    """Rendezvous over an mpi4py communicator (under mpirun, or ``init(comm=...)``)."""

    def __init__(self, comm):
        self.comm = comm

    def allgather(self, value):
        return self.comm.allgather(value)


def _advertised_host(bind_addr, rendezvous_host=None):
    """The address other ranks use to reach our listener: the bind address, or for a wildcard
    bind the local address that routes to the rendezvous host (``gethostbyname(hostname)``
    is 127.0.1.1 on many distributions, unreachable from other machines)."""
    if bind_addr not in ("", "0.0.0.0"):
        return bind_addr
    if rendezvous_host:
        return route_address(rendezvous_host)
    return socket.gethostbyname(socket.gethostname())


def _mpi_comm(comm):
    if comm is not None:
        return comm
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError(
            "This process was started by mpirun (OMPI_COMM_WORLD_RANK is set) but mpi4py is not "
            "installed, which spark_hvd needs to find its peers under mpirun. Install mpi4py or "
            "launch with spark-hvd-run.") from None
    return MPI.COMM_WORLD


def _mpi_discover(comm):
    placement = Placement(comm.Get_rank(), comm.Get_size())
    # Rank 0 makes the job secret and job id; MPI is already a trusted channel.
    secret, job_id = comm.bcast(
        (secrets.token_bytes(32), secrets.token_hex(4)) if comm.Get_rank() == 0 else None,
        root=0)
    return placement, MpiRendezvous(comm), secret, job_id


def _spark_hvd_discover(launch, generation):
    size = launch.size
    placement = Placement(launch.rank, size, launch.local_rank, launch.local_size,
                          launch.cross_rank, launch.cross_size)
    secret = secret_from_env(os.environ.get(contract.SECRET, ""))
    job_id = os.environ.get(contract.JOB_ID) or contract.DEFAULT_JOB_ID
    rendezvous = None
    if size > 1:
        from ._rendezvous import rendezvous_from_env
        rendezvous = rendezvous_from_env(generation=generation)
    return placement, rendezvous, secret, job_id


def _single():
    return Placement(0, 1, 0, 1, 0, 1), None, b"", "single"


def _other_launcher_discover(launch, generation):
    """Joins a job that another launcher started, through the channel that launcher provides
    (see _launchers): the job secret is drawn by rank 0 and shared over that channel."""
    if launch.size == 1:
        return _single()
    from ._launcher_channels import agree_on_job
    try:
        rendezvous = launch.connect(generation, contract.start_timeout())
        if rendezvous.size == 1:  # PMI over PMI_PORT learns the size only now
            return _single()
        secret, job_id = agree_on_job(rendezvous, rendezvous.rank)
    except RuntimeError as e:
        # Keep the type (a RendezvousTimeoutError stays one); say which job we tried to join.
        raise type(e)(f"spark_hvd.init: joining the job of {launch.describe()}: {e}") from None
    placement = Placement(rendezvous.rank, rendezvous.size, launch.local_rank,
                          launch.local_size, launch.cross_rank, launch.cross_size)
    return placement, rendezvous, secret, job_id


def discover(comm=None, generation=0):
    """Returns (placement, rendezvous or None, secret, job_id) for this process.

    ``comm`` (an mpi4py communicator) wins; otherwise the launcher that started the process
    (see :mod:`._launchers`) says how to join, and a process no launcher started is a job of
    size 1.
    """
    if comm is not None:
        return _mpi_discover(comm)
    launch = _launchers.identify()
    if launch is None or launch.cannot_join:  # identify() let it pass: a job of one
        return _single()
    if launch.launcher == _launchers.SPARK_HVD_RUN:
        return _spark_hvd_discover(launch, generation)
    if launch.launcher == _launchers.OPEN_MPI:
        return _mpi_discover(_mpi_comm(None))
    return _other_launcher_discover(launch, generation)


def start(config, comm=None, process_sets=(), rendezvous=None, placement=None, secret=None,
          job_id=None, generation=0):
    """Connects this process to its job and starts the native engine.

    ``rendezvous``/``placement``/``secret`` may be given by a caller that already knows them
    (Spark tasks); otherwise they are discovered from the environment. ``generation`` counts
    earlier inits in this process, so a re-init uses fresh rendezvous keys.
    """
    if placement is None:
        placement, rendezvous, secret, job_id = discover(comm, generation)
    # MPI operations (HOROVOD_CPU_OPERATIONS=MPI) need the communicator the job was found on.
    mpi_options = _mpi.options_for_init(
        config, rendezvous.comm if isinstance(rendezvous, MpiRendezvous) else None)
    host_id = os.environ.get(contract.HOSTNAME) or socket.gethostname()
    peers = ""
    if placement.size > 1:
        # The host the other ranks' launcher channel lives on: our rendezvous, or the store /
        # server of another launcher (torchrun, horovodrun, PMI_PORT).
        rendezvous_host = (getattr(rendezvous, "route_host", None)
                           or os.environ.get(contract.RENDEZVOUS_ADDR, "").rpartition(":")[0])
        mine = listen(config, placement.rank, rendezvous_host).encode()
        lines = [v.decode() for v in rendezvous.allgather(mine)]
        peers = "\n".join(lines) + "\n"
        placement.fill_from_hosts([line.split()[2] for line in lines])
    else:
        placement.fill_from_hosts([host_id])
    connect(config, placement, peers, secret, job_id, process_sets, mpi_options)
    return placement


def listen(config, rank, rendezvous_host=""):
    """Binds the core's listener (``SPARK_HVD_BIND_ADDR``, or the pinned interface) and returns
    this process's line for the others: "advertised-host port host_id hostname"."""
    host_id = os.environ.get(contract.HOSTNAME) or socket.gethostname()
    bind_addr, interface = _pinned_bind_address(rank, os.environ.get(contract.BIND_ADDR, ""))
    port = check(lib.shvd_listen(bind_addr.encode() or b"0.0.0.0",
                                 -1 if config.tcp_buffer_bytes is None
                                 else config.tcp_buffer_bytes))
    advertised = _advertised_host(bind_addr, (rendezvous_host or "").strip('[]'))
    _log.debug("rank %s listens on %s:%d%s, advertised as %s", rank, bind_addr or "0.0.0.0",
               port, f" (interface {interface})" if interface else "", advertised)
    # The machine's own name last: the core's errors name a lost host by it too.
    return f"{advertised} {port} {host_id} {socket.gethostname()}"


def connect(config, placement, peers, secret, job_id, process_sets=(), mpi_options=None):
    """Starts the native engine of ``placement`` (local and cross ranks filled in) on the mesh
    of ``peers`` (every rank's :func:`listen` line, in rank order, newline-separated; empty for
    a job of one rank). ``listen`` must have been called when there are peers."""
    if mpi_options is None:
        mpi_options = _mpi.options_for_init(config, None)
    flat, sizes = [], []
    for ranks in process_sets:
        flat.extend(ranks)
        sizes.append(len(ranks))
    ranks_arr = (ctypes.c_int32 * max(1, len(flat)))(*flat)
    sizes_arr = (ctypes.c_int32 * max(1, len(sizes)))(*sizes)
    opts = InitOptions(
        rank=placement.rank, size=placement.size,
        local_rank=placement.local_rank, local_size=placement.local_size,
        cross_rank=placement.cross_rank, cross_size=placement.cross_size,
        peers=peers.encode(), secret=secret, secret_len=len(secret),
        job_id=(job_id or "job").encode(),
        use_shared_memory=1 if config.shared_memory else 0,
        start_timeout_seconds=config.start_timeout,
        fusion_threshold_bytes=config.fusion_threshold,
        cycle_time_ms=config.cycle_time_ms,
        cache_capacity=config.cache_capacity,
        stall_warning_seconds=config.stall_warning_seconds,
        stall_shutdown_seconds=config.stall_shutdown_seconds,
        ring_threshold_bytes=config.ring_threshold,
        timeline_path=(config.timeline or "").encode(),
        timeline_mark_cycles=1 if config.timeline_mark_cycles else 0,
        process_set_ranks=ranks_arr, process_set_sizes=sizes_arr,
        num_process_sets=len(sizes),
        overlap=config.overlap,
        shm_chunk_bytes=config.shm_chunk_bytes,
        shm_single_copy=1 if config.shm_single_copy else 0,
        shm_single_copy_min_bytes=(-1 if config.shm_single_copy_min_bytes is None
                                   else config.shm_single_copy_min_bytes),
        shm_arenas=1 if config.shared_gradients else 0,
        shm_pipe_bytes=config.shm_pipe_bytes,
        shm_negotiation=1 if config.shm_negotiation else 0,
        hierarchical_allreduce=config.hierarchical_allreduce,
        hierarchical_allgather=config.hierarchical_allgather,
        autotune=1 if config.autotune else 0, autotune_log=config.autotune_log.encode(),
        autotune_warmup_samples=config.autotune_warmup_samples,
        autotune_steps_per_sample=config.autotune_steps_per_sample,
        autotune_bayes_opt_max_samples=config.autotune_bayes_opt_max_samples,
        autotune_gaussian_process_noise=config.autotune_gaussian_process_noise,
        autotune_fixed=config.autotune_fixed_bits(),
        peer_timeout_seconds=config.peer_timeout, shared_gpu=config.shared_gpu,
        deadlock_check_seconds=config.deadlock_check_seconds,
        **mpi_options)
    if lib.shvd_init(opts) == -1:
        # Ranks that did not all connect: say where each was told to connect.
        raise_last_error({ERR_CONNECT: _address_hint(peers)})
    _mpi.started(mpi_options)


def _pinned_bind_address(rank, bind_addr):
    """(address to bind, interface or None): the pinned interface's address on this host when
    ``--network-interface`` / ``SPARK_HVD_NETWORK_INTERFACE`` / ``HOROVOD_GLOO_IFACE`` is set
    (it wins over the launcher's bind address, which cannot know remote hosts' addresses),
    else ``bind_addr``. A name this host lacks is an error on this rank, naming what it has."""
    try:
        pinned = pinned_interface_address()
    except ValueError as e:
        raise ValueError(f"spark_hvd.init: rank {rank}: {e}") from None
    if pinned is None:
        return bind_addr, None
    interface, address = pinned
    return address, interface


def _address_hint(peers):
    """What the ranks advertised, and how to choose the network, for a mesh that did not
    connect: the usual cause across machines is an address on a network the peers do not
    share (a management interface that routes to the launcher)."""
    listed = "; ".join(f"rank {r}: {line.split()[0]}:{line.split()[1]} on {line.split()[2]}"
                       for r, line in enumerate(peers.splitlines()) if line.strip())
    return (f"The ranks advertised these addresses: {listed}. A rank advertises its bind "
            "address or, bound to all interfaces, its address on the route to the launcher. "
            "Where hosts have several networks, choose the one that connects them with "
            "--network-interface IF (SPARK_HVD_NETWORK_INTERFACE=IF).")
