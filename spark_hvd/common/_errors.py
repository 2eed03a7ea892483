"""Error types that keep migrated scripts' ``except`` clauses working.

The core reports a mistake in a collective (ranks disagree about shape, dtype, op or root rank;
bad splits; unknown process set) as ``ValueError``. Horovod's torch and TensorFlow adapters
raised ``RuntimeError`` for the same mistakes, so the adapters re-raise it as
:class:`CollectiveError`, which is both.
"""


class CollectiveError(ValueError, RuntimeError):
    """A collective was called wrongly or ranks disagree about it (raised on every rank).

    Both a ``ValueError`` (spark_hvd's documented error) and a ``RuntimeError`` (what Horovod
    raised), so handlers written for either catch it.
    """


class UnsupportedError(CollectiveError, NotImplementedError):
    """A well-formed request that is not implemented, where Horovod raised
    ``NotImplementedError`` too (Adasum over a number of ranks that is not a power of two); a
    :class:`CollectiveError` as well, like spark_hvd's other refusals."""


def as_collective_error(exc):
    """``exc`` as a :class:`CollectiveError` when it is a plain ``ValueError``."""
    if isinstance(exc, ValueError) and not isinstance(exc, CollectiveError):
        new = CollectiveError(*exc.args)
        new.__cause__ = None
        return new.with_traceback(exc.__traceback__)
    return exc
