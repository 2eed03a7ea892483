"""Exceptions raised by every framework adapter."""


class HorovodInternalError(RuntimeError):
    """The job can no longer run collectives: a peer process died or the job was torn down.

    Raised on every surviving rank for pending and future operations. Named after Horovod's
    exception so existing ``except hvd.HorovodInternalError`` handlers (elastic training) work.
    """


class HostsUpdatedInterrupt(RuntimeError):
    """Raised in elastic mode when the set of hosts changed (kept for Horovod compatibility)."""

    def __init__(self, skip_sync=False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync
