"""Exceptions raised by every framework adapter."""

import re


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


# Where an error of a compiled step (a TensorFlow op error, a JAX runtime error) carries the
# core's HorovodInternalError: a native op's status message starts with it, a Python kernel's
# or callback's names the Python exception (possibly with its module) at the start of a line.
_INTERNAL_LINE = re.compile(r"^(?:[\w.]+\.)?HorovodInternalError: (.*)$", re.MULTILINE)


def internal_error_in_message(message):
    """The ``HorovodInternalError`` that a framework's error ``message`` reports, or None."""
    found = _INTERNAL_LINE.search(message or "")
    return HorovodInternalError(found.group(1).strip()) if found else None
