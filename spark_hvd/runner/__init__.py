"""The ``spark-hvd-run`` launcher (also ``python -m spark_hvd.runner``), and :func:`run`, its
Python face (Horovod's ``horovod.run``, also ``spark_hvd.run``).

Kept import-light on purpose: the launcher must start without torch, TensorFlow or the native
core. The entry point is :func:`spark_hvd.runner.launch.main`.
"""

import os
import shutil
import sys
import tempfile
import warnings

__all__ = ["run"]

# What each rank runs: the function rank that spark_hvd.spark.run's tasks start too (load the
# pickled function, call it, leave its result or an error report in a file), pointed at this
# rank's files. argv[1] is run()'s scratch directory.
_RANK_MAIN = """\
import os, sys
from spark_hvd.common._bootstrap_contract import RANK
from spark_hvd.launch import function_rank
d = os.path.join(sys.argv[1], "rank." + os.environ[RANK])
os.environ[function_rank.PAYLOAD_ENV] = os.path.join(d, "payload")
os.environ[function_rank.RESULT_ENV] = os.path.join(d, "result")
os.environ[function_rank.ERROR_ENV] = os.path.join(d, "error")
function_rank.main()
"""

# The same for a worker of an elastic run: one payload for all, copied into the worker's own
# directory (named by its worker id; a stopped worker removes only that one).
_WORKER_MAIN = """\
import os, shutil, sys
from spark_hvd.common._bootstrap_contract import ELASTIC_WORKER_ID
from spark_hvd.launch import function_rank
d = os.path.join(sys.argv[1], "worker." + os.environ[ELASTIC_WORKER_ID].replace("/", "."))
os.makedirs(d, exist_ok=True)
shutil.copyfile(os.path.join(sys.argv[1], "payload"), os.path.join(d, "payload"))
os.environ[function_rank.PAYLOAD_ENV] = os.path.join(d, "payload")
os.environ[function_rank.RESULT_ENV] = os.path.join(d, "result")
os.environ[function_rank.ERROR_ENV] = os.path.join(d, "error")
function_rank.main()
"""

# Horovod's rule: these make the run elastic ...
_ELASTIC_ARGS = ("min_num_proc", "max_num_proc", "host_discovery_script")
# ... and these only mean something in an elastic run.
_ELASTIC_ONLY = ("slots", "reset_limit", "cooldown_range", "elastic_timeout")


