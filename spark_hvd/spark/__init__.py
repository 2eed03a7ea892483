"""Run a spark_hvd job inside Spark: one rank per barrier-mode task.

    import spark_hvd.spark

    def train(lr):
        import spark_hvd.torch as hvd
        hvd.init()
        ...
        return model.state_dict() if hvd.rank() == 0 else None

    results = spark_hvd.spark.run(train, args=(0.1,), num_proc=4)   # rank-ordered

Works with classic and Spark Connect sessions. Each task runs ``fn`` in a child Python process
that it starts with the same bootstrap environment as ``spark-hvd-run``; the ranks find each
other through ``BarrierTaskContext.allGather`` and then talk directly, authenticated by a
per-job secret (not encrypted: ``run`` refuses a cluster with ``spark.ssl.enabled`` unless
allowed, see :func:`run`).

:func:`run_elastic` runs an elastic job instead (Horovod's ``horovod.spark.run_elastic``): no
barrier stage, one Spark job per slot, and a lost executor is a reset, not the end.
"""

from spark_hvd.spark._errors import RunError

__all__ = ["run", "run_elastic", "RunError"]


def run(fn, args=(), kwargs=None, num_proc=None, start_timeout=None, use_mpi=None,
        use_gloo=None, extra_mpi_args=None, env=None, stdout=None, stderr=None, verbose=1,
        nics=None, prefix_output_with_timestamp=False, executable=None, spark=None):
    """Runs ``fn(*args, **kwargs)`` as a spark_hvd job of ``num_proc`` ranks on Spark tasks.

    Each rank runs in its own Spark barrier task (all ``num_proc`` start together), in a child
    Python process with a clean environment; ``fn`` calls ``hvd.init()`` itself, as in any
    spark_hvd or Horovod script. Ranks are host-major over the executors (``local_rank`` counts
    the tasks of one executor).

    GPUs: a task given GPUs by Spark's resource scheduling (``spark.task.resource.gpu.amount``
    and the executors' ``spark.executor.resource.gpu.*``) passes them to its rank as
    ``CUDA_VISIBLE_DEVICES``, and its own addresses as ``SPARK_HVD_SPARK_GPUS``. When every
    task of an executor has one GPU of its own, all of the executor's GPUs are visible in
    local-rank order, so ``torch.cuda.set_device(hvd.local_rank())`` selects the task's own;
    with several GPUs per task, only the task's own are visible, renumbered from 0. Tasks
    may share a GPU (a fractional amount such as 0.5: two tasks per GPU, e.g. on a one-GPU
    workstation): each then sees only its GPU, as device 0, and the driver shows one line
    naming the ranks that share; ``hvd.local_rank() % torch.cuda.device_count()`` selects the
    task's own device in every case. A task without a GPU resource leaves
    ``CUDA_VISIBLE_DEVICES`` as the executor has it (set or not).

    Args:
        fn: the function each rank runs; it and its arguments are pickled with cloudpickle.
        args, kwargs: arguments of ``fn``.
        num_proc: number of ranks (Spark tasks); default ``spark.default.parallelism``. The
            cluster must offer that many task slots at once; if it does not, ``run`` fails at
            once on a local master and after ``start_timeout`` on a cluster.
        start_timeout: seconds to wait for task slots, for all tasks to start, and for the
            ranks to meet in ``hvd.init()``. Default ``$SPARK_HVD_SPARK_START_TIMEOUT``,
            ``$HOROVOD_SPARK_START_TIMEOUT``, or 600.
        use_mpi, use_gloo, extra_mpi_args: Horovod's; the ranks always use spark_hvd's own
            TCP/shared-memory transport, so ``use_mpi=True`` is an error and the others are
            accepted and ignored.
        env: extra environment variables for the ranks. The driver's ``SPARK_HVD_*`` and
            ``HOROVOD_*`` tuning variables are passed on too; ``env`` wins over them.
        stdout, stderr: streams for the ranks' output (default ``sys.stdout``/``sys.stderr``);
            every line is prefixed ``[rank]<stdout>:`` or ``[rank]<stderr>:``.
        verbose: 0 quiet, 1 failures and waits, 2 every step.
        nics: network interface names; each rank binds its connections to, and advertises,
            the address of the first of them its machine has (default: the Spark
            configuration ``spark.spark_hvd.networkInterface``, else
            ``SPARK_HVD_NETWORK_INTERFACE`` / ``HOROVOD_GLOO_IFACE`` of the driver or ``env``,
            else the executor's address). The ranks get the names as
            ``SPARK_HVD_NETWORK_INTERFACE``; a machine with none of them fails its rank.
        prefix_output_with_timestamp: put the time in front of each output line.
        executable: the Python that runs the ranks (default: the executors' Python).
        spark: the SparkSession to use (default: the active one, classic or Spark Connect).

    Returns:
        The list of ``fn``'s return values, index = rank.

    Raises:
        RunError: a rank failed (the message names it and holds its traceback; every other
            rank is stopped first), the cluster has too few task slots (GPUs count: with
            ``spark.task.resource.gpu.amount=1`` a job needs a GPU per rank), the tasks did not
            start in time, or the cluster has TLS on (``spark.ssl.enabled``): the ranks'
            traffic is authenticated but not encrypted, so ``run`` refuses unless the Spark
            configuration ``spark.spark_hvd.allowUnencrypted=true`` or the environment
            variable ``SPARK_HVD_ALLOW_UNENCRYPTED=1`` allows it. A lost executor or machine
            (its tasks stop sending heartbeats for ``spark.spark_hvd.heartbeatTimeout`` or
            ``$SPARK_HVD_SPARK_HEARTBEAT_TIMEOUT`` seconds, default 10) fails the run with
            ``kind="lost"``, ``lost_ranks`` and ``host`` naming them, within about that
            timeout plus 5 s, whatever the surviving ranks and Spark's scheduler do.

    Example (with an active SparkSession of two or more task slots):

        >>> def rank_and_size():
        ...     import spark_hvd.numpy as hvd
        ...     hvd.init()
        ...     return hvd.rank(), hvd.size()
        >>> spark_hvd.spark.run(rank_and_size, num_proc=2)
        [(0, 2), (1, 2)]
    """
    if use_mpi:
        raise ValueError("spark_hvd.spark.run: MPI is not supported; the ranks use spark_hvd's "
                         "built-in TCP/shared-memory transport (leave use_mpi unset)")
    if extra_mpi_args:
        import warnings
        warnings.warn("spark_hvd.spark.run: extra_mpi_args is ignored (the ranks do not use MPI)",
                      stacklevel=2)
    from spark_hvd.spark._controller import RunController
    return RunController(fn, args=args, kwargs=kwargs, num_proc=num_proc,
                         start_timeout=start_timeout, env=env, stdout=stdout, stderr=stderr,
                         verbose=verbose, nics=nics,
                         prefix_output_with_timestamp=prefix_output_with_timestamp,
                         executable=executable, spark=spark).run()


