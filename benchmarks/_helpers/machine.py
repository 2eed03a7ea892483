"""The machine a benchmark runs on: its load, a free port, a one-line description of the host
and of the checkout, its GPUs. Shared by the scripts of ``benchmarks/``."""

import json
import os
import platform
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def loadavg():
    """The 1-minute load average, rounded to 2 places; NaN where the system does not say (the
    reports format it as ``nan`` where None would raise)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return float("nan")


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def source_version():
    """The checkout's commit (with '-dirty' for uncommitted changes), if this is a git tree."""
    try:
        out = subprocess.run(["git", "-C", HERE, "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def host_description():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{ncpu} CPU cores ({cpu}), {platform.system()} {platform.release()}, " \
           f"Python {platform.python_version()}"


def probe_gpus():
    """{"count": visible CUDA devices, "name": the first one's name, "error": ...}, asked of a
    child process (this one never initialises CUDA)."""
    if os.environ.get("BENCH_CUDA_DRY_RUN_ON_CPU") == "1":  # see allreduce_worker.py
        return {"count": 1, "name": "(dry run on the CPU)", "torch": None, "cuda": None}
    code = ("import json, torch; n = torch.cuda.device_count(); "
            "print(json.dumps({'count': n, 'name': torch.cuda.get_device_name(0) if n else None,"
            " 'torch': torch.__version__, 'cuda': torch.version.cuda}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
        info = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return {"count": 0, "name": None, "error": f"{type(e).__name__}: {e}"}
    if not info["count"]:
        info["error"] = "torch.cuda.device_count() is 0"
    return info
