"""What only ``spark-hvd-run`` adds to a rank's environment: the tuning its flags set, and
the address each rank binds to. The bootstrap variables themselves come from
:func:`spark_hvd.launch.environment.rank_env`, shared with ``spark_hvd.spark``.
"""

from __future__ import annotations

import argparse

from spark_hvd.common._bootstrap_contract import NETWORK_INTERFACE
from spark_hvd.launch.environment import number as _number
from spark_hvd.launch.net import is_loopback


def config_env(args: argparse.Namespace) -> dict[str, str]:
    """Environment variables for the tuning flags the user gave. Flags not given set nothing, so
    values already in the launcher's environment (ours or Horovod's aliases) still apply."""
    env = {}
    if args.timeline_filename:
        env["SPARK_HVD_TIMELINE"] = args.timeline_filename
    if args.fusion_threshold_mb is not None:
        env["SPARK_HVD_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 1024 * 1024))
    if args.cycle_time_ms is not None:
        env["SPARK_HVD_CYCLE_TIME"] = _number(args.cycle_time_ms)
    if args.stall_check_warning_time_seconds is not None:
        env["SPARK_HVD_STALL_CHECK_TIME_SECONDS"] = _number(args.stall_check_warning_time_seconds)
    if args.stall_check_shutdown_time_seconds is not None:
        env["SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS"] = _number(
            args.stall_check_shutdown_time_seconds)
    if args.no_stall_check is not None:  # --no-stall-check, or --stall-check to turn it on
        env["SPARK_HVD_STALL_CHECK_DISABLE"] = "1" if args.no_stall_check else "0"
    if args.log_level:
        env["SPARK_HVD_LOG_LEVEL"] = args.log_level
    if args.verbose:
        env["SPARK_HVD_VERBOSE"] = "1"
    if args.disable_cache:
        env["SPARK_HVD_CACHE_CAPACITY"] = "0"
    elif args.cache_capacity is not None:
        env["SPARK_HVD_CACHE_CAPACITY"] = str(args.cache_capacity)
    # Switches with a --no- form: set either way when given, so they override the environment.
    # The torus one has no effect; the ranks warn when it is on.
    for flag, name in (("timeline_mark_cycles", "TIMELINE_MARK_CYCLES"),
                       ("hierarchical_allreduce", "HIERARCHICAL_ALLREDUCE"),
                       ("hierarchical_allgather", "HIERARCHICAL_ALLGATHER"),
                       ("torus_allreduce", "TORUS_ALLREDUCE")):
        value = getattr(args, flag)
        if value is not None:
            env["SPARK_HVD_" + name] = "1" if value else "0"
    if args.autotune is not None:
        env["SPARK_HVD_AUTOTUNE"] = "1" if args.autotune else "0"
    for flag, name in (("autotune_log_file", "AUTOTUNE_LOG"),
                       ("autotune_warmup_samples", "AUTOTUNE_WARMUP_SAMPLES"),
                       ("autotune_steps_per_sample", "AUTOTUNE_STEPS_PER_SAMPLE"),
                       ("autotune_bayes_opt_max_samples", "AUTOTUNE_BAYES_OPT_MAX_SAMPLES"),
                       ("autotune_gaussian_process_noise", "AUTOTUNE_GAUSSIAN_PROCESS_NOISE")):
        value = getattr(args, flag)
        if value is not None:
            env["SPARK_HVD_" + name] = _number(value) if not isinstance(value, str) else value
    if args.network_interface:
        env[NETWORK_INTERFACE] = args.network_interface
    return env


def bind_address(host: str, all_local: bool) -> str:
    """Address a rank's listeners bind to, unless an interface is pinned.

    A 127.x host name binds to exactly that address: that is how several "hosts" share one
    machine in tests. Otherwise loopback when the whole job is on this machine (nothing outside
    needs to reach it), else all interfaces. With --network-interface (or
    SPARK_HVD_NETWORK_INTERFACE / HOROVOD_GLOO_IFACE in the launcher's environment) every rank,
    on this machine or another, resolves the interface on its own host and binds there instead
    (``common/_bootstrap.py``), so whether the host is this machine changes nothing here.
    """
    if is_loopback(host) and ":" not in host:
        return host
    return "127.0.0.1" if all_local else "0.0.0.0"
