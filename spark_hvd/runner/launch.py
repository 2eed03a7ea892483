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
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

from spark_hvd import __version__
from spark_hvd.common import _bootstrap_contract as contract
from spark_hvd.common._config import AUTOTUNE_BOUNDS, autotune_bound_broken
from spark_hvd.common._network import interface_setting, pinned_interface_address
from spark_hvd.common._rendezvous import RendezvousServer
from spark_hvd.common._secret import make_secret, secret_to_env
from spark_hvd.launch import hosts as _hosts
from spark_hvd.launch import net as _net
from spark_hvd.launch.environment import rank_env
from spark_hvd.launch.output import LineSink, forward
from spark_hvd.launch.spawn import spawn
from spark_hvd.launch.supervise import DEFAULT_GRACE_SECONDS, Supervisor
from spark_hvd.runner import _env

PROG = "spark-hvd-run"
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")  # Horovod's, low to high
DEFAULT_LOG_LEVEL = "WARNING"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``spark-hvd-run`` (Horovod's ``horovodrun`` flag names)."""
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        usage=f"{PROG} -np N [-H host:slots,...|--hostfile F] [options] COMMAND...",
        description="Run COMMAND as a data-parallel spark_hvd job of N ranks.")
    p.add_argument("-v", "--version", action="version", version=f"%(prog)s {__version__}",
                   help="show the version and exit")
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
    p.add_argument("--gloo-timeout-seconds", type=float, metavar="S",
                   help="Horovod's Gloo timeout: here the start timeout, when --start-timeout "
                        "is not given")
    p.add_argument("--network-interfaces", "--network-interface", dest="network_interface",
                   metavar="IF[,IF...]",
                   help="network interface(s) (e.g. eth0) for the job's traffic: every rank "
                        "binds to and advertises its own host's address on the first of them "
                        "that host has (sets SPARK_HVD_NETWORK_INTERFACE); the rendezvous "
                        "binds to it too when this machine runs ranks")
    p.add_argument("--config-file", metavar="FILE",
                   help="Horovod's YAML configuration file (params, timeline, stall_check, "
                        "library_options, logging, autotune, controller); flags given on the "
                        "command line win over it")
    p.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's output to DIR/rank.N/stdout and stderr")
    p.add_argument("--prefix-timestamp", "--prefix-output-with-timestamp", action="store_true",
                   help="put the time in front of each output line")
    p.add_argument("--verbose", action="store_true",
                   help="explain what the launcher does (its INFO messages)")
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                   help="log level of the launcher and of the ranks' Python side and native "
                        "core (default: $SPARK_HVD_LOG_LEVEL, $HOROVOD_LOG_LEVEL or WARNING)")
    p.add_argument("--check-build", action="store_true",
                   help="show the frameworks and transports available, then exit")
    transport = p.add_mutually_exclusive_group()
    transport.add_argument("--gloo", action="store_true",
                           help="use the built-in TCP/shared-memory transport (the default)")
    transport.add_argument("--mpi", action="store_true",
                           help="start the ranks with Open MPI's mpirun and run CPU "
                           "collectives through MPI (needs mpi4py and the MPI plugin)")
    p.add_argument("--mpi-args", metavar="ARGS",
                   help="with --mpi: extra arguments for mpirun, e.g. \"--mca btl self,vader,tcp\"")
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
    stall = tuning.add_mutually_exclusive_group()
    stall.add_argument("--no-stall-check", action="store_true", default=None,
                       help="disable stall checks")
    stall.add_argument("--stall-check", dest="no_stall_check", action="store_false",
                       help="enable stall checks (the default)")
    tuning.add_argument("--disable-cache", action="store_true", default=None,
                        help="disable the response cache")
    tuning.add_argument("--cache-capacity", type=int, metavar="N",
                        help="entries of the response cache (0 disables it)")
    cycles = tuning.add_mutually_exclusive_group()
    cycles.add_argument("--timeline-mark-cycles", action="store_true", default=None,
                        help="mark the start of every engine cycle in the timeline")
    cycles.add_argument("--no-timeline-mark-cycles", dest="timeline_mark_cycles",
                        action="store_false")
    for op in ("allreduce", "allgather"):
        group = tuning.add_mutually_exclusive_group()
        group.add_argument(f"--hierarchical-{op}", action="store_true", default=None,
                           help=f"hierarchical {op} (within each host, then across hosts) "
                                "wherever a process set spans hosts; --no-hierarchical-"
                                f"{op}: never; neither: automatic")
        group.add_argument(f"--no-hierarchical-{op}", dest=f"hierarchical_{op}",
                           action="store_false")
    torus = tuning.add_mutually_exclusive_group()
    torus.add_argument("--torus-allreduce", action="store_true", default=None,
                       help="Horovod's torus allreduce: accepted, but currently no effect")
    torus.add_argument("--no-torus-allreduce", dest="torus_allreduce", action="store_false")
    tuning.add_argument("--autotune", action="store_true", default=None,
                        help="tune the fusion threshold, cycle time, response cache and "
                             "hierarchical switches while training runs (settings given "
                             "explicitly stay fixed)")
    for flag, kind, metavar, text in (
            ("log-file", str, "FILE", "CSV of every sample (its settings and score), rank 0"),
            ("warmup-samples", int, "N", "samples measured but discarded first (default 3)"),
            ("steps-per-sample", int, "N", "steps in each sample (default 10)"),
            ("bayes-opt-max-samples", int, "N", "samples before the best setting is kept "
                                                "(default 20)"),
            ("gaussian-process-noise", float, "X", "noise of the model, relative to the "
                                                   "scores' spread (default 0.8)")):
        tuning.add_argument("--autotune-" + flag, type=kind, metavar=metavar,
                            help="autotune: " + text)
    elastic = p.add_argument_group(
        "elastic training (with --min-np or --host-discovery-script: the job survives lost "
        "processes and hosts, and grows and shrinks with the hosts discovery lists)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_num_proc", type=int,
                         metavar="N", help="fewest processes to keep training with (default: "
                         "-np); fewer for --elastic-timeout ends the job")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_num_proc", type=int,
                         metavar="N", help="most processes to use (default: every slot "
                         "discovered)")
    elastic.add_argument("--slots-per-host", "--slots", dest="slots", type=int, metavar="N",
                         help="slots of a host the discovery script lists without them")
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT",
                         help="executable printing the available hosts, one 'host:slots' a "
                              "line; run every second")
    elastic.add_argument("--elastic-timeout", type=float, metavar="S",
                         help="seconds the job may wait to re-form (enough processes, a "
                              "frozen member) before it fails (default: "
                              "$SPARK_HVD_ELASTIC_TIMEOUT, $HOROVOD_ELASTIC_TIMEOUT or 600)")
    elastic.add_argument("--reset-limit", type=int, metavar="N",
                         help="fail the job at the N+1-th reset (default: no limit)")
    elastic.add_argument("--blacklist-cooldown-range", dest="cooldown_range", type=int,
                         nargs=2, metavar=("MIN", "MAX"),
                         help="seconds a host that lost a process stays out: MIN doubling per "
                              "failure up to MAX (default 10 600; 1 <= MIN <= MAX <= 3600)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND...",
                   help="the program each rank runs, with its arguments")
    return p


