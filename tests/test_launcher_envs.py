"""Processes started by other launchers join their job, or fail with a clear error on every rank.

Real launchers where this machine has them (torchrun, MPICH's Hydra mpiexec, Open MPI's mpirun);
for Slurm and horovodrun, N real processes started with the variables those launchers set (for
horovodrun, against a test-owned HTTP key-value server that speaks the protocol of Horovod's Gloo
rendezvous). Every job runs ``launcher_scripts/join_job.py``, which does ``init``, an allreduce
and an allgather, and prints ``OK rank=..`` or ``ERROR <message>``.
"""

import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from spark_hvd.common import _launchers

REPO = Path(__file__).resolve().parent.parent
JOIN_JOB = str(Path(__file__).resolve().parent / "launcher_scripts" / "join_job.py")
PY = sys.executable
BIN = Path(PY).parent

# Every variable a launcher could have left in the developer's shell.
_SCRUB_PREFIXES = ("SPARK_HVD_", "HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_",
                   "MPI_LOCAL")
_SCRUB_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}

_OK = re.compile(r"OK rank=(\d+) size=(\d+) local_rank=(\d+) local_size=(\d+) "
                 r"cross_rank=(\d+) cross_size=(\d+) sum=([\d.]+) ranks=([\d,]+?)(?=OK|\s|$)")


def clean_env(**extra):
    """This test process's environment without any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB_NAMES}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["SPARK_HVD_START_TIMEOUT"] = "60"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_launcher(cmd, timeout=180, **extra):
    """Runs a real launcher to completion; returns (exit code, stdout + stderr)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=clean_env(**extra))
    return proc.returncode, proc.stdout + proc.stderr


def run_together(cmds, envs, timeout=120):
    """Starts every command at once (with its extra variables) and waits for all; returns
    [(exit code, output)] in order. On timeout every process is killed first."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=REPO, env=clean_env(**env)) for cmd, env in zip(cmds, envs)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out) for p, out in zip(procs, outs)]


def run_ranks(rank_envs, args=(), timeout=120):
    """One join_job.py per rank's variables, started as a launcher would start them."""
    return run_together([[PY, JOIN_JOB, *args]] * len(rank_envs), rank_envs, timeout)


def ok_lines(output):
    """{rank: [fields, ...]} of the OK lines in ``output`` (ranks' lines may share a line)."""
    found = {}
    for m in _OK.finditer(output):
        rank, size, lrank, lsize, crank, csize, total, ranks = m.groups()
        found.setdefault(int(rank), []).append(dict(
            size=int(size), local_rank=int(lrank), local_size=int(lsize), cross_rank=int(crank),
            cross_size=int(csize), sum=float(total), ranks=ranks))
    return found


def assert_joined(output, size, inits=1, local=True):
    """Every rank printed ``inits`` OK lines for one job of ``size`` ranks on this host."""
    found = ok_lines(output)
    assert sorted(found) == list(range(size)), output
    for rank, lines in found.items():
        assert len(lines) == inits, output
        for line in lines:
            assert line["size"] == size, output
            assert line["sum"] == size * (size + 1) / 2, output
            assert line["ranks"] == ",".join(map(str, range(size))), output
            if local:
                assert (line["local_rank"], line["local_size"]) == (rank, size), output
                assert (line["cross_rank"], line["cross_size"]) == (0, 1), output


# -- torchrun and torch's env:// convention ------------------------------------------------------

@pytest.mark.parametrize("mode", ["standalone", "nnodes1"])
def test_torchrun_joins(mode):
    """Real torchrun, 2 workers: they join through the agent's TCPStore, twice (re-init)."""
    torchrun = [str(BIN / "torchrun"), "--nproc-per-node", "2"]
    if mode == "standalone":
        torchrun.append("--standalone")
    else:
        torchrun += ["--nnodes", "1", "--master-addr", "127.0.0.1",
                     "--master-port", str(free_port())]
    rc, out = run_launcher([*torchrun, JOIN_JOB, "reinit"])
    assert rc == 0, out
    assert_joined(out, 2, inits=2)