def run(func, args=(), kwargs=None, num_proc=None, min_num_proc=None, max_num_proc=None,
        slots=None, reset_limit=None, cooldown_range=None, hosts=None, hostfile=None,
        host_discovery_script=None, start_timeout=None, ssh_port=None, ssh_identity_file=None,
        disable_cache=None, output_filename=None, verbose=None, use_gloo=None, use_mpi=None,
        mpi_args=None, network_interface=None, network_interfaces=None, executable=None,
        np=None, min_np=None, max_np=None, elastic_timeout=None):
    """Runs ``func(*args, **kwargs)`` on every rank of a new job of ``num_proc`` processes
    started by the ``spark-hvd-run`` machinery, and returns the ranks' return values in rank
    order (Horovod's ``horovod.run``, same arguments).

    ``func`` calls ``hvd.init()`` itself, as in a script. It and its arguments are pickled
    with cloudpickle and each rank's return value comes back pickled, so they must be
    picklable. The ranks' output is forwarded to this process's stdout/stderr with the
    ``[rank]<stream>:`` prefix.

    Args:
        func, args, kwargs: the function each rank runs and its arguments.
        num_proc (or Horovod's older ``np``): number of ranks (default 1).
        hosts: ``"host1:2,host2:2"`` (or a list of such entries); ``hostfile``: a hostfile.
            Default ``localhost:num_proc``. Every host must be this machine (``localhost``,
            its names, 127.x addresses): the function travels through a local directory.
        start_timeout, ssh_port, ssh_identity_file, output_filename, verbose: as the
            launcher's flags of the same names.
        network_interfaces (or the older ``network_interface``; comma-separated): as the
            launcher's ``--network-interfaces``.
        executable: the Python that runs the ranks (default ``sys.executable``).
        use_gloo, disable_cache: accepted; the ranks always use spark_hvd's own transport and
            there are no cached start-up checks to disable.
        use_mpi, mpi_args: MPI is not a transport here: ``use_mpi=True`` is an error,
            ``mpi_args`` a warning.
        min_num_proc, max_num_proc, host_discovery_script (and ``min_np``, ``max_np``): an
            elastic run (Horovod's elastic ``horovod.run``), as ``spark-hvd-run --min-np
            --max-np --host-discovery-script``: a lost process or host makes the others go on
            from their last commit (``func`` trains under ``hvd.elastic.run``), hosts the
            script adds join at the next reset. ``slots``, ``reset_limit``,
            ``cooldown_range`` (``(min, max)`` seconds) and ``elastic_timeout`` as the
            launcher's ``--slots-per-host``, ``--reset-limit``,
            ``--blacklist-cooldown-range`` and ``--elastic-timeout``. The result is the final
            round's, in its rank order; a worker whose ``func`` never calls ``init()`` is
            collected by the rank it was started for.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        spark_hvd.spark.RunError: a rank failed (the message names it and holds its traceback
            or exit status; the launcher stopped the other ranks), or the job could not start.
    """
    from ..spark import RunError

    if np is not None:
        if num_proc is not None and num_proc != np:
            raise ValueError(f"run: num_proc={num_proc} and np={np} disagree; give num_proc")
        num_proc = np
    min_num_proc = min_num_proc if min_np is None else min_np
    max_num_proc = max_num_proc if max_np is None else max_np
    given = dict(min_num_proc=min_num_proc, max_num_proc=max_num_proc, slots=slots,
                 reset_limit=reset_limit, cooldown_range=cooldown_range,
                 host_discovery_script=host_discovery_script, elastic_timeout=elastic_timeout)
    elastic = any(given[name] is not None for name in _ELASTIC_ARGS)
    only = [name for name in _ELASTIC_ONLY if given[name] is not None]
    if only and not elastic:
        raise ValueError(f"spark_hvd.run: {only[0]}= applies to elastic runs only: give "
                         "min_num_proc, max_num_proc or host_discovery_script too")
    if use_mpi:
        raise ValueError("spark_hvd.run: MPI is not supported; the ranks use spark_hvd's "
                         "built-in TCP/shared-memory transport (leave use_mpi unset)")
    if mpi_args:
        warnings.warn("spark_hvd.run: mpi_args is ignored (the ranks do not use MPI)",
                      stacklevel=2)
    if hosts is not None and hostfile is not None:
        raise ValueError("spark_hvd.run: give hosts or hostfile, not both")
    if num_proc is None and elastic:
        num_proc = min_num_proc or 1
    num_proc = 1 if num_proc is None else int(num_proc)
    if num_proc < 1:
        raise ValueError(f"spark_hvd.run: num_proc must be >= 1, got {num_proc}")
    if isinstance(hosts, (list, tuple)):
        hosts = ",".join(hosts)
    if network_interfaces is None and network_interface:
        network_interfaces = network_interface.split(",")
    if isinstance(network_interfaces, str):
        network_interfaces = network_interfaces.split(",")
    _require_local_hosts(hosts, hostfile)

    argv = ["-np", str(num_proc)]
    for flag, value in (("-H", hosts), ("--hostfile", hostfile),
                        ("--start-timeout", start_timeout), ("-p", ssh_port),
                        ("-i", ssh_identity_file), ("--output-filename", output_filename),
                        ("--network-interfaces",
                         ",".join(network_interfaces) if network_interfaces else None)):
        if value is not None:
            argv += [flag, str(value)]
    if verbose:
        argv.append("--verbose")
    if elastic:
        for flag, value in (("--min-np", min_num_proc), ("--max-np", max_num_proc),
                            ("--host-discovery-script", host_discovery_script),
                            ("--slots-per-host", slots), ("--reset-limit", reset_limit),
                            ("--elastic-timeout", elastic_timeout)):
            if value is not None:
                argv += [flag, str(value)]
        if min_num_proc is None and host_discovery_script is None:
            argv += ["--min-np", str(num_proc)]
        if cooldown_range is not None:
            argv += ["--blacklist-cooldown-range", *(str(int(x)) for x in cooldown_range)]
        return _run_elastic_function(func, args, kwargs, argv, executable, RunError)

    import cloudpickle

    from . import launch

    workdir = tempfile.mkdtemp(prefix="spark_hvd-run-")
    try:
        payload = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
        for rank in range(num_proc):
            rank_dir = os.path.join(workdir, f"rank.{rank}")
            os.mkdir(rank_dir)
            with open(os.path.join(rank_dir, "payload"), "wb") as f:
                f.write(payload)
        argv += ["--", executable or sys.executable, "-c", _RANK_MAIN, workdir]
        code = launch.main(argv)
        return _collect(workdir, num_proc, code, RunError)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_elastic_function(func, args, kwargs, argv, executable, error_class):
    """``run``'s elastic path: one payload, a directory per worker, the final round's results
    in rank order."""
    import cloudpickle

    from . import launch

    workdir = tempfile.mkdtemp(prefix="spark_hvd-run-")
    try:
        with open(os.path.join(workdir, "payload"), "wb") as f:
            f.write(cloudpickle.dumps((func, tuple(args), dict(kwargs or {}))))
        parsed = launch.parse_args(argv + ["--", executable or sys.executable, "-c",
                                           _WORKER_MAIN, workdir])
        try:
            outcome = launch._run_elastic(parsed)
        except RuntimeError as e:
            # The driver's message names the rank, its host and the cause (with the
            # traceback of a user error).
            report = _user_error_report(workdir)
            raise error_class(f"spark_hvd.run: {e}", kind="user" if report else "lost",
                              detail=report["traceback"] if report else str(e)) from None
        if outcome.members:
            order = outcome.members
        else:  # no worker called init(): each is collected by the rank it was started for
            order = sorted((w for w in outcome.spawn_ranks
                            if os.path.exists(_worker_file(workdir, w, "result"))),
                           key=outcome.spawn_ranks.get)
        results = []
        for rank, wid in enumerate(order):
            path = _worker_file(workdir, wid, "result")
            if not os.path.exists(path):
                raise error_class(f"spark_hvd.run: rank {rank} ({wid}) returned no result",
                                  rank=rank, kind="crash", detail=None)
            with open(path, "rb") as f:
                results.append(cloudpickle.load(f))
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _worker_file(workdir, wid, name):
    return os.path.join(workdir, "worker." + wid.replace("/", "."), name)