def _start_timeout(args: argparse.Namespace) -> float:
    """--start-timeout, else --gloo-timeout-seconds (Horovod's bound on Gloo's set-up), else
    the same two from the environment, else 30 s."""
    for value in (args.start_timeout, args.gloo_timeout_seconds):
        if value is not None:
            return value
    return contract.start_timeout()


def log_threshold(args: argparse.Namespace) -> str:
    """The launcher's log level: --log-level, else $SPARK_HVD_LOG_LEVEL / $HOROVOD_LOG_LEVEL
    (an unknown name counts as the default), else WARNING; --verbose shows INFO messages
    whatever the level."""
    level = args.log_level
    if level is None and contract.setting("LOG_LEVEL") is not None:
        value = contract.setting("LOG_LEVEL").strip().upper()
        level = value if value in LOG_LEVELS else DEFAULT_LOG_LEVEL
    level = level or DEFAULT_LOG_LEVEL
    if args.verbose and LOG_LEVELS.index(level) > LOG_LEVELS.index("INFO"):
        level = "INFO"
    return level


def log_enabled(threshold: str, level: str) -> bool:
    """True when a message of ``level`` passes ``threshold``."""
    return LOG_LEVELS.index(level) >= LOG_LEVELS.index(threshold)


# Horovod's --config-file (horovod/runner/common/util/config_parser.py): section -> key ->
# (argument it sets, conversion). A flag given on the command line wins over the file.
def _flag(value):
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in ("1", "true", "yes", "on"):
        return True
    if str(value).strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not true or false")


def _level(value):
    value = str(value).strip().upper()
    if value not in LOG_LEVELS:
        raise ValueError(f"{value!r} is not one of {', '.join(LOG_LEVELS)}")
    return value


_CONFIG_KEYS = {
    "params": {"fusion_threshold_mb": ("fusion_threshold_mb", float),
               "cycle_time_ms": ("cycle_time_ms", float),
               "cache_capacity": ("cache_capacity", int),
               "hierarchical_allreduce": ("hierarchical_allreduce", _flag),
               "hierarchical_allgather": ("hierarchical_allgather", _flag),
               "torus_allreduce": ("torus_allreduce", _flag)},
    "autotune": {"enabled": ("autotune", _flag),
                 "log_file": ("autotune_log_file", str),
                 "warmup_samples": ("autotune_warmup_samples", int),
                 "steps_per_sample": ("autotune_steps_per_sample", int),
                 "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", int),
                 "gaussian_process_noise": ("autotune_gaussian_process_noise", float)},
    "timeline": {"filename": ("timeline_filename", str),
                 "mark_cycles": ("timeline_mark_cycles", _flag)},
    "stall_check": {"enabled": ("no_stall_check", lambda v: not _flag(v)),
                    "warning_time_seconds": ("stall_check_warning_time_seconds", float),
                    "shutdown_time_seconds": ("stall_check_shutdown_time_seconds", float)},
    "library_options": {"gloo_timeout_seconds": ("gloo_timeout_seconds", float)},
    "logging": {"level": ("log_level", _level)},
}
# Keys of Horovod's file that spark_hvd has no use for, and why (the launcher says so).
_CONFIG_UNSUPPORTED = {
    ("library_options", "mpi_threads_disable"): "MPI is not used as a transport",
    ("library_options", "num_nccl_streams"): "the core runs NCCL on one stream per device",
    ("library_options", "thread_affinity"): "thread pinning is not implemented; use taskset",
    ("logging", "with_timestamp"): "log lines carry no time stamp (use --prefix-timestamp)",
}
_NUMERIC_MINIMUM = {"fusion_threshold_mb": 0, "cycle_time_ms": 0, "cache_capacity": 0,
                    "stall_check_warning_time_seconds": 0,
                    "stall_check_shutdown_time_seconds": 0, "gloo_timeout_seconds": 0}


def apply_config_file(args: argparse.Namespace, path: str) -> list[str]:
    """Fills the arguments not given on the command line from Horovod's YAML config file at
    ``path``; returns notes about keys it ignores. Raises ValueError for a malformed file or
    a value of the wrong type, and for ``controller: mpi``."""
    try:
        import yaml
    except ImportError:
        raise ValueError("--config-file needs PyYAML: pip install pyyaml") from None
    try:
        with open(path) as f:
            config = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config-file {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config-file {path}: expected a mapping of sections at the top")
    notes = []
    for section, body in config.items():
        if section == "controller":
            if str(body).lower() == "mpi":
                raise ValueError(f"--config-file {path}: controller: mpi is not supported; "
                                 "use gloo (spark_hvd's own TCP/shared-memory transport)")
            if str(body).lower() != "gloo":
                raise ValueError(f"--config-file {path}: unknown controller {body!r}")
            continue
        if section not in _CONFIG_KEYS:
            notes.append(f"--config-file {path}: unknown section {section!r} ignored")
            continue
        if not isinstance(body, dict):
            raise ValueError(f"--config-file {path}: section {section!r} must be a mapping")
        for key, value in body.items():
            if (section, key) in _CONFIG_UNSUPPORTED:
                notes.append(f"--config-file {path}: {section}.{key} ignored: "
                             f"{_CONFIG_UNSUPPORTED[section, key]}")
                continue
            if key not in _CONFIG_KEYS[section]:
                notes.append(f"--config-file {path}: unknown key {section}.{key} ignored")
                continue
            attr, convert = _CONFIG_KEYS[section][key]
            if getattr(args, attr) is not None or value is None:
                continue  # the command line wins
            try:
                value = convert(value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"--config-file {path}: {section}.{key}: {e}") from None
            if attr in _NUMERIC_MINIMUM and value < _NUMERIC_MINIMUM[attr]:
                raise ValueError(f"--config-file {path}: {section}.{key}={value} must be >= 0")
            setattr(args, attr, value)
    return notes


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


def local_hosts(slots: list[_hosts.SlotInfo]) -> dict[str, bool]:
    """{host: whether it is this machine} for the job's hosts, in plan order (each host is
    looked up once: a name may need DNS)."""
    return {host: _net.is_local_host(host) for host in dict.fromkeys(s.hostname for s in slots)}


def launcher_interface_address(args: argparse.Namespace,
                               is_local: dict[str, bool]) -> str | None:
    """This machine's address on the pinned interface (``--network-interface``, else the
    launcher's ``SPARK_HVD_NETWORK_INTERFACE`` / ``HOROVOD_GLOO_IFACE``) when this machine
    runs ranks of the job: the rendezvous listens there, on the network the ranks use.

    None when no interface is pinned, or when the launcher runs outside the job (a login
    node): the interface names the job hosts' network, which this machine need not be on (an
    interface of the same name here may be another network); the rendezvous then listens on
    all interfaces. ``is_local`` is :func:`local_hosts`. ``ValueError`` when this machine runs
    ranks but lacks the interface."""
    if not any(is_local.values()):
        return None
    env = dict(os.environ)
    if args.network_interface:
        env[contract.NETWORK_INTERFACE] = args.network_interface
    pinned = pinned_interface_address(env)
    return pinned[1] if pinned else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``spark-hvd-run`` and ``python -m spark_hvd.runner``; returns the exit
    code: 0 when every rank exited 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.check_build:
        from spark_hvd.runner._check_build import check_build_report
        print(check_build_report())
        return 0
    _horovod_names(args)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND given (e.g. spark-hvd-run -np 2 python train.py)")
    notes = []
    try:
        if args.config_file:
            notes = apply_config_file(args, args.config_file)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    for name in AUTOTUNE_BOUNDS:
        value = getattr(args, name.lower())
        bound = None if value is None else autotune_bound_broken(name, value)
        if bound:
            flag = "--" + name.lower().replace("_", "-")
            print(f"{PROG}: error: {flag} must be {bound}, got {value}", file=sys.stderr)
            return 2
    threshold = log_threshold(args)
    for note in notes:
        if log_enabled(threshold, "WARNING"):
            print(f"{PROG}: {note}", file=sys.stderr)
    if not is_elastic(args):
        given = [flag for flag, attr in _ELASTIC_ONLY_FLAGS if getattr(args, attr) is not None]
        if given:
            print(f"{PROG}: error: {given[0]} applies to elastic jobs only: add --min-np N or "
                  "--host-discovery-script SCRIPT", file=sys.stderr)
            return 2
    if is_elastic(args):
        if args.mpi:
            print(f"{PROG}: error: --mpi cannot run an elastic job (MPI cannot re-form with "
                  "other processes); leave out --mpi", file=sys.stderr)
            return 2
        try:
            outcome = _run_elastic(args, command=command, threshold=threshold)
        except ValueError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        except RuntimeError as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return getattr(e, "exit_code", 1)
        return 0 if outcome.ok else 1
    if args.mpi:
        return _run_under_mpirun(args, command)
    try:
        slots = plan_hosts(args)
        start_timeout = _start_timeout(args)
        is_local = local_hosts(slots)
        interface_ip = launcher_interface_address(args, is_local)
        if args.output_filename:
            os.makedirs(args.output_filename, exist_ok=True)
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return _Job(args, command, slots, is_local, start_timeout, interface_ip, threshold).run()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Horovod's ``horovod.runner.launch.parse_args``: ``sys.argv[1:]`` (or ``argv``) parsed,
    with Horovod's attribute names too (``num_proc``, ``min_num_proc``, ``max_num_proc``,
    ``slots``, ``cooldown_range``, ``command``, ...)."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    _horovod_names(args)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    return args


def _horovod_names(args: argparse.Namespace) -> None:
    args.num_proc = args.np
    args.nics = args.network_interface
    args.run_func = None


_ELASTIC_ONLY_FLAGS = (("--max-np", "max_num_proc"), ("--slots-per-host", "slots"),
                       ("--elastic-timeout", "elastic_timeout"), ("--reset-limit", "reset_limit"),
                       ("--blacklist-cooldown-range", "cooldown_range"))


def is_elastic(args: argparse.Namespace) -> bool:
    """Horovod's rule: a discovery script or --min-np makes the job elastic."""
    return args.host_discovery_script is not None or args.min_num_proc is not None


def _run_elastic(args: argparse.Namespace, command: list[str] | None = None,
                 threshold: str | None = None, base_env=None, cwd=None):
    """Runs an elastic job (Horovod's ``horovod.runner.launch._run_elastic``): returns the
    driver's outcome when the job succeeded, raises ``RuntimeError`` naming the cause (with
    Horovod's words for failed processes) when it did not, ``ValueError`` for bad arguments.

    Reads ``spark_hvd.runner.elastic.driver.DISCOVER_HOSTS_FREQUENCY_SECS`` and
    ``ELASTIC_TIMEOUT_SECS`` (the default when neither ``--elastic-timeout`` nor
    ``$HOROVOD_ELASTIC_TIMEOUT`` is set) now, so tests may patch them as Horovod's do."""
    from spark_hvd.launch.elastic.hosts import (FixedHosts, HostDiscoveryScript,
                                                validate_cooldown_range)
    from spark_hvd.runner._elastic_job import ElasticJob
    from spark_hvd.runner.elastic import driver as _horovod_driver

    command = list(args.command if command is None else command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ValueError("no COMMAND given (e.g. spark-hvd-run -np 2 --min-np 1 python "
                         "train.py)")
    if args.host_discovery_script:
        discovery = HostDiscoveryScript(args.host_discovery_script, args.slots)
    elif args.hosts or args.hostfile:
        if args.hosts and args.hostfile:
            raise ValueError("give hosts with -H or with --hostfile, not both")
        entries = (_hosts.parse_hosts(args.hosts) if args.hosts
                   else _hosts.parse_hostfile(args.hostfile))
        discovery = FixedHosts({h.host: h.slots for h in entries})
    elif args.np is not None:
        discovery = FixedHosts({"localhost": args.np})
    else:
        raise ValueError("an elastic job needs --host-discovery-script, -H, --hostfile or -np")
    num_proc = args.np if args.np is not None else args.min_num_proc
    min_np = args.min_num_proc if args.min_num_proc is not None else num_proc
    if num_proc is None:
        raise ValueError("give -np or --min-np")
    max_np = args.max_num_proc
    for name, value in (("-np", num_proc), ("--min-np", min_np), ("--max-np", max_np)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if min_np > num_proc:
        raise ValueError(f"--min-np {min_np} is above -np {num_proc}")
    if max_np is not None and max_np < num_proc:
        raise ValueError(f"--max-np {max_np} is below -np {num_proc}")
    if args.reset_limit is not None and args.reset_limit < 0:
        raise ValueError(f"--reset-limit must be >= 0, got {args.reset_limit}")
    cooldown = validate_cooldown_range(args.cooldown_range) if args.cooldown_range else None
    if args.elastic_timeout is not None:
        elastic_timeout = args.elastic_timeout
    elif contract.setting("ELASTIC_TIMEOUT") is not None:
        elastic_timeout = contract.elastic_timeout()
    else:
        elastic_timeout = float(_horovod_driver.ELASTIC_TIMEOUT_SECS)
    threshold = threshold or log_threshold(args)

    err = LineSink(sys.stderr)

    def log(message, level="WARNING"):
        if log_enabled(threshold, level):
            err.write_line(f"{PROG}: {message}\n".encode())

    if args.output_filename:
        os.makedirs(args.output_filename, exist_ok=True)
    on_user_error = (contract.setting("ELASTIC_ON_USER_ERROR") or "raise").strip().lower()
    job = ElasticJob(args, command, discovery, num_proc=num_proc, min_np=min_np, max_np=max_np,
                     elastic_timeout=elastic_timeout, reset_limit=args.reset_limit,
                     cooldown_range=cooldown, start_timeout=_start_timeout(args),
                     interface_ip=_elastic_interface_address(args),
                     log=log, discover_every=_horovod_driver.DISCOVER_HOSTS_FREQUENCY_SECS,
                     on_user_error=on_user_error, base_env=base_env, cwd=cwd)
    outcome = job.run()
    if not outcome.ok:
        error = RuntimeError(outcome.error or "the elastic job failed")
        error.exit_code = outcome.exit_code or 1
        raise error
    return outcome


def _elastic_interface_address(args: argparse.Namespace) -> str | None:
    """This machine's address on the pinned interface, when it has it (the store listens
    there); None without a pinned interface or when this machine lacks it."""
    try:
        return launcher_interface_address(args, {"localhost": True})
    except ValueError:
        return None


def mpirun_command(args: argparse.Namespace, command: list[str],
                   slots: list[_hosts.SlotInfo]) -> tuple[list[str], dict[str, str]]:
    """``spark-hvd-run --mpi``: the ``mpirun`` command line and its environment. The ranks meet
    through mpi4py (as under any mpirun) and run their CPU collectives through MPI
    (``SPARK_HVD_CPU_OPERATIONS=MPI`` unless the user chose otherwise); the tuning flags travel
    as the same variables as without ``--mpi``, exported to every host with ``-x``."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise ValueError("--mpi needs Open MPI's mpirun on PATH (Debian/Ubuntu: apt install "
                         "openmpi-bin libopenmpi-dev; and pip install mpi4py), or run without "
                         "--mpi")
    env = dict(os.environ)
    env.update(_env.config_env(args))
    if not any(env.get(v) for v in ("SPARK_HVD_CPU_OPERATIONS", "HOROVOD_CPU_OPERATIONS")):
        env["SPARK_HVD_CPU_OPERATIONS"] = "MPI"
    per_host: dict[str, int] = {}
    for s in slots:
        per_host[s.hostname] = per_host.get(s.hostname, 0) + 1
    cmd = [mpirun, "-np", str(len(slots)),
           "-H", ",".join(f"{h}:{n}" for h, n in per_host.items()),
           "--bind-to", "none", "--map-by", "slot"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    rsh = []
    if args.ssh_port:
        rsh += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        rsh += ["-i", args.ssh_identity_file]
    if rsh:
        cmd += ["--mca", "plm_rsh_args", " ".join(rsh)]
    cmd += shlex.split(args.mpi_args or "")
    for name in sorted(env):
        if name.startswith(("SPARK_HVD_", "HOROVOD_")) or name in ("PYTHONPATH", "PATH"):
            cmd += ["-x", name]
    return cmd + list(command), env


def _run_under_mpirun(args: argparse.Namespace, command: list[str]) -> int:
    try:
        cmd, env = mpirun_command(args, command, plan_hosts(args))
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return subprocess.call(cmd, env=env)


class _Job:
    """One launch: rendezvous server, ranks, output forwarding, supervision."""

    def __init__(self, args, command, slots, is_local, start_timeout, interface_ip,
                 log_threshold):
        self.args = args
        self.log_threshold = log_threshold
        self.command = command
        self.slots = slots
        self.start_timeout = start_timeout
        self.interface_ip = interface_ip
        self.out = LineSink(sys.stdout)
        self.err = LineSink(sys.stderr)
        grace = float(os.environ.get("SPARK_HVD_KILL_GRACE_SECONDS", DEFAULT_GRACE_SECONDS))
        self.supervisor = Supervisor(self.log, grace_seconds=grace)
        self.is_local = is_local  # local_hosts(slots)
        self.all_local = all(is_local.values())

    def log(self, message: str, level: str = "WARNING") -> None:
        """Writes ``message`` to stderr when ``level`` passes the launcher's log level (the
        supervisor's reports of failed ranks and signals are warnings)."""
        if log_enabled(self.log_threshold, level):
            self.err.write_line(f"{PROG}: {message}\n".encode())

    def _rendezvous_addresses(self) -> tuple[str, dict[str, str]]:
        """(bind host, {host: address its ranks connect to}) of the rendezvous server.

        Bound to all interfaces, the server is reached from each remote host at this
        machine's address on the route to that host (the way ssh got there): a launcher with
        several networks (a login node, or a management network beside the data network) has
        no single address every host can reach. Ranks on this machine use the address that
        routes to the first remote host, which is also the address they advertise."""
        hosts = list(self.is_local)
        if self.interface_ip:
            return self.interface_ip, dict.fromkeys(hosts, self.interface_ip)
        if self.all_local:
            return "127.0.0.1", dict.fromkeys(hosts, "127.0.0.1")
        first_remote = next(h for h, local in self.is_local.items() if not local)
        return "0.0.0.0", {h: _net.route_address(first_remote if local else h)
                           for h, local in self.is_local.items()}

    def run(self) -> int:
        secret = make_secret()
        job_id = secrets.token_hex(4)
        bind_host, advertised = self._rendezvous_addresses()
        server = RendezvousServer(secret, bind_host=bind_host)
        port = server.start()
        rendezvous_addrs = {h: f"[{a}]:{port}" if ":" in a else f"{a}:{port}"
                            for h, a in advertised.items()}
        restore = self._install_signal_handlers()
        try:
            self.log(f"job {job_id}: {len(self.slots)} rank(s), rendezvous on {bind_host} port "
                     f"{port}, reached at {', '.join(sorted(set(rendezvous_addrs.values())))}",
                     "INFO")
            config = _env.config_env(self.args)
            self.log(f"settings for the ranks: {config or 'none'}; command: "
                     f"{' '.join(self.command)}", "DEBUG")
            for slot in self.slots:
                if not self._start_rank(slot, rendezvous_addrs[slot.hostname],
                                        secret_to_env(secret), job_id, config):
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
        bind_addr = _env.bind_address(host, self.all_local)
        env = rank_env(dict(os.environ), slot, rendezvous_addr=rendezvous_addr,
                       secret_hex=secret_hex, job_id=job_id, bind_addr=bind_addr,
                       start_timeout=self.start_timeout, config=config)
        how = "locally" if local else "over ssh"
        # A pinned interface is resolved by the rank on its host, and wins over bind_addr.
        pinned = interface_setting(env)
        bind = f"the host's {','.join(pinned[1])} address" if pinned else bind_addr
        self.log(f"rank {slot.rank} on {host} {how} (local rank {slot.local_rank}/"
                 f"{slot.local_size}, cross rank {slot.cross_rank}/{slot.cross_size}, "
                 f"bind {bind})", "INFO")
        try:
            proc = spawn(slot.rank, host, self.command, env, os.getcwd(), remote=not local,
                         ssh_port=self.args.ssh_port,
                         ssh_identity_file=self.args.ssh_identity_file,
                         connect_timeout=self.start_timeout)
        except OSError as e:
            self.log(f"cannot start rank {slot.rank} on {host}: {e}", "ERROR")
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
