"""Horovod's ``horovod.torch.elastic`` (``hvd.elastic``) on spark_hvd.

``TorchState`` and ``ObjectState`` work in a fixed-size job (``sync()`` makes every rank's
models, optimizers and objects rank 0's; ``commit()`` / ``restore()`` keep and bring back a copy
in host memory). ``run`` and ``ElasticSampler`` need elastic training, which is not implemented
yet: they raise :class:`~spark_hvd.common.elastic.ElasticNotSupportedError` naming the
alternatives (see :mod:`spark_hvd.common.elastic`).
"""

import copy
import functools

import torch

from ..common.basics import rank
from ..common.elastic import (ElasticNotSupportedError, HandledState, ObjectState, State,
                              StateHandler, refuse, run_fn)
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["ElasticNotSupportedError", "ElasticSampler", "ObjectState", "State", "TorchState",
           "run", "run_fn"]


def run(func):
    """Horovod's elastic decorator: refused (elastic training is not implemented yet)."""
    return run_fn(func, reset=None)


class ElasticSampler:
    """Horovod's sampler that re-shards a dataset when ranks come and go: refused.

    In a fixed-size job use ``torch.utils.data.distributed.DistributedSampler(dataset,
    num_replicas=hvd.size(), rank=hvd.rank())``.
    """

    def __init__(self, *args, **kwargs):
        del args, kwargs
        refuse("hvd.elastic.ElasticSampler (in a fixed-size job use torch.utils.data."
               "distributed.DistributedSampler(dataset, num_replicas=hvd.size(), "
               "rank=hvd.rank()))")


class _StateDictHandler(StateHandler):
    """A module or optimizer: saved as a deep copy of its ``state_dict()``."""

    def __init__(self, value, sync):
        self._sync = sync
        super().__init__(value)

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)

    def sync(self):
        self._sync(self.value)


def _sync_module(module):
    broadcast_parameters(module.state_dict(), root_rank=0)


_SYNC_BY_TYPE = (
    (torch.nn.Module, _sync_module),
    (torch.optim.Optimizer, functools.partial(broadcast_optimizer_state, root_rank=0)),
)


def _handler(value):
    for cls, sync in _SYNC_BY_TYPE:
        if isinstance(value, cls):
            return _StateDictHandler(value, sync)
    return None


class TorchState(HandledState):
    """State of a PyTorch training process (Horovod's ``TorchState``).

    Args:
        model: optional ``torch.nn.Module``.
        optimizer: optional ``torch.optim.Optimizer``.
        kwargs: more state, exposed as attributes: modules and optimizers are tracked through
            their ``state_dict()``, anything else as a plain (picklable) Python object.
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {}
        for name, value in kwargs.items():
            handler = _handler(value)
            if handler is not None:
                handlers[name] = handler
        plain = {k: v for k, v in kwargs.items() if k not in handlers}
        super().__init__(handlers, bcast_object=broadcast_object, get_rank=rank, **plain)