def _user_error_report(workdir):
    """The first report of a worker of an elastic run whose ``func`` raised, or None."""
    import json
    for entry in sorted(os.listdir(workdir)):
        path = os.path.join(workdir, entry, "error")
        if entry.startswith("worker.") and os.path.exists(path):
            with open(path) as f:
                report = json.load(f)
            if not report.get("internal"):
                return report
    return None


def _require_local_hosts(hosts, hostfile):
    """The payload and results travel through a local directory: refuse other machines."""
    from ..launch import hosts as _hosts
    from ..launch import net as _net
    if hosts:
        entries = _hosts.parse_hosts(hosts)
    elif hostfile:
        entries = _hosts.parse_hostfile(hostfile)
    else:
        return
    remote = [h.host for h in entries if not _net.is_local_host(h.host)]
    if remote:
        raise ValueError(f"spark_hvd.run: hosts {remote} are not this machine; run() passes "
                         "the function through a local directory, so every rank must run "
                         "here. For other machines start a script with spark-hvd-run -H ... "
                         "or use spark_hvd.spark.run")


def _collect(workdir, num_proc, code, error_class):
    """The ranks' results in rank order, or ``error_class`` naming the rank that failed: one
    whose function raised comes before one that only lost its peers (HorovodInternalError),
    which comes before one that left nothing (killed, crashed)."""
    import json

    import cloudpickle

    results, reports, missing = [], [], []
    for rank in range(num_proc):
        rank_dir = os.path.join(workdir, f"rank.{rank}")
        error_path = os.path.join(rank_dir, "error")
        result_path = os.path.join(rank_dir, "result")
        if os.path.exists(error_path):
            with open(error_path) as f:
                report = json.load(f)
            reports.append((report.get("internal", False), rank, report))
        elif os.path.exists(result_path):
            with open(result_path, "rb") as f:
                results.append(cloudpickle.load(f))
        else:
            missing.append(rank)
    if reports:
        internal, rank, report = min(reports, key=lambda item: item[:2])
        raise error_class(
            f"spark_hvd.run: rank {rank} failed ({report.get('where', 'fn')}): "
            f"{report['type']}: {report['message']}\n{report.get('traceback', '')}",
            rank=rank, kind="internal" if internal else "user", detail=report.get("traceback"))
    if missing or code != 0:
        raise error_class(
            f"spark_hvd.run: the job failed (launcher exit code {code}); rank(s) {missing} "
            "returned no result: see their output above", rank=missing[0] if missing else None,
            kind="crash", detail=f"exit code {code}")
    return results
