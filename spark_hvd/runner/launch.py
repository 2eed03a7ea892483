"""``spark-hvd-run``: start a job's ranks on one or more hosts and supervise them.

    spark-hvd-run -np 4 -H host1:2,host2:2 python train.py

Flags follow Horovod's ``horovodrun``. The launcher places ranks host-major, starts a rendezvous
server the ranks use to find each other, gives every rank the bootstrap environment, prefixes
each output line with its rank, and stops the whole job as soon as one rank fails.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import threading
import time

from spark_hvd.common._rendezvous import RendezvousServer
from spark_hvd.common._secret import make_secret, secret_to_env
from spark_hvd.runner import _env, _hosts, _net
from spark_hvd.runner._output import LineSink, forward
from spark_hvd.runner._spawn import spawn
from spark_hvd.runner._supervise import DEFAULT_GRACE_SECONDS, Supervisor

PROG = "spark-hvd-run"
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
MPI_UNSUPPORTED = (f"{PROG}: MPI support is not built in this version; use the default TCP "
                   "transport (--gloo)")
DEFAULT_START_TIMEOUT = 30.0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``spark-hvd-run`` (Horovod's ``horovodrun`` flag names)."""
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        usage=f"{PROG} -np N [-H host:slots,...|--hostfile F] [options] COMMAND...",
        description="Run COMMAND as a data-parallel spark_hvd job of N ranks.")
    p.add_argument("-np", "--num-proc", dest="np", type=int, metavar="N",
                   help="number of ranks (default: all slots of the hosts given)")
    p.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                   help="hosts and their slots (default: localhost:N)")
    p.add_argument("--hostfile", metavar="FILE",
                   help="file of hosts, one a line: 'host slots=N' or 'host:N'")
    p.add_argument("-p", "--ssh-port", type=int, metavar="PORT", help="ssh port of remote hosts")
    p.add_argument("-i", "--ssh-identity-file", metavar="FILE", help="ssh private key")
    p.add_argument("--start-timeout", type=float, metavar="S",
                   help="seconds the ranks wait for each other at start-up (default: "
                        "$SPARK_HVD_START_TIMEOUT or 30)")
    p.add_argument("--network-interface", metavar="IF",
                   help="network interface (e.g. eth0) for the job's traffic")
    p.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's output to DIR/rank.N/stdout and stderr")
    p.add_argument("--prefix-timestamp", "--prefix-output-with-timestamp", action="store_true",
                   help="put the time in front of each output line")
    p.add_argument("--verbose", action="store_true", help="explain what the launcher does")
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                   help="log level of the ranks' core")
    p.add_argument("--check-build", action="store_true",
                   help="show the frameworks and transports available, then exit")
    transport = p.add_mutually_exclusive_group()
    transport.add_argument("--gloo", action="store_true",
                           help="use the built-in TCP/shared-memory transport (the default)")
    transport.add_argument("--mpi", action="store_true", help="use MPI (not available)")
    tuning = p.add_argument_group("tuning (passed to the ranks as SPARK_HVD_* variables)")
    tuning.add_argument("--timeline-filename", metavar="FILE",
                        help="write a Chrome-trace timeline of all tensor operations to FILE")
    tuning.add_argument("--fusion-threshold-mb", type=float, metavar="MB",
                        help="fusion buffer size in MiB")
    tuning.add_argument("--cycle-time-ms", type=float, metavar="MS",
                        help="burst window: ops submitted within it are negotiated together")
    tuning.add_argument("--stall-check-warning-time-seconds", type=float, metavar="S",
                        help="warn when some ranks wait for a tensor longer than this")
    tuning.add_argument("--stall-check-shutdown-time-seconds", type=float, metavar="S",
                        help="stop the job when a stall lasts longer than this")
    tuning.add_argument("--no-stall-check", action="store_true", help="disable stall checks")
    tuning.add_argument("--disable-cache", action="store_true",
                        help="disable the response cache")
    tuning.add_argument("--autotune", action="store_true",
                        help="autotune fusion parameters (not implemented yet: ignored)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND...",
                   help="the program each rank runs, with its arguments")
    return p


def _start_timeout(args: argparse.Namespace) -> float:
    if args.start_timeout is not None:
        return args.start_timeout
    for name in ("SPARK_HVD_START_TIMEOUT", "HOROVOD_START_TIMEOUT"):
        if os.environ.get(name):
            try:
                return float(os.environ[name])
            except ValueError:
                raise ValueError(f"{name}={os.environ[name]!r} is not a number of seconds")
    return DEFAULT_START_TIMEOUT


