"""The exception ``spark_hvd.spark.run`` raises (its own module, so that the rank's process
imports nothing of the driver's machinery)."""


class RunError(RuntimeError):
    """``spark_hvd.spark.run`` failed.

    When a rank failed, ``rank`` is that rank, ``host`` its host, ``kind`` one of ``"user"``
    (``fn`` raised), ``"crash"`` (the process died), ``"internal"`` (it lost a peer) or
    ``"lost"`` (its task stopped sending heartbeats: the executor or its machine went away;
    ``lost_ranks`` lists every such rank, ``rank`` and ``host`` are the first of them), and
    ``detail`` its Python traceback or exit status; the message holds all of them. ``state``
    is the state ``spark_hvd.spark.run``'s controller was in when the run failed:
    ``"starting"`` (checks, task slots, pickling) or ``"running"`` (the ranks).
    """

    def __init__(self, message, rank=None, host=None, kind=None, detail=None, state=None,
                 lost_ranks=None):
        super().__init__(message)
        self.rank, self.host, self.kind, self.detail = rank, host, kind, detail
        self.state = state
        self.lost_ranks = lost_ranks
