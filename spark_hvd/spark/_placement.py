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


_GPU_ADDRESS = re.compile(r"^(0|[1-9][0-9]*)$")


def visible_devices(my_gpus: list[str], host_gpus: list[list[str]]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for one task.

    ``host_gpus`` lists the GPU addresses of every task on this task's host in local-rank order.
    When every task there owns exactly one GPU, all of them are visible in local-rank order, so
    Horovod's ``torch.cuda.set_device(hvd.local_rank())`` picks this task's own GPU and CUDA
    peer-to-peer between the host's ranks works. Otherwise (several GPUs per task) only the
    task's own GPUs are visible, and it addresses them from 0.
    """
    for a in my_gpus:
        if not _GPU_ADDRESS.match(a):
            raise ValueError(f"GPU address {a!r} from Spark's resources is not a CUDA device "
                             "index (check the executors' GPU discovery script)")
    if host_gpus and all(len(g) == 1 for g in host_gpus):
        ordered = [g[0] for g in host_gpus]
        if len(set(ordered)) == len(ordered):
            return ",".join(ordered)
    return ",".join(my_gpus)


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
