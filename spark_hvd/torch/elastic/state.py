"""Horovod's ``TorchState`` and its handler registry (``get_handler_registry``,
``set_handler_registry``): each tracked object gets the handler of the first type it is an
instance of; anything else is a plain Python value. Every handler describes its object before a
sync (shapes, sampler progress), so mismatched ranks raise on every rank instead of hanging
(see :mod:`spark_hvd.common._elastic_states`)."""

import copy

import torch

from ...common._elastic_sampler import check_fingerprints
from ...common._elastic_states import Handler, SyncedState, check_variables
from ...common.basics import rank
from ...common.process_sets import global_process_set
from ..functions import _broadcast_optimizer_state, broadcast_object, broadcast_parameters
from .sampler import ElasticSampler

# Horovod's name for the handler base class: handlers written for Horovod subclass it.
StateHandler = Handler


def _named(tensors):
    return [(name, t.shape, t.dtype) for name, t in tensors]


class ModelStateHandler(StateHandler):
    """A ``torch.nn.Module``: its ``state_dict()`` (parameters and buffers)."""

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)

    def spec(self):
        return _named(self.value.state_dict().items())

    def check(self, specs):
        return check_variables("model", specs)

    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0, prefix="elastic.model.")


class OptimizerStateHandler(StateHandler):
    """A ``torch.optim.Optimizer``: its ``state_dict()``. A rank whose optimizer has no
    state yet (a new worker) receives rank 0's slots at sync."""

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)

    def spec(self):
        params = [(f"group {g} parameter {i}", p.shape, p.dtype)
                  for g, group in enumerate(self.value.param_groups)
                  for i, p in enumerate(group["params"])]
        return type(self.value).__name__, params

    def check(self, specs):
        kinds = [kind for kind, _ in specs]
        problems = [f"rank {r}'s optimizer is a {kind}, rank 0's a {kinds[0]}"
                    for r, kind in enumerate(kinds) if kind != kinds[0]]
        return problems or check_variables("optimizer", [params for _, params in specs])

    def sync(self):
        _broadcast_optimizer_state(self.value, 0, "elastic.optimizer", "elastic.optimizer.",
                                   global_process_set)


class SamplerStateHandler(StateHandler):
    """An :class:`ElasticSampler`: its progress; split again over the ranks after every
    reset and sync."""

    def save(self):
        self.value.save()

    def restore(self):
        self.value.restore()

    def spec(self):
        return self.value.fingerprint()

    def check(self, specs):
        return check_fingerprints(specs)

    def sync(self):
        payload = self.value.sync_payload() if rank() == 0 else None
        self.value.load_synced(broadcast_object(payload, 0, name="elastic.sampler"))

    def reset(self):
        self.value.reset()


class StateDictHandler(StateHandler):
    """Any other object with ``state_dict()`` / ``load_state_dict()`` (LR schedulers, AMP
    grad scalers): synced as a Python object, loaded into the user's own object (a plain
    attribute would be replaced by a copy bound to a copy of the optimizer)."""

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def spec(self):
        return type(self.value).__name__

    def sync(self):
        state = self.value.state_dict() if rank() == 0 else None
        self.value.load_state_dict(broadcast_object(state, 0, name="elastic.state_dict"))


_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
    (torch.optim.lr_scheduler.LRScheduler, StateDictHandler),
    (torch.amp.GradScaler, StateDictHandler),
]


def get_handler_registry():
    """``[(type, handler class)]``, first match wins (Horovod's)."""
    return _handler_registry


def set_handler_registry(registry):
    """Replaces the registry used by the ``TorchState`` objects created from now on."""
    global _handler_registry
    _handler_registry = registry


def _get_handler(value):
    for handler_type, handler_cls in _handler_registry:
        if isinstance(value, handler_type):
            return handler_cls(value)
    return None


class TorchState(SyncedState):
    """State of a PyTorch training process (Horovod's ``TorchState``).

    Args:
        model: optional ``torch.nn.Module``.
        optimizer: optional ``torch.optim.Optimizer``.
        kwargs: more state, exposed as attributes: modules, optimizers, ``ElasticSampler``
            objects, LR schedulers and grad scalers are tracked by their handlers, anything
            else as a plain (picklable) Python value, deep-copied at every commit.
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {}
        for name, value in kwargs.items():
            handler = _get_handler(value)
            if handler is not None:
                handlers[name] = handler
        plain = {k: v for k, v in kwargs.items() if k not in handlers}
        super().__init__(handlers, get_rank=rank, **plain)
