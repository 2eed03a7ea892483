"""Averaging gradients across ranks: the step shared by ``DistributedGradientTape``, the
``tf.compat.v1`` ``DistributedOptimizer`` and ``spark_hvd.keras.DistributedOptimizer``.

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)   # averaged over the ranks

The dense gradients of one step go to the core as one grouped allreduce (one graph node, one
negotiation, fused into as few collectives as the fusion buffer allows) rather than one
blocking call per variable. ``tf.IndexedSlices`` (embedding gradients) are allgathered as
values and indices unless ``sparse_as_dense``. With one rank in the process set gradients are
returned unchanged (as in Horovod).

Model parallelism: variables registered as local (``register_local_source`` on the tape,
``register_local_var`` on the optimizers, or the ``local_layers`` of
``PartialDistributedGradientTape`` and ``spark_hvd.keras.PartialDistributedOptimizer``) are
never communicated; with ``scale_local_gradients`` (the default, as in Horovod) their
gradients are divided by the set size, so they are scaled like the averaged ones.
"""

import tensorflow as tf

from ..common.gradients import (BaseGradientAllreducer, check_adasum_size, check_optimizer_args,
                                checked_local_layers)
from ..common.process_sets import global_process_set
from .collectives import Average, allreduce_list, member_count
from .compression import Compression
from .differentiable import _sparse_allreduce


def _is_variable_or_tensor(x):
    return isinstance(x, (tf.Variable, tf.Tensor)) or hasattr(x, "assign")


def dense_for_accumulation(grad, sparse_as_dense):
    """``grad`` as a dense tensor to add into a local sum (``backward_passes_per_step > 1``);
    ``tf.IndexedSlices`` only with ``sparse_as_dense``, as in Horovod."""
    if isinstance(grad, tf.IndexedSlices):
        if not sparse_as_dense:
            raise ValueError("IndexedSlices are not supported when `backward_passes_per_step` > "
                             "1 and `sparse_as_dense` is False: pass sparse_as_dense=True to "
                             "accumulate them as dense gradients.")
        return tf.convert_to_tensor(grad)
    return grad


def check_args(op, gradient_predivide_factor, num_groups, groups, process_set):
    """Horovod's argument rules; returns ``groups``."""
    groups = check_optimizer_args(op, gradient_predivide_factor, num_groups, groups,
                                  is_tensor=_is_variable_or_tensor)
    check_adasum_size(op, member_count(process_set))
    return groups


class GradientAllreducer(BaseGradientAllreducer):
    """Averages (or sums) a list of TF gradients across the ranks of a process set, eagerly
    or inside a ``tf.function``; ``tf.IndexedSlices`` are allgathered unless
    ``sparse_as_dense``."""

    def __init__(self, compression=Compression.none, sparse_as_dense=False, op=Average,
                 gradient_predivide_factor=1.0, groups=None, process_set=global_process_set,
                 name=None, scale_local_gradients=True):
        super().__init__(compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                         process_set, name, scale_local_gradients, member_count)

    def _allreduce_group(self, tensors):
        return allreduce_list(tensors, self.name, self.op, self.prescale, self.postscale,
                              self.process_set, grouped=True)

    def _tracing(self):
        return not tf.executing_eagerly()

    def _is_sparse(self, grad):
        return isinstance(grad, tf.IndexedSlices)

    def _sparse_allreduce(self, grad):
        return _sparse_allreduce(grad, None, self.op, self.prescale, self.postscale,
                                 self.process_set)

    def _to_dense(self, grad):
        return tf.convert_to_tensor(grad)

    def _divided(self, grad, n):
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values / tf.cast(n, grad.values.dtype), grad.indices,
                                    grad.dense_shape)
        return grad / tf.cast(n, grad.dtype)

    def _is_variable(self, value):
        return _is_variable_or_tensor(value)

    @tf.autograph.experimental.do_not_convert
    def __call__(self, grads, variables=None, scale_local=True):
        """``grads`` reduced across ranks (None entries stay None); the gradients of local
        variables stay on this rank (scaled unless ``scale_local`` is False)."""
        return super().__call__(grads, variables, scale_local)


class _DistributedGradientTape:
    """Methods mixed into the wrapped tape's class (see :func:`DistributedGradientTape`)."""

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """The tape's gradients, averaged across the ranks (one grouped allreduce).
        ``use_generic_names`` is accepted for Horovod compatibility (collectives are named by
        position); ``tf.GradientTape``'s ``unconnected_gradients`` works by keyword or in
        its usual fourth place."""
        if isinstance(use_generic_names, (tf.UnconnectedGradients, str)):
            unconnected_gradients = use_generic_names
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_grads = tf.nest.flatten(grads)
        flat_sources = tf.nest.flatten(sources)
        reduced = self._hvd_allreducer(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)

    def register_local_source(self, source):
        """Keeps ``source``'s gradient on this rank (model parallelism): it is not averaged,
        only divided by the set size when ``scale_local_gradients`` (the default)."""
        self._hvd_allreducer.register_local(source)


_tape_classes = {}


def DistributedGradientTape(gradtape, device_dense='', device_sparse='',
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True):
    """Wraps a ``tf.GradientTape`` so that ``gradient()`` averages the gradients across ranks.

    Args:
        gradtape: the tape (entered or already exited: the wrapper shares its recording).
        compression: ``Compression.none`` or ``Compression.fp16``.
        sparse_as_dense: densify ``tf.IndexedSlices`` gradients before the allreduce
            (otherwise their values and indices are allgathered).
        op: ``Average`` (default), ``Sum`` or ``Adasum`` (the gradients are combined with
            Adasum: a power-of-two number of ranks; do not scale the learning rate by size).
        gradient_predivide_factor: with op=Average, gradients are divided by this factor
            before the sum and by ``size / factor`` after.
        num_groups: deprecated spelling of ``groups=<int>``.
        groups: an int (split the gradients into that many grouped allreduces) or lists of
            variables reduced together (the others are reduced one by one).
        process_set: the ranks that average their gradients.
        scale_local_gradients: divide the gradients of local sources (registered with the
            result's ``register_local_source``) by the set size, as in Horovod.

    ``device_dense`` and ``device_sparse`` are accepted for Horovod compatibility. The result
    is an instance of a subclass of the tape's class.
    """
    groups = check_args(op, gradient_predivide_factor, num_groups, groups, process_set)
    base = type(gradtape)
    if isinstance(gradtape, _DistributedGradientTape):
        raise ValueError("gradtape is already a DistributedGradientTape")
    cls = _tape_classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedGradientTape, base),
                   {"__module__": __name__, "__doc__": base.__doc__})
        _tape_classes[base] = cls
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._hvd_allreducer = GradientAllreducer(compression, sparse_as_dense, op,
                                              gradient_predivide_factor, groups, process_set,
                                              name=None,
                                              scale_local_gradients=scale_local_gradients)
    return tape


def PartialDistributedGradientTape(gradtape, device_dense='', device_sparse='',
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """``DistributedGradientTape`` that leaves the gradients of ``local_layers`` on each rank
    (model parallelism: layers whose weights differ between ranks on purpose).

    Args:
        local_layers: a Keras layer or a collection of them; their trainable variables (also
            those created when the first step builds the layers) are local sources. None:
            the same as ``DistributedGradientTape``.
        scale_local_gradients: divide the local gradients by the set size (Horovod's default).

    The other arguments are ``DistributedGradientTape``'s.
    """
    layers = checked_local_layers(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    tape._hvd_allreducer.register_local_layers(layers)
    return tape
