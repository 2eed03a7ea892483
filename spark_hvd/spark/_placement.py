"""Where each Spark barrier task sits in the job: ranks, hosts and GPUs. Pure functions.

A "host" is a Spark executor, identified by the address that ``BarrierTaskContext.getTaskInfos``
reports for it (``host:port``). Two executors on one machine count as two hosts: they own
separate resources (cores, GPUs) and Spark schedules them independently, and it is what makes
``local-cluster[2,2,1024]`` look like the two-host job it stands for. Ranks are host-major (the
launcher's rule, :func:`spark_hvd.launch.hosts.assign_ranks`): ranks consecutive within an
executor, in partition order, and the executors of one machine (the host part of their
address) consecutive too, machines in order of their first task, so that a job with several
executors per machine still has its cross-machine neighbours far apart in rank, as under
``spark-hvd-run -H``.
"""

from __future__ import annotations

import re

from spark_hvd.launch.hosts import HostSlots, SlotInfo, assign_ranks


def slots_by_partition(addresses: list[str]) -> list[SlotInfo]:
    """Rank placement of every task, indexed by partition id.

    ``addresses[p]`` is the executor address of partition ``p`` (``getTaskInfos()`` order).
    Each :class:`SlotInfo` carries the executor address as ``hostname``.
    """
    if not addresses:
        raise ValueError("a barrier stage needs at least one task")
    counts: dict[str, int] = {}
    for a in addresses:
        counts[a] = counts.get(a, 0) + 1
    # Machines in the order of their first task; sorted is stable, so executors keep theirs.
    machine_order = {m: i for i, m in enumerate(dict.fromkeys(map(host_of, addresses)))}
    executors = sorted(counts, key=lambda a: machine_order[host_of(a)])
    slots = assign_ranks([HostSlots(h, counts[h]) for h in executors], len(addresses))
    by_host: dict[str, list[SlotInfo]] = {}
    for s in slots:
        by_host.setdefault(s.hostname, []).append(s)
    seen: dict[str, int] = {}
    out = []
    for a in addresses:
        k = seen.get(a, 0)
        seen[a] = k + 1
        out.append(by_host[a][k])
    return out


def host_of(address: str) -> str:
    """The host part of an executor address ``host:port`` (``[v6]:port`` too)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_id(address: str) -> str:
    """The host identity the core compares to find same-host peers: the executor address,
    made safe for the whitespace-separated rendezvous lines."""
    return re.sub(r"\s+", "_", address) or "executor"


# What CUDA_VISIBLE_DEVICES takes: a device index, or a GPU / MIG instance UUID (the form
# `nvidia-smi -L` prints, which some discovery scripts report).
_GPU_ADDRESS = re.compile(r"^(0|[1-9][0-9]*|(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/_-]*)$")


def visible_devices(my_gpus: list[str], host_gpus: list[list[str]]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for one task, from Spark's GPU addresses.

    ``my_gpus`` are the task's own addresses (``BarrierTaskContext.resources()['gpu']``) and
    ``host_gpus`` lists the addresses of every task on this task's host (its executor) in
    local-rank order, this task's included. The rules, so that the device a rank selects is
    always one Spark gave its task:

    - every task of the host holds exactly one GPU, no two the same
      (``spark.task.resource.gpu.amount=1``): all of the host's GPUs are visible, in
      local-rank order, so Horovod's ``torch.cuda.set_device(hvd.local_rank())`` selects the
      task's own GPU and CUDA peer-to-peer between the host's ranks still works;
    - anything else (several GPUs per task, or GPUs shared because the amount is a fraction
      such as 0.5): only the task's own GPUs are visible, renumbered from 0. A task sharing
      its GPU sees that one GPU as device 0; ``hvd.local_rank() % torch.cuda.device_count()``
      selects the task's own device in every case (the estimators use it).

    Raises ValueError for an address CUDA cannot take (neither an index nor a ``GPU-`` /
    ``MIG-`` UUID): a discovery script that reports something else.
    """
    for a in my_gpus:
        if not _GPU_ADDRESS.match(a):
            raise ValueError(f"GPU address {a!r} from Spark's resources is not a CUDA device "
                             "index or UUID (check the executors' GPU discovery script)")
    if host_gpus and all(len(g) == 1 for g in host_gpus):
        ordered = [g[0] for g in host_gpus]
        if len(set(ordered)) == len(ordered):
            return ",".join(ordered)
    return ",".join(my_gpus)


def shared_gpus(tasks: list[tuple[str, int, list[str]]]) -> list[tuple[str, str, list[int]]]:
    """The GPUs that several tasks of one executor hold (fractional
    ``spark.task.resource.gpu.amount``), from ``(executor, rank, addresses)`` of every task:
    ``(executor, address, ranks)``, ranks ascending, in order of their lowest rank."""
    holders: dict[tuple[str, str], list[int]] = {}
    for executor, rank, addresses in tasks:
        for a in addresses:
            holders.setdefault((executor, a), []).append(rank)
    shared = [(e, a, sorted(r)) for (e, a), r in holders.items() if len(r) > 1]
    return sorted(shared, key=lambda s: s[2][0])


def sharing_note(shared: list[tuple[str, str, list[int]]]) -> str:
    """The one line the driver shows when ranks share GPUs (see :func:`shared_gpus`)."""
    where = "; ".join(f"GPU {a} of executor {e} by ranks {', '.join(map(str, r))}"
                      for e, a, r in shared)
    return (f"ranks share GPUs ({where}): spark.task.resource.gpu.amount is below 1. Each of "
            "them sees only its GPU, as device 0: select it with torch.cuda.set_device("
            "hvd.local_rank() % torch.cuda.device_count()), not hvd.local_rank() alone")


def parse_master_slots(master: str, task_cpus: int = 1, cpu_count: int | None = None) \
        -> int | None:
    """Task slots of a local master from its URL (``local``, ``local[N]``, ``local[N,F]``,
    ``local[*]``, ``local-cluster[E,C,M]``); None for cluster masters, where the executors
    decide."""
    master = (master or "").strip()
    task_cpus = max(1, int(task_cpus))
    if master == "local":
        return 1 // task_cpus or 0
    m = re.fullmatch(r"local\[\s*(\*|\d+)\s*(?:,\s*\d+\s*)?\]", master)
    if m:
        if m.group(1) == "*":
            return None if cpu_count is None else cpu_count // task_cpus
        return int(m.group(1)) // task_cpus
    m = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]", master)
    if m:
        return int(m.group(1)) * (int(m.group(2)) // task_cpus)
    return None
