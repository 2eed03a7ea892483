"""The public collectives on ``tf.Tensor``, with Horovod's signatures and gradients.

Each op works eagerly and inside ``tf.function``. Floating-point inputs go through
``tf.custom_gradient`` so ``tf.GradientTape`` differentiates across ranks with the rules in
``spark_hvd.common.gradients``: every rank must run backward through the same collectives in
the same order, as it ran forward. ``device_dense`` / ``device_sparse`` / ``ignore_name_scope``
are accepted for Horovod compatibility (tensors are staged through host memory).
"""

import tensorflow as tf

from ..common import basics
from ..common.compression import compressed
from ..common.gradients import (GRAD_OP_ALLGATHER, GRAD_OP_BROADCAST, reducescatter_grad_scale)
from ..common.process_sets import global_process_set
from .collectives import (Average, Sum, allgather_list, allreduce_list, alltoall_pair,
                          broadcast_list, member_count, member_index, reduce_op,
                          reducescatter_list, scatter_op)
from .compression import Compression

try:  # no tape watching: skip tf.custom_gradient's eager bookkeeping (about 1 ms per op)
    from tensorflow.python.eager.record import could_possibly_record as _tape_active
except ImportError:  # pragma: no cover - private module moved
    def _tape_active():
        return True

# AutoGraph would otherwise convert this Python plumbing on every trace (it is not user code
# and has no tensor-dependent control flow): tracing costs several times less without it.
_plain = tf.autograph.experimental.do_not_convert


