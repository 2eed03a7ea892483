"""A rank that runs a pickled function: ``python -m spark_hvd.launch.function_rank``.

A Spark task of ``spark_hvd.spark.run`` spawns it, and ``spark_hvd.run`` has ``spark-hvd-run``
start one per rank. It loads ``(fn, args, kwargs)`` (cloudpickled by the driver) from the file
named in ``SPARK_HVD_SPARK_PAYLOAD``, calls ``fn``, and leaves either the pickled return value
in ``SPARK_HVD_SPARK_RESULT`` (exit code 0) or a JSON error report in ``SPARK_HVD_SPARK_ERROR``
(exit code 1). The bootstrap environment is already set, so ``hvd.init()`` inside ``fn`` joins
the job like any launcher-started rank.

A fresh process per Spark task keeps CUDA and the core's state out of Spark's reused Python
workers, and lets the task kill the whole group when the job fails.
"""

import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback

PAYLOAD_ENV = "SPARK_HVD_SPARK_PAYLOAD"
RESULT_ENV = "SPARK_HVD_SPARK_RESULT"
ERROR_ENV = "SPARK_HVD_SPARK_ERROR"
# How often the child checks that the Spark task that started it is still there.
_PARENT_POLL_SECONDS = 0.1


def _kill_group(workdir):
    """The task is gone: remove its scratch directory and kill this process group (this
    process and whatever ``fn`` started)."""
    try:
        shutil.rmtree(workdir, ignore_errors=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(137)


def _watch_parent(parent_pid, workdir):
    """Kill this process group when the task's Python worker goes away.

    Spark kills the Python worker of a cancelled or failed barrier task with SIGKILL, which
    gives the task no chance to clean up. Two things notice: the parent-death signal that the
    spawn set (SIGTERM, see :func:`_install_sigterm_handler`), and this thread, for when the
    main thread cannot run Python code or ``fn`` installed a SIGTERM handler of its own.
    """
    while True:
        time.sleep(_PARENT_POLL_SECONDS)
        if os.getppid() != parent_pid:
            _kill_group(workdir)


def _install_sigterm_handler(workdir):
    """SIGTERM stops the whole process group, not just this process: whatever ``fn`` started
    goes too. It comes from the task stopping the rank, or from the parent-death signal
    (which may arrive while the dying Python worker still looks alive, so the handler does
    not try to tell them apart)."""

    def on_sigterm(signum, frame):
        # Nobody reads the rank's result any more; the task may be gone and not clean up.
        shutil.rmtree(workdir, ignore_errors=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.killpg(os.getpgrp(), signal.SIGTERM)  # the group, this process included

    signal.signal(signal.SIGTERM, on_sigterm)


def _write_atomically(path, data):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _lost_peer(exc):
    """Whether ``exc`` is a lost peer: a ``HorovodInternalError``, or TensorFlow's or JAX's
    form of one (an error of a compiled step, inside ``model.fit``, whose message holds the
    line ``HorovodInternalError: ...``), which must not read as an error in ``fn``."""
    from spark_hvd.common.exceptions import HorovodInternalError
    if isinstance(exc, HorovodInternalError):
        return True
    if "tensorflow" in sys.modules and type(exc).__module__.startswith("tensorflow"):
        from spark_hvd.tensorflow.elastic import internal_error
        return internal_error(exc) is not None
    if "jax" in sys.modules and type(exc).__module__.startswith(("jax", "jaxlib")):
        # Keras's JAX backend: the core's error raised in the gradients' io_callback.
        from spark_hvd.common.exceptions import internal_error_in_message
        return internal_error_in_message(str(exc)) is not None
    return False


def _error_report(exc, where):
    tb = exc.__traceback__
    if tb is not None and tb.tb_next is not None:
        tb = tb.tb_next  # start at fn, not at main() here
    return {
        "type": type(exc).__name__,
        "module": type(exc).__module__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb)),
        "internal": _lost_peer(exc),
        "where": where,
    }


def main():
    payload_path = os.environ.pop(PAYLOAD_ENV)
    result_path = os.environ.pop(RESULT_ENV)
    error_path = os.environ.pop(ERROR_ENV)
    parent, workdir = os.getppid(), os.path.dirname(payload_path)
    _install_sigterm_handler(workdir)
    threading.Thread(target=_watch_parent, args=(parent, workdir), daemon=True,
                     name="spark-hvd-parent-watch").start()

    import cloudpickle

    where = "loading the function"
    try:
        with open(payload_path, "rb") as f:
            fn, args, kwargs = cloudpickle.load(f)
        os.unlink(payload_path)
        where = "fn"
        try:
            result = fn(*args, **kwargs)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
            result = None  # sys.exit(0) inside fn is a normal end without a value
        where = "pickling the return value"
        data = cloudpickle.dumps(result)
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the driver
        report = _error_report(e, where)
        # The traceback also goes to the rank's stderr, which reaches the driver prefixed.
        sys.stderr.write(report["traceback"])
        sys.stderr.flush()
        _write_atomically(error_path, json.dumps(report).encode())
        if os.environ.get("SPARK_HVD_ELASTIC", "") not in ("", "0"):
            # An elastic driver must hear that fn raised (a user error ends the job), not
            # only see the process exit (a loss it would recover from).
            from spark_hvd.common._elastic_agent import report_exit_error
            report_exit_error(e)
        sys.stdout.flush()
        # Exit now, skipping atexit's coordinated hvd.shutdown(): it would wait for the other
        # ranks, which may be far from their next collective. They learn of the failure from
        # the task (which stops the job) or from the core (the connection to us is gone).
        os._exit(1)
    _write_atomically(result_path, data)


if __name__ == "__main__":
    main()
