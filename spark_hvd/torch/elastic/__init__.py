"""Horovod's ``horovod.torch.elastic`` (``hvd.elastic``) on spark_hvd.

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...

``TorchState`` keeps models, optimizers, LR schedulers, ``ElasticSampler`` objects and plain
Python values; ``sync()`` makes every rank's rank 0's (after checking that the ranks' states
match), ``commit()`` keeps a copy in host memory and ``restore()`` returns to it.
``ElasticSampler`` processes every sample of an epoch exactly once while ranks come and go (see
:mod:`spark_hvd.torch.elastic.sampler`). ``run`` is :func:`spark_hvd.common.elastic.run_fn`.
"""

from ...common.basics import init, shutdown
from ...common.elastic import ElasticNotSupportedError, ObjectState, State, run_fn
from .sampler import ElasticSampler
from .state import TorchState

__all__ = ["ElasticNotSupportedError", "ElasticSampler", "ObjectState", "State", "TorchState",
           "init", "run", "run_fn", "shutdown"]


def run(func):
    """Horovod's elastic decorator: ``func(state, ...)`` runs until it returns, syncing
    ``state`` first and again after every reset (see :func:`spark_hvd.common.elastic.run_fn`).
    """
    return run_fn(func, reset=None)
