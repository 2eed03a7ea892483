"""The object collectives with Horovod's TensorFlow and Keras signatures (a ``session``
argument, accepted for TF1 scripts and unused: objects travel outside any graph). Free of any
framework, so spark_hvd.tensorflow and spark_hvd.keras on every Keras backend share them."""

from . import objects as _objects
from .process_sets import global_process_set

__all__ = ["allgather_object", "broadcast_object", "broadcast_object_fn"]


def broadcast_object(obj, root_rank=0, session=None, name=None,
                     process_set=global_process_set):
    """Returns ``root_rank``'s ``obj`` (any picklable object) on every rank of
    ``process_set``. ``session`` is accepted for Horovod compatibility (the object travels
    outside any graph)."""
    return _objects.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function ``fn(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's form for
    repeated broadcasts)."""
    def fn(obj):
        return broadcast_object(obj, root_rank, session, name, process_set)
    return fn


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Returns the list of every rank's ``obj`` (pickled), in rank order."""
    return _objects.allgather_object(obj, name=name, process_set=process_set)
