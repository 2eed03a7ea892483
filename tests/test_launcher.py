"""spark-hvd-run: host parsing and rank placement as units, the launcher end to end with real
processes (python -m spark_hvd.runner), and the ssh command line (run locally through sh)."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spark_hvd.launch import hosts as _hosts
from spark_hvd.launch import net as _net
from spark_hvd.launch import spawn as _spawn
from spark_hvd.launch.hosts import HostSlots
from spark_hvd.runner import _env
from spark_hvd.runner.launch import build_parser

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "launcher_scripts"
PY = sys.executable


def _env_for_launcher(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("SPARK_HVD_START_TIMEOUT", None)
    env.update(extra)
    return env


def launch(args, timeout=30, cwd=None, **extra_env):
    """Run the launcher to completion; returns the CompletedProcess (text mode)."""
    return subprocess.run([PY, "-m", "spark_hvd.runner", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd or REPO,
                          env=_env_for_launcher(**extra_env))


def rank_values(stdout):
    """{rank: {KEY: VALUE}} from env_dump.py output forwarded by the launcher."""
    out = {}
    for line in stdout.splitlines():
        m = re.fullmatch(r"\[(\d+)\]<stdout>: (\w+)=(.*)", line)
        assert m, f"unexpected output line {line!r}"
        out.setdefault(int(m.group(1)), {})[m.group(2)] = m.group(3)
    return out


def pid_gone(pid, timeout=10.0):
    """True once ``pid`` no longer exists (or is a zombie nobody reaped yet)."""
    import psutil
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def read_pids(pid_dir, n, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(pid_dir.glob("*.pid"))
        if len(files) == n:
            return [int(p) for f in files for p in f.read_text().split()]
        time.sleep(0.05)
    raise AssertionError(f"only {len(list(pid_dir.glob('*.pid')))} of {n} ranks started")


# -- hosts and rank placement --------------------------------------------------------------

def test_parse_hosts():
    assert _hosts.parse_hosts("a:2,b:3") == [HostSlots("a", 2), HostSlots("b", 3)]
    assert _hosts.parse_hosts("a") == [HostSlots("a", 1)]
    assert _hosts.parse_hosts("a:1, b:2 ,a:1") == [HostSlots("a", 2), HostSlots("b", 2)]
    assert _hosts.parse_hosts("[::1]:2,::1") == [HostSlots("::1", 3)]
    assert _hosts.parse_hosts("10.0.0.1:4") == [HostSlots("10.0.0.1", 4)]
    for bad in ("a:0", "a:x", ":2", "", "[::1"):
        with pytest.raises(ValueError):
            _hosts.parse_hosts(bad)


def test_parse_hostfile(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# cluster\nnode1 slots=4\n\nnode2:2   # comment\nnode3\nnode4 slots=2 max_slots=8\n")
    assert _hosts.parse_hostfile(str(f)) == [
        HostSlots("node1", 4), HostSlots("node2", 2), HostSlots("node3", 1), HostSlots("node4", 2)]
    f.write_text("node1 cpus=4\n")
    with pytest.raises(ValueError, match="hosts:1: unknown hostfile token 'cpus=4'"):
        _hosts.parse_hostfile(str(f))
    f.write_text("# nothing\n")
    with pytest.raises(ValueError, match="lists no hosts"):
        _hosts.parse_hostfile(str(f))


def test_assign_ranks_host_major():
    slots = _hosts.assign_ranks(_hosts.parse_hosts("a:2,b:2"), 3)
    got = [(s.hostname, s.rank, s.size, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
           for s in slots]
    assert got == [
        ("a", 0, 3, 0, 2, 0, 2),
        ("a", 1, 3, 1, 2, 0, 1),  # only host a has a local rank 1 (Horovod's cross communicator)
        ("b", 2, 3, 0, 1, 1, 2),
    ]
    full = _hosts.assign_ranks(_hosts.parse_hosts("a:2,b:2,c:2"), 6)
    assert [(s.local_rank, s.cross_rank, s.cross_size) for s in full] == [
        (0, 0, 3), (1, 0, 3), (0, 1, 3), (1, 1, 3), (0, 2, 3), (1, 2, 3)]
    # Hosts beyond what np needs get no ranks and are not part of the job.
    few = _hosts.assign_ranks(_hosts.parse_hosts("a:2,b:2,c:2"), 2)
    assert {s.hostname for s in few} == {"a"} and all(s.cross_size == 1 for s in few)


def test_assign_ranks_errors():
    with pytest.raises(ValueError, match=r"-np 5 asks for more processes than there are slots "
                                         r"\(4\) on the hosts a:2,b:2"):
        _hosts.assign_ranks(_hosts.parse_hosts("a:2,b:2"), 5)
    with pytest.raises(ValueError, match="at least 1"):
        _hosts.assign_ranks(_hosts.parse_hosts("a:2"), 0)


def test_local_hosts():
    ids = frozenset({"myhost", "10.1.2.3"})
    for host in ("localhost", "127.0.0.1", "127.0.0.2", "::1", "myhost", "10.1.2.3"):
        assert _net.is_local_host(host, ids), host
    assert not _net.is_local_host("203.0.113.7", ids)
    assert _net.is_local_host(socket.gethostname())
    # The interfaces' addresses count as this machine (an unknown interface name is
    # test_network_interface's).
    assert _net.interface_addresses()["lo"] == "127.0.0.1"


def test_each_host_is_looked_up_once(monkeypatch):
    """The launcher decides once per host whether it is this machine (a name may need DNS):
    the rendezvous address, the bind addresses and the spawns share the answer."""
    from spark_hvd.runner import launch as _launch
    looked_up = []
    real = _net.is_local_host
    monkeypatch.setattr(_net, "is_local_host",
                        lambda host, *args: looked_up.append(host) or real(host, *args))
    assert _launch.main(["-H", "localhost:2,127.0.0.1:1", "true"]) == 0
    assert looked_up == ["localhost", "127.0.0.1"]


def test_bind_address_rules():
    assert _env.bind_address("127.0.0.2", True) == "127.0.0.2"
    assert _env.bind_address("127.0.0.2", False) == "127.0.0.2"
    assert _env.bind_address("localhost", True) == "127.0.0.1"
    assert _env.bind_address("localhost", False) == "0.0.0.0"
    assert _env.bind_address("remote", False) == "0.0.0.0"


def test_config_flags_to_env():
    args = build_parser().parse_args([
        "-np", "2", "--timeline-filename", "/tmp/t.json", "--fusion-threshold-mb", "32",
        "--cycle-time-ms", "2.5", "--stall-check-warning-time-seconds", "10",
        "--stall-check-shutdown-time-seconds", "60", "--no-stall-check", "--log-level", "debug",
        "--verbose", "--disable-cache", "--network-interface", "eth0", "python", "x.py"])
    assert _env.config_env(args) == {
        "SPARK_HVD_TIMELINE": "/tmp/t.json",
        "SPARK_HVD_FUSION_THRESHOLD": str(32 * 1024 * 1024),
        "SPARK_HVD_CYCLE_TIME": "2.5",
        "SPARK_HVD_STALL_CHECK_TIME_SECONDS": "10",
        "SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS": "60",
        "SPARK_HVD_STALL_CHECK_DISABLE": "1",
        "SPARK_HVD_LOG_LEVEL": "DEBUG",
        "SPARK_HVD_VERBOSE": "1",
        "SPARK_HVD_CACHE_CAPACITY": "0",
        "SPARK_HVD_NETWORK_INTERFACE": "eth0",
    }
    assert args.command == ["python", "x.py"]
    assert _env.config_env(build_parser().parse_args(["-np", "1", "true"])) == {}


# -- ssh command line ---------------------------------------------------------------------

SECRET_HEX = "ab" * 32


def test_ssh_command_line():
    env = {"SPARK_HVD_RANK": "3", "SPARK_HVD_SECRET": SECRET_HEX, "PATH": "/usr/bin",
           "HOME": "/home/me", "SSH_AUTH_SOCK": "/x", "BASH_FUNC_f%%": "() { :; }",
           "WEIRD": "a\nb", "QUOTED": "it's $HOME"}
    argv = _spawn.ssh_command("node7", ["python", "train.py", "--lr", "0.1 x"], env,
                              "/work dir", port=2222, identity_file="/k/id", connect_timeout=30)
    assert argv[:7] == ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o",
                        "LogLevel=ERROR"]
    assert argv[7:13] == ["-o", "ConnectTimeout=30", "-p", "2222", "-i", "/k/id"]
    assert argv[13] == "node7"
    remote = argv[14]
    assert SECRET_HEX not in " ".join(argv)  # never on a command line
    assert remote.startswith("sh -c ")
    assert "SPARK_HVD_RANK=3" in remote and "PATH=/usr/bin" in remote
    for dropped in ("HOME=", "SSH_AUTH_SOCK", "BASH_FUNC", "WEIRD"):
        assert dropped not in remote
    assert _spawn.forwardable_env(env) == {"SPARK_HVD_RANK": "3", "PATH": "/usr/bin",
                                           "QUOTED": "it's $HOME"}


@pytest.mark.timeout(30)
def test_remote_script_runs_under_sh(tmp_path):
    """The remote half of an ssh launch, run here through sh: it takes the secret from stdin,
    sets the environment, runs in the given directory, and stops the rank when stdin closes."""
    env = {"SPARK_HVD_RANK": "1", "QUOTED": "it's $HOME", "PATH": os.environ["PATH"]}
    code = ("import os; print(os.getcwd(), os.environ['SPARK_HVD_RANK'], "
            "os.environ['QUOTED'], os.environ['SPARK_HVD_SECRET'])")
    script = _spawn.remote_script([PY, "-c", code], env, str(tmp_path))
    # Like ssh, keep stdin open while the rank runs: its closing means "stop".
    proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    proc.stdin.write(SECRET_HEX + "\n")
    proc.stdin.flush()
    out = proc.stdout.read()
    assert proc.wait(timeout=20) == 0
    proc.stdin.close()
    assert out.split() == [str(tmp_path), "1", "it's", "$HOME", SECRET_HEX]

    pid_file = tmp_path / "pid"
    code = (f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
            "time.sleep(1000)")
    proc = subprocess.Popen(["sh", "-c", _spawn.remote_script([PY, "-c", code], env,
                                                              str(tmp_path))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.stdin.write((SECRET_HEX + "\n").encode())
    proc.stdin.flush()
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.stdin.close()  # what happens when the launcher goes away
    assert proc.wait(timeout=10) != 0
    assert pid_gone(int(pid_file.read_text()))


# -- end to end ---------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("np", [2, 3])
def test_ranks_get_their_environment(np):
    done = launch(["-np", str(np), PY, str(SCRIPTS / "env_dump.py")])
    assert done.returncode == 0, done.stderr
    ranks = rank_values(done.stdout)
    assert sorted(ranks) == list(range(np))
    job_ids = {v["SPARK_HVD_JOB_ID"] for v in ranks.values()}
    secrets_ = {v["SPARK_HVD_SECRET"] for v in ranks.values()}
    addrs = {v["SPARK_HVD_RENDEZVOUS_ADDR"] for v in ranks.values()}
    assert len(job_ids) == len(secrets_) == len(addrs) == 1
    assert re.fullmatch(r"[0-9a-f]{64}", secrets_.pop())
    assert re.fullmatch(r"127\.0\.0\.1:\d+", addrs.pop())
    for r, v in ranks.items():
        assert v["SPARK_HVD_RANK"] == str(r)
        assert v["SPARK_HVD_SIZE"] == str(np)
        assert v["SPARK_HVD_LOCAL_RANK"] == str(r)
        assert v["SPARK_HVD_LOCAL_SIZE"] == str(np)
        assert v["SPARK_HVD_CROSS_RANK"] == "0"
        assert v["SPARK_HVD_CROSS_SIZE"] == "1"
        assert v["SPARK_HVD_HOSTNAME"] == "localhost"
        assert v["SPARK_HVD_BIND_ADDR"] == "127.0.0.1"
        assert v["SPARK_HVD_START_TIMEOUT"] == "30"
        assert v["PYTHONUNBUFFERED"] == "1"
        assert v["SPARK_HVD_FUSION_THRESHOLD"] == "<unset>"
    # Each rank's lines come out whole and in order.
    assert done.stdout.splitlines()[0].startswith("[")


@pytest.mark.timeout(60)
def test_two_simulated_hosts():
    done = launch(["-H", "127.0.0.1:1,127.0.0.2:1", PY, str(SCRIPTS / "env_dump.py")])
    assert done.returncode == 0, done.stderr
    ranks = rank_values(done.stdout)
    assert [ranks[r]["SPARK_HVD_HOSTNAME"] for r in (0, 1)] == ["127.0.0.1", "127.0.0.2"]
    assert [ranks[r]["SPARK_HVD_BIND_ADDR"] for r in (0, 1)] == ["127.0.0.1", "127.0.0.2"]
    for r in (0, 1):
        assert ranks[r]["SPARK_HVD_SIZE"] == "2"
        assert ranks[r]["SPARK_HVD_LOCAL_RANK"] == "0"
        assert ranks[r]["SPARK_HVD_LOCAL_SIZE"] == "1"
        assert ranks[r]["SPARK_HVD_CROSS_RANK"] == str(r)
        assert ranks[r]["SPARK_HVD_CROSS_SIZE"] == "2"


@pytest.mark.timeout(60)
def test_config_flags_reach_ranks(tmp_path):
    done = launch(["-np", "1", "--timeline-filename", "tl.json", "--fusion-threshold-mb", "8",
                   "--cycle-time-ms", "3", "--stall-check-warning-time-seconds", "20",
                   "--stall-check-shutdown-time-seconds", "90", "--no-stall-check",
                   "--log-level", "WARNING", "--verbose", "--disable-cache", "--start-timeout",
                   "45", "--network-interface", "lo", "--gloo", "--autotune",
                   PY, str(SCRIPTS / "env_dump.py")])
    assert done.returncode == 0, done.stderr
    v = rank_values(done.stdout)[0]
    assert v["SPARK_HVD_TIMELINE"] == "tl.json"
    assert v["SPARK_HVD_FUSION_THRESHOLD"] == str(8 * 1024 * 1024)
    assert v["SPARK_HVD_CYCLE_TIME"] == "3"
    assert v["SPARK_HVD_STALL_CHECK_TIME_SECONDS"] == "20"
    assert v["SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS"] == "90"
    assert v["SPARK_HVD_STALL_CHECK_DISABLE"] == "1"
    assert v["SPARK_HVD_LOG_LEVEL"] == "WARNING"
    assert v["SPARK_HVD_VERBOSE"] == "1"
    assert v["SPARK_HVD_CACHE_CAPACITY"] == "0"
    assert v["SPARK_HVD_START_TIMEOUT"] == "45"
    assert v["SPARK_HVD_NETWORK_INTERFACE"] == "lo"
    assert v["SPARK_HVD_BIND_ADDR"] == "127.0.0.1"
    assert v["SPARK_HVD_AUTOTUNE"] == "1"
    assert "rank 0 on localhost locally" in done.stderr  # --verbose explains the plan
    assert v["SPARK_HVD_SECRET"] not in done.stderr


@pytest.mark.timeout(60)
def test_start_timeout_from_environment():
    done = launch(["-np", "1", PY, str(SCRIPTS / "env_dump.py")], SPARK_HVD_START_TIMEOUT="12")
    assert rank_values(done.stdout)[0]["SPARK_HVD_START_TIMEOUT"] == "12"


@pytest.mark.timeout(60)
def test_allgather_through_launcher_rendezvous():
    done = launch(["-np", "3", PY, str(SCRIPTS / "allgather.py")])
    assert done.returncode == 0, done.stderr
    lines = sorted(done.stdout.splitlines())
    assert lines == [f"[{r}]<stdout>: allgather 0,1,2 r0,r10,r20" for r in range(3)]


@pytest.mark.timeout(60)
def test_output_lines_are_whole_and_files_written(tmp_path):
    out_dir = tmp_path / "logs"
    done = launch(["-np", "3", "--output-filename", str(out_dir), PY, str(SCRIPTS / "chatty.py")])
    assert done.returncode == 0, done.stderr
    for stream, text in (("stdout", done.stdout), ("stderr", done.stderr)):
        lines = text.splitlines()
        for line in lines:
            m = re.fullmatch(rf"\[(\d)\]<{stream}>: (.*)", line)
            assert m, line[:80]
            if m.group(2) != "no newline at the end":
                assert m.group(2) == m.group(1) * 3000
        for r in range(3):
            assert sum(line.startswith(f"[{r}]") for line in lines) == 200 + (stream == "stdout")
    for r in range(3):
        raw = (out_dir / f"rank.{r}" / "stdout").read_text().splitlines()
        assert raw[:200] == [str(r) * 3000] * 200 and raw[200] == "no newline at the end"
        assert (out_dir / f"rank.{r}" / "stderr").read_text() == (str(r) * 3000 + "\n") * 200


@pytest.mark.timeout(60)
def test_prefix_timestamp():
    done = launch(["-np", "1", "--prefix-timestamp", "sh", "-c", "echo hello"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \[0\]<stdout>: hello\n",
                        done.stdout)


@pytest.mark.timeout(60)
def test_failing_rank_stops_the_job(tmp_path):
    start = time.monotonic()
    proc = subprocess.Popen(
        [PY, "-m", "spark_hvd.runner", "-np", "3", PY, str(SCRIPTS / "pid_and_wait.py"),
         str(tmp_path), "--fail-rank", "1", "--code", "3", "--child"],
        cwd=REPO, env=_env_for_launcher(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 3, err
    assert time.monotonic() - start < 15
    assert "spark-hvd-run: rank 1 exited with code 3" in err
    assert "[1]<stderr>: rank 1 failing with 3" in err
    pids = read_pids(tmp_path, 3)
    assert len(pids) == 6  # each rank and its child
    for pid in pids:
        assert pid_gone(pid), f"process {pid} survived the job"


@pytest.mark.timeout(60)
def test_sigkill_after_grace_for_ranks_ignoring_sigterm(tmp_path):
    proc = subprocess.Popen(
        [PY, "-m", "spark_hvd.runner", "-np", "2", PY, str(SCRIPTS / "pid_and_wait.py"),
         str(tmp_path), "--fail-rank", "0", "--code", "5", "--ignore-term"],
        cwd=REPO, env=_env_for_launcher(SPARK_HVD_KILL_GRACE_SECONDS="1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 5, err
    for pid in read_pids(tmp_path, 2):
        assert pid_gone(pid)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_to_launcher_stops_ranks(tmp_path, sig):
    proc = subprocess.Popen(
        [PY, "-m", "spark_hvd.runner", "-np", "2", PY, str(SCRIPTS / "pid_and_wait.py"),
         str(tmp_path), "--child"],
        cwd=REPO, env=_env_for_launcher(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    pids = read_pids(tmp_path, 2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + sig, err
    assert f"received {signal.Signals(sig).name}" in err
    for pid in pids:
        assert pid_gone(pid), f"process {pid} survived the job"


@pytest.mark.timeout(60)
def test_command_line_errors(tmp_path):
    done = launch(["--mpi", "--gloo", "-np", "2", "true"])
    assert done.returncode == 2 and "not allowed with argument" in done.stderr
    done = launch(["-np", "3", "-H", "localhost:2", "true"])
    assert done.returncode == 2 and "more processes than there are slots" in done.stderr
    done = launch(["-np", "2"])
    assert done.returncode == 2 and "no COMMAND given" in done.stderr
    done = launch(["true"])
    assert done.returncode == 2 and "-np is required" in done.stderr
    done = launch(["-np", "1", "--network-interface", "no-such-if0", "true"])
    assert done.returncode == 2 and "no-such-if0" in done.stderr
    done = launch(["-np", "2", str(tmp_path / "no-such-program")])
    assert done.returncode == 127 and "cannot start rank 0 on localhost" in done.stderr


@pytest.mark.timeout(60)
def test_check_build():
    done = launch(["--check-build"])
    assert done.returncode == 0, done.stderr
    assert "Available frameworks:" in done.stdout
    assert "[X] PyTorch" in done.stdout  # torch is in the test environment


@pytest.mark.timeout(60)
def test_hostfile_and_exit_code_zero(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1 slots=2\n127.0.0.3:1\n")
    done = launch(["--hostfile", str(hostfile), PY, str(SCRIPTS / "env_dump.py")])
    assert done.returncode == 0, done.stderr
    ranks = rank_values(done.stdout)
    assert [ranks[r]["SPARK_HVD_HOSTNAME"] for r in range(3)] == [
        "127.0.0.1", "127.0.0.1", "127.0.0.3"]
    assert [ranks[r]["SPARK_HVD_LOCAL_RANK"] for r in range(3)] == ["0", "1", "0"]


@pytest.fixture
def fake_ssh(tmp_path):
    """A stand-in ``ssh`` on PATH that runs the remote command on this machine, in a session of
    its own (as on a real remote host, signals to the local ssh process do not reach it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "ssh.log"
    ssh = bin_dir / "ssh"
    ssh.write_text(f"""#!/bin/sh
echo "$@" >> {log}
while [ $# -gt 0 ]; do
  case "$1" in -o|-p|-i) shift 2 ;; *) break ;; esac
done
shift  # the host
exec setsid -w sh -c "$*"
""")
    ssh.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "log": log}