def _differentiable(tensors, forward, backward):
    """``forward(tensors) -> outputs``; with a float input, registers ``backward(dys,
    outputs) -> input gradients`` through ``tf.custom_gradient``."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not any(t.dtype.is_floating or t.dtype.is_complex for t in tensors) or \
            (tf.executing_eagerly() and not _tape_active()):
        return forward(tensors)

    @tf.custom_gradient
    def op(*xs):
        ys = forward(list(xs))

        def grad(*dys):
            dys = [tf.zeros_like(y) if d is None else tf.convert_to_tensor(d)
                   for d, y in zip(dys, ys)]
            return backward(dys, ys)
        return ys, grad
    return list(op(*tensors))


# -- allreduce ------------------------------------------------------------------------------

def _allreduce_diff(tensors, name, op, pre, post, process_set, grouped):
    def forward(xs):
        return allreduce_list(xs, name, op, pre, post, process_set, grouped)

    def backward(dys, _ys):
        return allreduce_list(dys, None, op, pre, post, process_set, grouped)
    return _differentiable(tensors, forward, backward)


def _sparse_allreduce(slices, name, op, prescale, postscale, process_set):
    """Horovod's reduction of ``tf.IndexedSlices``: allgather values and indices (a sparse sum
    is the concatenation of the entries), divided by the set size for Average as Horovod
    divides (``values / size``: integer values become floating point). The scale factors serve
    the gradient reducers' predivide factor; the public ops refuse them, as Horovod does."""
    if op not in (Average, Sum):
        raise NotImplementedError("allreduce of tf.IndexedSlices supports op=Average and op=Sum "
                                  "only; densify it (sparse_as_dense=True) for other ops")
    values = allgather(slices.values, name=None if name is None else f"{name}.values",
                       process_set=process_set)
    indices = allgather(slices.indices, name=None if name is None else f"{name}.indices",
                        process_set=process_set)
    if op == Average:
        values = values / tf.cast(member_count(process_set), values.dtype)
    scale = float(prescale) * float(postscale)
    if scale != 1.0:
        values = values * tf.constant(scale, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


@_plain
def allreduce(tensor, average=None, device_dense='', device_sparse='',
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=global_process_set, ignore_name_scope=False):
    """Reduces ``tensor`` over the ranks of ``process_set``; returns a new tensor of the same
    shape and dtype, identical on every rank. Differentiable (the gradient is allreduced the
    same way).

    Args:
        tensor: ``tf.Tensor``, ``tf.Variable`` or ``tf.IndexedSlices`` (reduced by allgathering
            its values and indices); same shape and dtype on every rank.
        average: deprecated; ``True`` means op=Average, ``False`` op=Sum.
        compression: ``Compression.none`` or ``Compression.fp16`` (sent as float16).
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor, postscale_factor: multiply before / after the reduction.
        name: the op's name, identical on every rank (unnamed ops are numbered).
        process_set: the ranks taking part (default: all).
    """
    op = reduce_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotImplementedError("prescale_factor / postscale_factor are not supported with "
                                      "tf.IndexedSlices (as in Horovod): scale the values, or "
                                      "densify the slices first")
        return _sparse_allreduce(tensor, name, op, prescale_factor, postscale_factor,
                                 process_set)
    return compressed(compression, [tf.convert_to_tensor(tensor)], _allreduce_diff, name, op,
                      prescale_factor, postscale_factor, process_set, False)[0]


@_plain
def grouped_allreduce(tensors, average=None, device_dense='', device_sparse='',
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Allreduce of a list of tensors, negotiated together and fused; returns a list.
    Arguments as :func:`allreduce`. Differentiable."""
    op = reduce_op(op, average)
    tensors = list(tensors)
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [allreduce(t, op=op, compression=compression, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set)
                for t in tensors]
    return compressed(compression, [tf.convert_to_tensor(t) for t in tensors], _allreduce_diff,
                      name, op, prescale_factor, postscale_factor, process_set, True)


# -- allgather ------------------------------------------------------------------------------

def _first_dims(xs):
    """Each tensor's first dimension (1 for scalars) as an int64 vector."""
    return tf.stack([tf.constant(1, tf.int64) if x.shape.rank == 0
                     else tf.cast(tf.shape(x)[0], tf.int64) for x in xs])


def _allgather_diff(tensors, name, process_set, grouped):
    def forward(xs):
        return allgather_list(xs, name, process_set, grouped)

    def backward(dys, _ys):
        reduced = allreduce_list(dys, None, GRAD_OP_ALLGATHER, 1.0, 1.0, process_set, grouped)
        dims = _first_dims(tensors)
        # Every member's first dimensions, one row per member.
        all_dims = allgather_list([tf.reshape(dims, [1, -1])], None, process_set, False)[0]
        me = member_index(process_set)
        offsets = tf.reduce_sum(all_dims[:me], axis=0)
        grads = []
        for i, (x, g) in enumerate(zip(tensors, reduced)):
            piece = g[offsets[i]:offsets[i] + dims[i]]
            grads.append(tf.reshape(piece, []) if x.shape.rank == 0 else piece)
        return grads
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    return _differentiable(tensors, forward, backward)


@_plain
def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenates every rank's ``tensor`` along the first dimension, in rank order. The
    first dimension may differ between ranks; the others must agree. Differentiable (the
    gradient is this rank's slice of the averaged gradient)."""
    return _allgather_diff([tensor], name, process_set, grouped=False)[0]


@_plain
def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """Allgather of each tensor of a list, negotiated together; returns a list.
    Differentiable."""
    tensors = list(tensors)
    if not tensors:
        return []
    return _allgather_diff(tensors, name, process_set, grouped=True)


# -- broadcast ------------------------------------------------------------------------------

@_plain
def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Returns ``root_rank``'s ``tensor`` on every rank of ``process_set`` (``root_rank`` is a
    global rank, as in Horovod, and must belong to the set). Differentiable: the gradient is averaged over the ranks onto the root,
    zero elsewhere."""
    root_rank = int(root_rank)

    def forward(xs):
        return broadcast_list(xs, root_rank, name, process_set)

    def backward(dys, _ys):
        reduced = allreduce_list(dys, None, GRAD_OP_BROADCAST, 1.0, 1.0, process_set, False)
        if basics.rank() != root_rank:
            # Zeros that depend on the allreduce: the root waits for this rank's part, and in a
            # tf.compat.v1 graph TensorFlow would prune an allreduce nothing reads (zeros_like
            # of a known shape folds into a constant), hanging the root.
            with tf.control_dependencies(reduced):
                return [tf.zeros(tf.shape(r), r.dtype) for r in reduced]
        return reduced
    return _differentiable([tensor], forward, backward)[0]


# -- alltoall -------------------------------------------------------------------------------

@_plain
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Sends ``splits[i]`` consecutive rows of ``tensor`` to member ``i`` (without
    ``splits`` the first dimension is divided evenly). Returns the received rows concatenated
    in rank order and, when ``splits`` is given, also the received splits as an int32 vector
    (Horovod's return values). Differentiable: the gradient is sent back with the received
    splits."""
    def forward(xs):
        return alltoall_pair(xs[0], splits, name, process_set)

    def backward(dys, ys):
        grad, _ = alltoall_pair(dys[0], ys[1], None, process_set)
        return [grad]
    out, received = _differentiable([tensor], forward, backward)
    return (out, received) if splits is not None else out


# -- reducescatter --------------------------------------------------------------------------

def _reducescatter_diff(tensors, name, op, process_set, pre, post, grouped):
    def forward(xs):
        return reducescatter_list(xs, name, op, process_set, pre, post, grouped)

    def backward(dys, _ys):
        gathered = allgather_list(dys, None, process_set, grouped)
        scale = reducescatter_grad_scale(op, member_count(process_set), pre, post)
        if scale != 1.0:
            gathered = [g * tf.constant(scale, g.dtype) for g in gathered]
        return gathered
    return _differentiable(tensors, forward, backward)


@_plain
def reducescatter(tensor, device_dense='', compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduces ``tensor`` over the ranks (op=Average or Sum) and returns this rank's block of
    the first dimension: with ``d`` rows and ``n`` ranks the first ``d % n`` ranks get
    ``d // n + 1`` rows, the others ``d // n``. Differentiable (the gradient is allgathered)."""
    op = scatter_op(op)
    return compressed(compression, [tf.convert_to_tensor(tensor)], _reducescatter_diff, name,
                      op, process_set, prescale_factor, postscale_factor, False)[0]


@_plain
def grouped_reducescatter(tensors, device_dense='', compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0, name=None):
    """Reducescatter of each tensor of a list, negotiated together; returns a list.
    Differentiable."""
    op = scatter_op(op)
    return compressed(compression, [tf.convert_to_tensor(t) for t in tensors],
                      _reducescatter_diff, name, op, process_set, prescale_factor,
                      postscale_factor, True)
