"""The synchronous collectives, differentiable with Horovod's gradient rules.

Each function runs its asynchronous form and waits. When the input requires a gradient (and
grad mode is on) it goes through a ``torch.autograd.Function`` whose backward runs the
collective that the rule in ``spark_hvd.common.gradients`` prescribes, so gradients flow
across ranks: every rank must run backward through the same collectives in the same order,
as it ran forward.
"""

import torch

from ..common.basics import rank
from ..common.compression import compressed
from ..common.gradients import (GRAD_OP_ALLGATHER, GRAD_OP_BROADCAST, reducescatter_grad_scale,
                                slice_offset)
from ..common.process_sets import global_process_set
from .collectives import (Average, _reduce_op, _scatter_op, allgather_async, allreduce_async,
                          alltoall_async, broadcast_async, grouped_allgather_async,
                          grouped_allreduce_async, grouped_reducescatter_async,
                          reducescatter_async, synchronize)
from .compression import Compression


def _needs_grad(tensors):
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in tensors)


def _member_index(process_set):
    return process_set.rank()


def _member_count(process_set):
    return process_set.size()


# -- allreduce ------------------------------------------------------------------------------

class HorovodAllreduce(torch.autograd.Function):
    """Allreduce; the gradient is allreduced with the same op and scale factors."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, prescale_factor,
                                           postscale_factor, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        op, pre, post, ps = ctx.args
        grad = allreduce(grad_output, op=op, prescale_factor=pre, postscale_factor=post,
                         process_set=ps)
        return grad, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduces ``tensor`` over the ranks of ``process_set`` and returns the result as a new
    tensor (the input is not modified). Differentiable.

    Args:
        tensor: the tensor to reduce; same shape and dtype on every rank.
        average: deprecated; ``True`` means op=Average, ``False`` op=Sum.
        name: the op's name, identical on every rank (unnamed ops are numbered, so ranks must
            issue them in the same order).
        compression: ``Compression.none`` or ``Compression.fp16`` (sent as float16).
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor, postscale_factor: multiply before / after the reduction.
        process_set: the ranks taking part (default: all).
    """
    op = _reduce_op(op, average)
    return compressed(compression, [tensor], _allreduce_list, name, op, prescale_factor,
                      postscale_factor, process_set, False)[0]


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce; the gradients are grouped-allreduced with the same op."""

    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op,
                                                         prescale_factor, postscale_factor,
                                                         process_set)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        out = grouped_allreduce(list(grads), op=op, prescale_factor=pre, postscale_factor=post,
                                process_set=ps)
        return (None, None, None, None, None) + tuple(out)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Allreduce of a list of tensors, negotiated together and fused; returns a list of new
    tensors. Arguments as :func:`allreduce`. Differentiable."""
    op = _reduce_op(op, average)
    return compressed(compression, tensors, _allreduce_list, name, op, prescale_factor,
                      postscale_factor, process_set, True)


def _allreduce_list(tensors, name, op, pre, post, process_set, grouped):
    """Allreduce of the one tensor in ``tensors`` (or of them all, ``grouped``); a list of the
    results, through autograd when a gradient is needed."""
    if grouped:
        if _needs_grad(tensors):
            return HorovodGroupedAllreduce.apply(name, op, pre, post, process_set, *tensors)
        return synchronize(grouped_allreduce_async(tensors, None, name, op, pre, post,
                                                   process_set))
    if _needs_grad(tensors):
        return [HorovodAllreduce.apply(tensors[0], name, op, pre, post, process_set)]
    return [synchronize(allreduce_async(tensors[0], None, name, op, pre, post, process_set))]


# -- allgather ------------------------------------------------------------------------------

def _gathered_dims(dims, process_set):
    """Every member's first dimensions (a list per member) via one allgather."""
    local = torch.tensor([dims], dtype=torch.int64)
    return synchronize(allgather_async(local, process_set=process_set)).tolist()


class HorovodAllgather(torch.autograd.Function):
    """Allgather; the gradient is this rank's slice of the averaged gradient."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.scalar = tensor.dim() == 0
        ctx.dim = 1 if ctx.scalar else tensor.shape[0]
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        ps = ctx.process_set
        reduced = allreduce(grad_output, op=GRAD_OP_ALLGATHER, process_set=ps)
        dims = [d[0] for d in _gathered_dims([ctx.dim], ps)]
        grad = reduced.narrow(0, slice_offset(dims, _member_index(ps)), ctx.dim)
        return (grad.reshape(()) if ctx.scalar else grad), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's ``tensor`` along the first dimension, in rank order, and
    returns the new tensor. The first dimension may differ between ranks. Differentiable."""
    if _needs_grad([tensor]):
        return HorovodAllgather.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