@pytest.mark.timeout(60)
def test_remote_ranks_over_ssh(fake_ssh, tmp_path):
    # 203.0.113.0/24 is TEST-NET-3: never this machine, so the launcher takes the ssh path.
    done = launch(["-H", "203.0.113.1:2", "-p", "2222", "--network-interface", "lo",
                   PY, str(SCRIPTS / "env_dump.py")], PATH=fake_ssh["PATH"])
    assert done.returncode == 0, done.stderr
    ranks = rank_values(done.stdout)
    assert sorted(ranks) == [0, 1]
    for r, v in ranks.items():
        assert v["SPARK_HVD_RANK"] == str(r) and v["SPARK_HVD_LOCAL_RANK"] == str(r)
        assert v["SPARK_HVD_HOSTNAME"] == "203.0.113.1"
        assert v["SPARK_HVD_BIND_ADDR"] == "0.0.0.0"
        assert v["SPARK_HVD_NETWORK_INTERFACE"] == "lo"
        # This machine runs no rank, so the rendezvous listens on all interfaces and the host
        # reaches it at this machine's address on the route to it (lo names the hosts' network).
        route = _net.route_address("203.0.113.1")
        assert re.fullmatch(re.escape(route) + r":\d+", v["SPARK_HVD_RENDEZVOUS_ADDR"])
        assert re.fullmatch(r"[0-9a-f]{64}", v["SPARK_HVD_SECRET"])  # arrived through stdin
    calls = fake_ssh["log"].read_text()
    assert "203.0.113.1" in calls and "-p 2222" in calls and "BatchMode=yes" in calls
    assert ranks[0]["SPARK_HVD_SECRET"] not in calls


@pytest.mark.timeout(60)
def test_remote_rank_failure_stops_remote_ranks(fake_ssh, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    done = launch(["-H", "203.0.113.1:2", "--network-interface", "lo", PY,
                   str(SCRIPTS / "pid_and_wait.py"), str(pid_dir), "--fail-rank", "0",
                   "--code", "4", "--child"], PATH=fake_ssh["PATH"])
    assert done.returncode == 4, done.stderr
    assert "rank 0 on 203.0.113.1 exited with code 4" in done.stderr
    for pid in read_pids(pid_dir, 2):
        assert pid_gone(pid), f"remote process {pid} survived the job"