def run_elastic(fn, args=(), kwargs=None, num_proc=None, min_num_proc=None, max_num_proc=None,
                start_timeout=None, elastic_timeout=None, reset_limit=None, env=None,
                stdout=None, stderr=None, verbose=1, nics=None,
                prefix_output_with_timestamp=False, min_np=None, max_np=None,
                cooldown_range=None, executable=None, spark=None):
    """Runs ``fn(*args, **kwargs)`` as an elastic spark_hvd job on Spark tasks: it survives
    lost executors and grows back when Spark gives it slots again (Horovod's
    ``horovod.spark.run_elastic``, same arguments).

    ``fn`` trains under ``hvd.elastic.run`` with a state (``hvd.elastic.TorchState``, ...), as
    in any elastic script: when a rank is lost, the others return to the last
    ``state.commit()`` and go on without it; a worker that joins gets the state from rank 0.

    There is no barrier stage: every slot is a one-task Spark job of its own (submitted from a
    driver thread), whose task registers with the driver and runs the worker the driver gives
    it. A lost executor fails only its own slots' tasks: their workers are dropped at the next
    reset (within the peer timeout, ``SPARK_HVD_PEER_TIMEOUT_SECONDS``, for a machine that goes
    silent; at once for a killed executor) and training goes on while at least
    ``min_num_proc`` remain. Spark runs the lost tasks again where it has room (or the driver
    submits a slot job again once one ended): each new task is a new worker that joins at the
    next reset, up to ``max_num_proc``. Pending slot jobs are what makes dynamic allocation
    request executors.

    Args:
        fn, args, kwargs: the function each worker runs and its arguments (cloudpickled).
        num_proc: processes to start with (Horovod's default: ``spark.default.parallelism``;
            with ``spark.dynamicAllocation.enabled``, the executors Spark starts with times
            the slots of one, ``spark.executor.cores // spark.task.cpus``).
        min_num_proc (or Horovod's older ``min_np``): fewer processes than this and training
            waits (up to ``elastic_timeout``) for slots; default ``num_proc`` (with dynamic
            allocation: ``minExecutors`` times the slots of one, at least 1).
        max_num_proc (or ``max_np``): never more processes than this, and the number of slot
            jobs submitted; default ``num_proc`` (with dynamic allocation: ``maxExecutors``
            times the slots of one, when set).
        start_timeout: seconds for ``num_proc`` slot tasks to start and register, and for a
            new worker to join (default ``$SPARK_HVD_SPARK_START_TIMEOUT``,
            ``$HOROVOD_SPARK_START_TIMEOUT``, or 600).
        elastic_timeout: seconds a reset may wait for enough processes (default
            ``$SPARK_HVD_ELASTIC_TIMEOUT``, ``$HOROVOD_ELASTIC_TIMEOUT``, or 600).
        reset_limit: fail the run after this many resets (default: no limit).
        cooldown_range: ``(min, max)`` seconds an executor where a worker was lost stays
            unused (default ``(10, 600)``, doubling with each failure there).
        env, stdout, stderr, verbose, nics, prefix_output_with_timestamp, executable, spark:
            as for :func:`run`. Every output line carries the worker's *current* rank.

    Returns:
        The final round's return values of ``fn``, in its rank order (a worker whose ``fn``
        never called ``init()`` is collected by the rank it was started for).

    Raises:
        RunError: ``fn`` raised (``kind="user"``: the run ends at once with its traceback;
            it is never retried), fewer than ``min_num_proc`` processes were left for
            ``elastic_timeout``, ``reset_limit`` was exceeded, every process of the last round
            was lost (the training state with them), or too few slot tasks started within
            ``start_timeout``.
    """
    import warnings
    if min_np is not None:
        warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning,
                      stacklevel=2)
        min_num_proc = min_np
    if max_np is not None:
        warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning,
                      stacklevel=2)
        max_num_proc = max_np
    from spark_hvd.spark._elastic import ElasticRunController
    return ElasticRunController(
        fn, args=args, kwargs=kwargs, num_proc=num_proc, min_np=min_num_proc,
        max_np=max_num_proc, start_timeout=start_timeout, elastic_timeout=elastic_timeout,
        reset_limit=reset_limit, env=env, stdout=stdout, stderr=stderr, verbose=verbose,
        nics=nics, prefix_output_with_timestamp=prefix_output_with_timestamp,
        cooldown_range=cooldown_range, executable=executable, spark=spark).run()