class HorovodGroupedAllgather(torch.autograd.Function):
    """Grouped allgather; each gradient is this rank's slice of the averaged gradient."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.scalars = [t.dim() == 0 for t in tensors]
        ctx.dims = [1 if t.dim() == 0 else t.shape[0] for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        ps = ctx.process_set
        reduced = grouped_allreduce(list(grads), op=GRAD_OP_ALLGATHER, process_set=ps)
        all_dims = _gathered_dims(ctx.dims, ps)
        me = _member_index(ps)
        out = []
        for i, (g, scalar) in enumerate(zip(reduced, ctx.scalars)):
            offset = slice_offset([d[i] for d in all_dims], me)
            g = g.narrow(0, offset, ctx.dims[i])
            out.append(g.reshape(()) if scalar else g)
        return (None, None) + tuple(out)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather of each tensor of a list, negotiated together; returns a list.
    Differentiable."""
    tensors = list(tensors)
    if not tensors:
        return []
    if _needs_grad(tensors):
        return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))
    return synchronize(grouped_allgather_async(tensors, name, process_set))


# -- broadcast ------------------------------------------------------------------------------

class HorovodBroadcast(torch.autograd.Function):
    """Broadcast; the gradient is averaged over the ranks onto the root (zero elsewhere)."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        ps = ctx.process_set
        reduced = allreduce(grad_output, op=GRAD_OP_BROADCAST, process_set=ps)
        if rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Returns the ``root_rank``'s ``tensor`` on every rank (a new tensor; ``root_rank`` is
    a global rank, as in Horovod, and must belong to ``process_set``). The input is not modified. Differentiable."""
    if _needs_grad([tensor]):
        return HorovodBroadcast.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


# -- alltoall -------------------------------------------------------------------------------

class HorovodAlltoall(torch.autograd.Function):
    """Alltoall; the gradient is sent back by alltoall with the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.process_set = process_set
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = synchronize(alltoall_async(grad_output.contiguous(), ctx.received,
                                             process_set=ctx.process_set))
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends ``splits[i]`` consecutive rows of ``tensor`` to member ``i`` (without ``splits``
    the first dimension is divided evenly) and returns the rows received from every member,
    concatenated in rank order; when ``splits`` is given, returns ``(received, received
    splits)``. Differentiable."""
    if _needs_grad([tensor]):
        return HorovodAlltoall.apply(tensor, splits, name, process_set)
    out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return out if splits is None else (out, received)


# -- reducescatter --------------------------------------------------------------------------

class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter; the gradient is the allgathered gradient times the forward's scale."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                               postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        op, ps, pre, post = ctx.args
        grad = allgather(grad_output, process_set=ps)
        scale = reducescatter_grad_scale(op, _member_count(ps), pre, post)
        if scale != 1.0:
            grad = grad * scale
        return grad, None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces ``tensor`` over the ranks (op=Average or Sum) and returns this rank's block of
    the first dimension: with ``d`` rows and ``n`` ranks, the first ``d % n`` ranks get
    ``d // n + 1`` rows, the others ``d // n``. Differentiable."""
    op = _scatter_op(op)
    return compressed(compression, [tensor], _reducescatter_list, name, op, process_set,
                      prescale_factor, postscale_factor, False)[0]


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Grouped reducescatter; gradients are grouped-allgathered times the forward's scale."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op,
                                                             process_set, prescale_factor,
                                                             postscale_factor)))

    @staticmethod
    def backward(ctx, *grads):
        op, ps, pre, post = ctx.args
        gathered = grouped_allgather(list(grads), process_set=ps)
        scale = reducescatter_grad_scale(op, _member_count(ps), pre, post)
        if scale != 1.0:
            gathered = [g * scale for g in gathered]
        return (None, None, None, None, None) + tuple(gathered)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reducescatter of each tensor of a list, negotiated together; returns a list.
    Differentiable."""
    op = _scatter_op(op)
    return compressed(compression, tensors, _reducescatter_list, name, op, process_set,
                      prescale_factor, postscale_factor, True)


def _reducescatter_list(tensors, name, op, process_set, pre, post, grouped):
    """Reducescatter of the one tensor in ``tensors`` (or of them all, ``grouped``); a list
    of the results, through autograd when a gradient is needed."""
    if grouped:
        if _needs_grad(tensors):
            return HorovodGroupedReducescatter.apply(name, op, process_set, pre, post, *tensors)
        return synchronize(grouped_reducescatter_async(tensors, name, op, process_set, pre,
                                                       post))
    if _needs_grad(tensors):
        return [HorovodReducescatter.apply(tensors[0], name, op, process_set, pre, post)]
    return [synchronize(reducescatter_async(tensors[0], name, op, process_set, pre, post))]