def test_torchrun_two_agents_join():
    """Two real torchrun agents (as on two nodes) meeting through c10d's rendezvous: ranks take
    their cross rank from GROUP_RANK."""
    port = free_port()
    cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-agents", JOIN_JOB]
    results = run_together([cmd, cmd], [{}, {}], timeout=180)
    out = "".join(o for _, o in results)
    assert [rc for rc, _ in results] == [0, 0], out
    found = ok_lines(out)
    assert_joined(out, 2, local=False)
    for rank in range(2):
        [line] = found[rank]
        assert (line["local_rank"], line["local_size"]) == (0, 1), out
        assert (line["cross_rank"], line["cross_size"]) == (rank, 2), out


def test_torch_env_rank0_hosts_the_store():
    """RANK/WORLD_SIZE/MASTER_* without torchrun (torch's env:// convention): rank 0 hosts the
    TCPStore, and frees its port so that init_process_group(env://) works afterwards."""
    port = free_port()
    results = run_ranks([dict(RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                         for r in range(2)], args=["torch-after"])
    out = "".join(o for _, o in results)
    assert [rc for rc, _ in results] == [0, 0], out
    assert_joined(out, 2)
    assert out.count("TORCH sum=2") == 2, out


def torch_env(rank, port, **placement):
    """torch's env:// variables for rank ``rank`` of 2 with the store on ``port`` (rank 0
    hosts it), plus the torchrun placement variables given."""
    return dict(RANK=rank, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **placement)


# Partial torchrun placements, each complete but for one size that the others determine.
_DERIVED = {
    # name: (placement variables for rank r, (local rank, local size, cross rank, cross size))
    "GROUP_WORLD_SIZE = WORLD_SIZE / LOCAL_WORLD_SIZE, one host": (
        lambda r: dict(LOCAL_RANK=r, LOCAL_WORLD_SIZE=2, GROUP_RANK=0),
        lambda r: (r, 2, 0, 1)),
    "GROUP_WORLD_SIZE = WORLD_SIZE / LOCAL_WORLD_SIZE, two hosts": (
        lambda r: dict(LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, GROUP_RANK=r),
        lambda r: (0, 1, r, 2)),
    "LOCAL_WORLD_SIZE = WORLD_SIZE / GROUP_WORLD_SIZE": (
        lambda r: dict(LOCAL_RANK=r, GROUP_RANK=0, GROUP_WORLD_SIZE=1),
        lambda r: (r, 2, 0, 1)),
}


@pytest.mark.parametrize("case", list(_DERIVED))
def test_torchrun_placement_without_a_size_is_derived(case):
    """torchrun runs as many ranks on every host, so a size it left out follows from the
    others: 2 real processes with the variables as given join and reduce together."""
    placement, expected = _DERIVED[case]
    port = free_port()
    results = run_ranks([torch_env(r, port, **placement(r)) for r in range(2)])
    out = "".join(o for _, o in results)
    assert [rc for rc, _ in results] == [0, 0], out
    assert_joined(out, 2, local=False)
    found = ok_lines(out)
    for rank in range(2):
        [line] = found[rank]
        got = (line["local_rank"], line["local_size"], line["cross_rank"], line["cross_size"])
        assert got == expected(rank), out


def test_size_one_needs_no_rendezvous():
    """WORLD_SIZE=1 alone is a job of one: no MASTER_ADDR needed."""
    [(rc, out)] = run_ranks([dict(RANK=0, WORLD_SIZE=1)])
    assert rc == 0, out
    assert_joined(out, 1)


# -- MPI launchers -------------------------------------------------------------------------------

@pytest.mark.skipif(not shutil.which("mpiexec.hydra"),
                    reason="MPICH's mpiexec.hydra is not installed (scripts/setup.sh step 1)")
@pytest.mark.parametrize("channel", ["PMI_FD", "PMI_PORT"])
def test_mpich_hydra_joins(channel):
    """MPICH's real mpiexec (Hydra), 2 ranks, over an inherited PMI_FD or a PMI_PORT."""
    cmd = ["mpiexec.hydra", "-n", "2"] + (["-pmi-port"] if channel == "PMI_PORT" else [])
    rc, out = run_launcher([*cmd, PY, JOIN_JOB, "reinit"])
    assert rc == 0, out
    assert_joined(out, 2, inits=2)


@pytest.mark.skipif(not shutil.which("mpirun"), reason="Open MPI's mpirun is not installed")
def test_open_mpi_mpirun_still_joins():
    """Open MPI keeps its place in the precedence (through mpi4py), the Slurm-like variables of
    an enclosing allocation notwithstanding."""
    rc, out = run_launcher(["mpirun", "--oversubscribe", "-np", "2", PY, JOIN_JOB],
                           OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1,
                           SLURM_PROCID=0, SLURM_NTASKS=1)
    assert rc == 0, out
    assert_joined(out, 2, local=False)


# -- horovodrun ----------------------------------------------------------------------------------

class _HorovodStyleKV(http.server.ThreadingHTTPServer):
    """A key-value server speaking the protocol of Horovod's Gloo rendezvous: PUT and GET of
    /<scope>/<key>, 404 for a missing key. Written for this test; records what it stored."""

    daemon_threads = True

    def __init__(self):
        self.values, self.lock = {}, threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def _scope_key(self):
                parts = self.path.split("/")
                if len(parts) != 3:
                    self._reply(400)
                    return None
                return parts[1], parts[2]

            def _reply(self, status, body=b""):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                where = self._scope_key()
                if where:
                    body = self.rfile.read(int(self.headers["Content-Length"]))
                    with server.lock:
                        server.values[where] = body
                    self._reply(200)

            def do_GET(self):
                where = self._scope_key()
                if where:
                    with server.lock:
                        value = server.values.get(where)
                    self._reply(404) if value is None else self._reply(200, value)

            def log_message(self, *args):
                pass

        server = self
        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def horovod_kv():
    server = _HorovodStyleKV()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def horovod_env(rank, size, port):
    """The variables horovodrun (Gloo mode) gives each rank on one host."""
    return dict(HOROVOD_HOSTNAME="localhost", HOROVOD_RANK=rank, HOROVOD_SIZE=size,
                HOROVOD_LOCAL_RANK=rank, HOROVOD_LOCAL_SIZE=size, HOROVOD_CROSS_RANK=0,
                HOROVOD_CROSS_SIZE=1, HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1",
                HOROVOD_GLOO_RENDEZVOUS_PORT=port, HOROVOD_CONTROLLER="gloo",
                HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE="lo")


def test_horovodrun_env_joins_through_its_rendezvous(horovod_kv):
    port = horovod_kv.server_address[1]
    results = run_ranks([horovod_env(r, 3, port) for r in range(3)], args=["reinit"])
    out = "".join(o for _, o in results)
    assert [rc for rc, _ in results] == [0, 0, 0], out
    assert_joined(out, 3, inits=2)
    # Both inits went through the server, each in its own scope.
    scopes = {scope for scope, _ in horovod_kv.values}
    assert scopes == {"spark_hvd.0", "spark_hvd.1"}, scopes


# -- Slurm ---------------------------------------------------------------------------------------

def slurm_env(rank, size, **extra):
    """The variables srun gives task ``rank`` of a one-node step of ``size`` tasks."""
    return dict(SLURM_JOB_ID=4242, SLURM_STEP_ID=0, SLURM_PROCID=rank, SLURM_LOCALID=rank,
                SLURM_NODEID=0, SLURM_NTASKS=size, SLURM_STEP_NUM_TASKS=size,
                SLURM_STEP_NUM_NODES=1, SLURM_STEP_TASKS_PER_NODE=size, **extra)


def test_srun_with_master_addr_joins():
    port = free_port()
    results = run_ranks([slurm_env(r, 2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                         for r in range(2)])
    out = "".join(o for _, o in results)
    assert [rc for rc, _ in results] == [0, 0], out
    assert_joined(out, 2)


# -- no way to join: a clear error on every rank, never a job of size 1 -------------------------

_CANNOT_JOIN = {
    # name: (variables for rank r, words the message must contain)
    "srun without a rendezvous": (
        lambda r: slurm_env(r, 2), ["SLURM_PROCID", "SLURM_STEP_NUM_TASKS=2", "srun --mpi=pmi2",
                                    "MASTER_ADDR", "spark-hvd-run"]),
    "sbatch script": (
        lambda r: dict(SLURM_JOB_ID=1, SLURM_PROCID=r, SLURM_NTASKS=2),
        ["SLURM_NTASKS=2", "batch script", "srun -n 1"]),
    "PMI without a channel": (
        lambda r: dict(PMI_RANK=r, PMI_SIZE=2), ["PMI_RANK", "PMI_SIZE=2", "PMI_FD", "PMI_PORT",
                                                 "mpiexec"]),
    "PMI_FD not open": (
        lambda r: dict(PMI_RANK=r, PMI_SIZE=2, PMI_FD=987), ["PMI_FD='987'", "not an open"]),
    "torch without MASTER_ADDR": (
        lambda r: dict(RANK=r, WORLD_SIZE=2), ["RANK=", "WORLD_SIZE=2", "MASTER_ADDR",
                                               "torchrun"]),
    "horovodrun without a rendezvous": (
        lambda r: dict(HOROVOD_RANK=r, HOROVOD_SIZE=2),
        ["HOROVOD_SIZE=2", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "horovodrun", "spark-hvd-run"]),
    "launchers disagree": (
        lambda r: dict(RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=1,
                       HOROVOD_RANK=r, HOROVOD_SIZE=3),
        ["disagree", "WORLD_SIZE=2", "HOROVOD_SIZE=3"]),
}


def assert_error_on_every_rank(make_env, words):
    """2 real processes with ``make_env(rank)`` each refuse init with every one of ``words``."""
    results = run_ranks([make_env(r) for r in range(2)], timeout=60)
    for rc, out in results:
        assert rc == 3 and out.startswith("ERROR spark_hvd.init: "), out
        for word in words:
            assert word in out, (word, out)


@pytest.mark.parametrize("case", list(_CANNOT_JOIN))
def test_cannot_join_is_a_clear_error_on_every_rank(case):
    assert_error_on_every_rank(*_CANNOT_JOIN[case])


def _without(env, *names):
    return {k: v for k, v in env.items() if k not in names}


# A launcher's variables with one missing (or contradicting another), as a wrapper script or a
# hand-written job file leaves them: init names what is missing and what to set, on every rank.
_PARTIAL = {
    # name: (variables for rank r, words the message must contain)
    "torchrun: GROUP_RANK without GROUP_WORLD_SIZE or LOCAL_WORLD_SIZE": (
        lambda r: torch_env(r, 1, GROUP_RANK=r),
        ["GROUP_RANK is set but GROUP_WORLD_SIZE (the number of hosts) is not",
         "it would be WORLD_SIZE / LOCAL_WORLD_SIZE, but LOCAL_WORLD_SIZE is not set either",
         "Set GROUP_WORLD_SIZE for every rank, or unset GROUP_RANK"]),
    "torchrun: uneven hosts": (
        lambda r: dict(torch_env(r, 1, LOCAL_RANK=r, LOCAL_WORLD_SIZE=2, GROUP_RANK=0),
                       WORLD_SIZE=3),
        ["GROUP_WORLD_SIZE (the number of hosts) is not",
         "WORLD_SIZE=3 is not a multiple of LOCAL_WORLD_SIZE=2", "Set GROUP_WORLD_SIZE"]),
    "torchrun: LOCAL_RANK without LOCAL_WORLD_SIZE": (
        lambda r: torch_env(r, 1, LOCAL_RANK=r),
        ["LOCAL_RANK is set but LOCAL_WORLD_SIZE (the number of ranks on this host) is not",
         "GROUP_WORLD_SIZE is not set either", "Set LOCAL_WORLD_SIZE for every rank"]),
    "torchrun: GROUP_RANK beyond the hosts": (
        lambda r: torch_env(r, 1, LOCAL_RANK=r, LOCAL_WORLD_SIZE=2, GROUP_RANK=1),
        ["GROUP_RANK=1 is not in [0, 1)", "derived as WORLD_SIZE / LOCAL_WORLD_SIZE = 1"]),
    "torch: RANK without WORLD_SIZE": (
        lambda r: _without(torch_env(r, 1), "WORLD_SIZE"),
        ["RANK and WORLD_SIZE must both be set, but WORLD_SIZE is not set", "torchrun"]),
    "torch: WORLD_SIZE without RANK": (
        lambda r: _without(torch_env(r, 1), "RANK"),
        ["RANK and WORLD_SIZE must both be set, but RANK is not set", "torchrun"]),
    "torch: MASTER_ADDR without MASTER_PORT": (
        lambda r: _without(torch_env(r, 1), "MASTER_PORT"),
        ["MASTER_PORT is not set, so the other ranks cannot be found", "export MASTER_ADDR"]),
    "Open MPI: rank without size": (
        lambda r: dict(OMPI_COMM_WORLD_RANK=r),
        ["OMPI_COMM_WORLD_SIZE is not set", "start the job with mpirun"]),
    "Open MPI: size without rank": (
        lambda r: dict(OMPI_COMM_WORLD_SIZE=2),
        ["OMPI_COMM_WORLD_RANK is not set", "start the job with mpirun"]),
    "MPICH: MPI_LOCALRANKID without MPI_LOCALNRANKS": (
        lambda r: dict(PMI_RANK=r, PMI_SIZE=2, PMI_PORT="127.0.0.1:1", MPI_LOCALRANKID=r),
        ["MPI_LOCALRANKID is set but MPI_LOCALNRANKS (the number of ranks on this host) is not",
         "Set MPI_LOCALNRANKS for every rank"]),
    "horovodrun: HOROVOD_RANK without HOROVOD_SIZE": (
        lambda r: _without(horovod_env(r, 2, 1), "HOROVOD_SIZE"),
        ["HOROVOD_RANK and HOROVOD_SIZE must both be set, but HOROVOD_SIZE is not set",
         "horovodrun"]),
    "horovodrun: local rank without local size": (
        lambda r: _without(horovod_env(r, 2, 1), "HOROVOD_LOCAL_SIZE"),
        ["HOROVOD_LOCAL_RANK is set but HOROVOD_LOCAL_SIZE", "Set HOROVOD_LOCAL_SIZE"]),
    "horovodrun: cross rank without cross size": (
        lambda r: _without(horovod_env(r, 2, 1), "HOROVOD_CROSS_SIZE"),
        ["HOROVOD_CROSS_RANK is set but HOROVOD_CROSS_SIZE (the number of hosts) is not",
         "Set HOROVOD_CROSS_SIZE"]),
    "horovodrun: no rendezvous port": (
        lambda r: _without(horovod_env(r, 2, 1), "HOROVOD_GLOO_RENDEZVOUS_PORT"),
        ["HOROVOD_GLOO_RENDEZVOUS_PORT is not set, so the other ranks cannot be found"]),
    "spark-hvd-run: SPARK_HVD_RANK without SPARK_HVD_SIZE": (
        lambda r: dict(SPARK_HVD_RANK=r),
        ["SPARK_HVD_RANK and SPARK_HVD_SIZE must both be set, but SPARK_HVD_SIZE is not set",
         "spark-hvd-run"]),
    "spark-hvd-run: SPARK_HVD_SIZE without SPARK_HVD_RANK": (
        lambda r: dict(SPARK_HVD_SIZE=2),
        ["but SPARK_HVD_RANK is not set", "spark-hvd-run"]),
    "spark-hvd-run: local rank without local size": (
        lambda r: dict(SPARK_HVD_RANK=r, SPARK_HVD_SIZE=2, SPARK_HVD_LOCAL_RANK=r,
                       SPARK_HVD_RENDEZVOUS_ADDR="127.0.0.1:1"),
        ["SPARK_HVD_LOCAL_RANK is set but SPARK_HVD_LOCAL_SIZE", "Set SPARK_HVD_LOCAL_SIZE"]),
    "Slurm: MASTER_ADDR without MASTER_PORT": (
        lambda r: slurm_env(r, 2, MASTER_ADDR="127.0.0.1"),
        ["MASTER_ADDR is set, but MASTER_PORT is not set", "srun --mpi=pmi2"]),
}


@pytest.mark.parametrize("case", list(_PARTIAL))
def test_a_partial_environment_names_what_is_missing(case):
    assert_error_on_every_rank(*_PARTIAL[case])


@pytest.mark.parametrize("channel", ["horovodrun", "torch store"])
def test_a_rank_that_never_comes_is_named(channel, horovod_kv):
    """Rank 0 of 2 started alone: init fails after the start timeout naming rank 1."""
    if channel == "horovodrun":
        env = horovod_env(0, 2, horovod_kv.server_address[1])
    else:
        env = slurm_env(0, 2, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    [(rc, out)] = run_ranks([dict(env, SPARK_HVD_START_TIMEOUT=3)], timeout=60)
    assert rc == 3, out
    assert "timed out after 3 s: ranks [1] never arrived" in out, out


# -- which launcher: the precedence rules on environments alone -----------------------------

def test_precedence_and_nesting():
    identify = _launchers.identify
    assert identify({}) is None
    # Our launcher first; the Slurm allocation it runs in does not count.
    ours = identify(dict(SPARK_HVD_RANK="1", SPARK_HVD_SIZE="4", SLURM_PROCID="0",
                         SLURM_NTASKS="1"))
    assert (ours.launcher, ours.rank, ours.size) == (_launchers.SPARK_HVD_RUN, 1, 4)
    # srun starting one torchrun agent per node: torchrun's workers carry the agent's Slurm
    # variables; torchrun is the launcher.
    nested = identify(dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4",
                           GROUP_RANK="1", GROUP_WORLD_SIZE="2", MASTER_ADDR="n0",
                           MASTER_PORT="29500", TORCHELASTIC_RUN_ID="x",
                           TORCHELASTIC_USE_AGENT_STORE="True", SLURM_PROCID="1",
                           SLURM_NTASKS="2", SLURM_STEP_ID="0"))
    assert (nested.launcher, nested.rank, nested.size) == ("torchrun", 5, 8)
    assert (nested.local_rank, nested.local_size, nested.cross_rank, nested.cross_size) == \
        (1, 4, 1, 2)
    # torchrun runs as many ranks on every host: GROUP_WORLD_SIZE = WORLD_SIZE / LOCAL_WORLD_SIZE.
    derived = identify(dict(RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                            GROUP_RANK="1", MASTER_ADDR="n0", MASTER_PORT="29500"))
    assert (derived.local_size, derived.cross_rank, derived.cross_size) == (2, 1, 4)
    # Open MPI before the others when sizes agree.
    mpi = identify(dict(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2", PMI_RANK="0",
                        PMI_SIZE="2"))
    assert mpi.launcher == _launchers.OPEN_MPI
    # Slurm alone, one task: a job of one, no rendezvous needed.
    solo = identify(dict(SLURM_PROCID="0", SLURM_NTASKS="1"))
    assert (solo.rank, solo.size) == (0, 1)
    with pytest.raises(RuntimeError, match="rank 3 is not in"):
        identify(dict(HOROVOD_RANK="3", HOROVOD_SIZE="2", HOROVOD_GLOO_RENDEZVOUS_ADDR="h",
                      HOROVOD_GLOO_RENDEZVOUS_PORT="1"))
    with pytest.raises(RuntimeError, match="WORLD_SIZE='two'"):
        identify(dict(RANK="0", WORLD_SIZE="two"))
