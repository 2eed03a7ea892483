"""Functions the spark_hvd.spark tests run on ranks. The tests register this module with
cloudpickle "by value", so the ranks need not import it (Spark's workers could not)."""

import os
import signal
import subprocess
import sys
import time


def _hvd():
    import spark_hvd.numpy as hvd
    return hvd


def rank_info(tag=None, env_names=()):
    """init, one allreduce, and where this rank thinks it is."""
    import numpy as np
    hvd = _hvd()
    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="rank_info")
    print(f"hello rank={hvd.rank()} tag={tag}", flush=True)
    print(f"to stderr rank={hvd.rank()}", file=sys.stderr, flush=True)
    info = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size(), "sum": float(total[0]), "tag": tag,
            "pid": os.getpid(), "env": {n: os.environ.get(n) for n in env_names}}
    hvd.shutdown()
    return info


def empty():
    """Nothing at all (overhead measurements)."""
    return None


def record_pids(pid_dir, rank):
    """Write this rank's pid and a grandchild's pid under ``pid_dir``."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(os.path.join(pid_dir, f"rank{rank}.pids"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}\n")


def fail_on(bad_rank, pid_dir=None):
    """Every rank inits; ``bad_rank`` raises, the others would keep working for a long time."""
    hvd = _hvd()
    hvd.init()
    if pid_dir:
        record_pids(pid_dir, hvd.rank())
    if hvd.rank() == bad_rank:
        time.sleep(0.5)
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    time.sleep(120)
    return "not reached"


def die_on(bad_rank, pid_dir=None):
    """Ranks allreduce in a loop; ``bad_rank`` is killed by SIGKILL mid-training."""
    import numpy as np
    hvd = _hvd()
    hvd.init()
    if pid_dir:
        record_pids(pid_dir, hvd.rank())
    for step in range(100000):
        hvd.allreduce(np.ones(1000, np.float32), name=f"grad.{step % 4}")
        if step == 20 and hvd.rank() == bad_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.01)
    return "not reached"


def reinit():
    """init, shutdown, init again: two rendezvous rounds."""
    import numpy as np
    hvd = _hvd()
    sums = []
    for round_ in range(2):
        hvd.init()
        sums.append(float(hvd.allreduce(np.array([1.0]), op=hvd.Sum, name=f"r{round_}")[0]))
        hvd.shutdown()
    return sums


def init_only_on(rank_that_inits):
    """Only one rank calls init: a programming error the job must report, not hang on."""
    if int(os.environ["SPARK_HVD_RANK"]) == rank_that_inits:
        _hvd().init()
    return os.environ["SPARK_HVD_RANK"]


def chatty(lines):
    """Prints ``lines`` lines to stdout and to stderr, returns the rank."""
    rank = int(os.environ["SPARK_HVD_RANK"])
    for i in range(lines):
        print(f"out {i} of rank {rank}")
        print(f"err {i} of rank {rank}", file=sys.stderr)
    return rank


def env_of(names):
    """The rank's values of ``names``."""
    return {n: os.environ.get(n) for n in names}


def big_result(n_bytes):
    """A result bigger than one result chunk."""
    return os.urandom(16) + b"x" * n_bytes


def gather_through_init_rendezvous():
    """Meets the other ranks as ``init()`` does, without calling it: gathers "name port" lines
    through the rendezvous init() would use (the Spark task relays it as it relays init's),
    then connects to every other rank's port. As in init(), no rank returns before every
    rank has the lines (a rank that returned while another's round was still being relayed
    would fail that task)."""
    import socket

    from spark_hvd.common._rendezvous import rendezvous_from_env
    r = rendezvous_from_env()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        try:
            lines = [v.decode() for v in r.allgather(
                f"rank{r.rank} {listener.getsockname()[1]}".encode())]
        finally:
            r.client.close()
        for line in lines[:r.rank] + lines[r.rank + 1:]:
            socket.create_connection(("127.0.0.1", int(line.split()[1])), timeout=30).close()
        listener.settimeout(30)
        for _ in range(len(lines) - 1):
            listener.accept()[0].close()
    return [line.split()[0] for line in lines]
