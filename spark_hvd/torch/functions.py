"""Making every rank start from the same state: parameters, optimizer state, Python objects.

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
"""

import torch

from ..common.basics import rank
from ..common.objects import allgather_object, broadcast_object
from ..common.process_sets import global_process_set, process_set_id
from .collectives import _auto_name, _broadcast_many_, synchronize

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters"]


def _wire(tensor):
    """The tensor as the core can move it (complex numbers as pairs of reals)."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def broadcast_parameters(params, root_rank, prefix=None, process_set=global_process_set):
    """Overwrites ``params`` on every rank with the root rank's values, in place.

    Args:
        params: ``model.state_dict()`` (a dict name -> tensor), ``model.named_parameters()``
            or a list of ``(name, tensor)`` pairs or of tensors.
        root_rank: the rank whose values win: a global rank, as in Horovod, that belongs to
            ``process_set``.
        prefix: optional prefix of the ops' names.
        process_set: the ranks taking part.

    All tensors are submitted at once and fused by the core.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (str, bytes)) or not hasattr(params, "__iter__"):
        raise ValueError(f"invalid params of type: {type(params)}")
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    set_id = process_set_id(process_set)
    scope = f"broadcast.set{set_id}." if set_id else "broadcast."
    tensors, names = [], []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name!r} is a {type(p).__name__}, not a "
                             "tensor; broadcast other values with broadcast_object")
        tensors.append(_wire(p))
        names.append(None if name is None else f"{scope}{prefix or ''}{name}")
    synchronize(_broadcast_many_(tensors, root_rank, names, process_set))


class _TensorSlot:
    """Stands for the ``index``-th tensor of a broadcast optimizer state."""

    __slots__ = ("index", "shape", "dtype", "cuda")

    def __init__(self, index, shape, dtype, cuda=False):
        # cuda: the root's tensor is on a GPU, so every rank receives it into one (the core
        # wants the same kind of memory on every rank); the others use their current device.
        self.index, self.shape, self.dtype, self.cuda = index, shape, dtype, cuda

    def __reduce__(self):
        return _TensorSlot, (self.index, self.shape, self.dtype, self.cuda)


def _split_tensors(value, tensors):
    """``value`` with every tensor replaced by a :class:`_TensorSlot` (appended to
    ``tensors``): the skeleton travels by pickle, the tensors by broadcast."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _TensorSlot(len(tensors) - 1, tuple(value.shape), value.dtype, value.is_cuda)
    if isinstance(value, dict):
        return {k: _split_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_split_tensors(v, tensors) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_split_tensors(v, tensors) for v in value)
    return value


def _join_tensors(value, tensors):
    if isinstance(value, _TensorSlot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _join_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_join_tensors(v, tensors) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_join_tensors(v, tensors) for v in value)
    return value


def _place_state(value, param, key, group):
    """Puts a received state tensor on the parameter's device, in the root's dtype; ``step``
    stays on the CPU unless the optimizer is ``capturable``/``fused``. Unlike
    ``load_state_dict``, which casts every floating-point state tensor to the parameter's
    dtype, the root's dtype is kept: scalar state such as NAdam's ``mu_product`` or ASGD's
    ``eta`` is float32 next to float64 parameters, and a cast copy would make later steps round
    differently from the root's."""
    if isinstance(value, torch.Tensor):
        if key == "step":
            if group.get("capturable") or group.get("fused"):
                return value.to(device=param.device, dtype=torch.float32)
            return value
        return value.to(device=param.device)
    if isinstance(value, dict):
        return {k: _place_state(v, param, key, group) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_place_state(v, param, key, group) for v in value)
    return value


def _reuse(old, new):
    """Writes ``new`` into the existing state tensor ``old`` when they match (references the
    user holds stay valid); returns the tensor to keep."""
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and \
            old.shape == new.shape and old.dtype == new.dtype and old.device == new.device:
        with torch.no_grad():
            old.copy_(new)
        return old
    return new


def broadcast_optimizer_state(optimizer, root_rank, prefix="Parameter.",
                              process_set=global_process_set):
    """Makes every rank's optimizer state (per-parameter state such as momentum buffers and
    Adam moments, and every parameter group's options such as ``lr`` and ``betas``) equal to
    the root rank's, for any ``torch.optim.Optimizer`` (a ``DistributedOptimizer`` too).

    State that the root has created lazily (after its first ``step()``) is created on the other
    ranks; scalars and non-tensor options keep their Python types. Tensors are broadcast in
    one fused batch, the rest (the structure) as one pickled object. Unlike Horovod, no dummy
    ``step()`` is taken to create state first, so parameters are never touched; as after
    Horovod's dummy step, an optimizer with no state yet leaves every parameter that requires
    grad with a ``.grad`` (zeros where it had none), which scripts may read.

    Every rank's optimizer must hold the same number of parameters per group, in the same
    order (build the model and optimizer the same way on every rank).
    """
    if process_set is None:
        process_set = global_process_set
    if not process_set.included():
        return
    base = _auto_name("broadcast_optimizer_state", None, process_set_id(process_set))
    _broadcast_optimizer_state(optimizer, root_rank, base, prefix, process_set)


def _broadcast_optimizer_state(optimizer, root_rank, base, prefix, process_set):
    """:func:`broadcast_optimizer_state` with its ops named after ``base`` (the elastic state
    names them itself: a newcomer's unnamed-op counters differ from a survivor's)."""
    if not optimizer.state:
        _zero_missing_grads(optimizer)
    me = rank()
    tensors = []
    skeleton = None
    if me == root_rank:
        skeleton = _split_tensors(optimizer.state_dict(), tensors)
    skeleton = broadcast_object(skeleton, root_rank, name=f"{base}.structure",
                                process_set=process_set)
    if me != root_rank:
        slots = []
        _collect_slots(skeleton, slots)
        slots.sort(key=lambda s: s.index)
        tensors = [torch.empty(s.shape, dtype=s.dtype, device=_receiving_device(s))
                   for s in slots]
    names = [f"{prefix}{base}.{i}" for i in range(len(tensors))]
    if tensors:
        synchronize(_broadcast_many_([_wire(t) for t in tensors], root_rank, names,
                                     process_set))
    if me == root_rank:
        return
    _apply_state(optimizer, _join_tensors(skeleton, tensors))


def _receiving_device(slot):
    if slot.cuda and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")  # a rank without CUDA: the core names the mismatch


def _zero_missing_grads(optimizer):
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def _collect_slots(value, out):
    if isinstance(value, _TensorSlot):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_slots(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_slots(v, out)


def _apply_state(optimizer, state_dict):
    groups, root_groups = optimizer.param_groups, state_dict["param_groups"]
    local_sizes = [len(g["params"]) for g in groups]
    root_sizes = [len(g["params"]) for g in root_groups]
    if local_sizes != root_sizes:
        raise ValueError(f"broadcast_optimizer_state: this rank's optimizer has parameter "
                         f"groups of sizes {local_sizes}, the root's {root_sizes}; build the "
                         "model and optimizer identically on every rank")
    param_of = {}
    for group, root_group in zip(groups, root_groups):
        for p, index in zip(group["params"], root_group["params"]):
            param_of[index] = (p, group)
        for key, value in root_group.items():
            if key != "params":
                group[key] = _reuse(group.get(key), value)
    new_state = {}
    for index, entries in state_dict["state"].items():
        p, group = param_of[index]
        old = optimizer.state.get(p, {})
        new_state[p] = {k: _reuse(old.get(k), _place_state(v, p, k, group))
                        for k, v in entries.items()}
    optimizer.state.clear()
    optimizer.state.update(new_state)