def plan_hosts(args: argparse.Namespace) -> list[_hosts.SlotInfo]:
    """Hosts from -H / --hostfile (default localhost:np) and the rank placement on them."""
    if args.hosts and args.hostfile:
        raise ValueError("give hosts with -H or with --hostfile, not both")
    if args.hosts:
        hosts = _hosts.parse_hosts(args.hosts)
    elif args.hostfile:
        hosts = _hosts.parse_hostfile(args.hostfile)
    elif args.np is not None:
        hosts = [_hosts.HostSlots("localhost", max(args.np, 1))]
    else:
        raise ValueError("-np is required when no hosts are given (-H or --hostfile)")
    np = args.np if args.np is not None else sum(h.slots for h in hosts)
    return _hosts.assign_ranks(hosts, np)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``spark-hvd-run`` and ``python -m spark_hvd.runner``; returns the exit
    code: 0 when every rank exited 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.check_build:
        from spark_hvd.runner._check_build import check_build_report
        print(check_build_report())
        return 0
    if args.mpi:
        print(MPI_UNSUPPORTED, file=sys.stderr)
        return 2
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND given (e.g. spark-hvd-run -np 2 python train.py)")
    if args.autotune:
        print(f"{PROG}: --autotune: autotuning is not implemented yet; continuing with the "
              "configured fusion threshold and cycle time", file=sys.stderr)
    try:
        slots = plan_hosts(args)
        start_timeout = _start_timeout(args)
        interface_ip = (_net.interface_ipv4(args.network_interface.split(",")[0].strip())
                        if args.network_interface else None)
        if args.output_filename:
            os.makedirs(args.output_filename, exist_ok=True)
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return _Job(args, command, slots, start_timeout, interface_ip).run()


class _Job:
    """One launch: rendezvous server, ranks, output forwarding, supervision."""

    def __init__(self, args, command, slots, start_timeout, interface_ip):
        self.args = args
        self.command = command
        self.slots = slots
        self.start_timeout = start_timeout
        self.interface_ip = interface_ip
        self.out = LineSink(sys.stdout)
        self.err = LineSink(sys.stderr)
        grace = float(os.environ.get("SPARK_HVD_KILL_GRACE_SECONDS", DEFAULT_GRACE_SECONDS))
        self.supervisor = Supervisor(self.log, grace_seconds=grace)
        local = {}
        for s in slots:
            if s.hostname not in local:
                local[s.hostname] = _net.is_local_host(s.hostname)
        self.is_local = local
        self.all_local = all(local.values())

    def log(self, message: str) -> None:
        self.err.write_line(f"{PROG}: {message}\n".encode())

    def _rendezvous_addresses(self) -> tuple[str, str]:
        """(bind host, address the ranks connect to) of the rendezvous server."""
        if self.interface_ip:
            return self.interface_ip, self.interface_ip
        if self.all_local:
            return "127.0.0.1", "127.0.0.1"
        first_remote = next(h for h, local in self.is_local.items() if not local)
        return "0.0.0.0", _net.route_address(first_remote)

    def run(self) -> int:
        secret = make_secret()
        job_id = secrets.token_hex(4)
        bind_host, advertised = self._rendezvous_addresses()
        server = RendezvousServer(secret, bind_host=bind_host)
        port = server.start()
        rendezvous_addr = f"[{advertised}]:{port}" if ":" in advertised else f"{advertised}:{port}"
        restore = self._install_signal_handlers()
        try:
            if self.args.verbose:
                self.log(f"job {job_id}: {len(self.slots)} rank(s), rendezvous at "
                         f"{rendezvous_addr}")
            config = _env.config_env(self.args)
            for slot in self.slots:
                if not self._start_rank(slot, rendezvous_addr, secret_to_env(secret), job_id,
                                        config):
                    break
            code = self.supervisor.run()
            self._drain_output()
            return code
        finally:
            restore()
            server.stop()

    def _start_rank(self, slot, rendezvous_addr, secret_hex, job_id, config) -> bool:
        host = slot.hostname
        local = self.is_local[host]
        bind_addr = _env.bind_address(host, local, self.all_local, self.interface_ip)
        env = _env.rank_env(dict(os.environ), slot, rendezvous_addr=rendezvous_addr,
                            secret_hex=secret_hex, job_id=job_id, bind_addr=bind_addr,
                            start_timeout=self.start_timeout, config=config)
        if self.args.verbose:
            how = "locally" if local else "over ssh"
            self.log(f"rank {slot.rank} on {host} {how} (local rank {slot.local_rank}/"
                     f"{slot.local_size}, cross rank {slot.cross_rank}/{slot.cross_size}, "
                     f"bind {bind_addr})")
        try:
            proc = spawn(slot.rank, host, self.command, env, os.getcwd(), remote=not local,
                         ssh_port=self.args.ssh_port,
                         ssh_identity_file=self.args.ssh_identity_file,
                         connect_timeout=self.start_timeout)
        except OSError as e:
            self.log(f"cannot start rank {slot.rank} on {host}: {e}")
            self.supervisor.fail(127 if isinstance(e, FileNotFoundError) else 1)
            return False
        ts = self.args.prefix_timestamp
        out_dir = self.args.output_filename
        proc.output_threads = [
            forward(proc.popen.stdout, slot.rank, "stdout", self.out, out_dir, ts),
            forward(proc.popen.stderr, slot.rank, "stderr", self.err, out_dir, ts),
        ]
        self.supervisor.add(proc)
        return True

    def _drain_output(self, timeout: float = 5.0) -> None:
        """Wait for the ranks' last lines. A process that escaped its rank's group may still
        hold a pipe open: give up on it after ``timeout``."""
        deadline = time.monotonic() + timeout
        for proc in self.supervisor.ranks:
            for t in proc.output_threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return lambda: None  # only the main thread may handle signals
        # SIGHUP too: a closed terminal should stop the job cleanly, not orphan the ranks.
        sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        old = {s: signal.signal(s, self.supervisor.handle_signal) for s in sigs}

        def restore() -> None:
            for s, handler in old.items():
                signal.signal(s, handler)
        return restore


if __name__ == "__main__":
    sys.exit(main())
