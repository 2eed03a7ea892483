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

import warnings

import tensorflow as tf

from ..common.gradients import check_adasum_size, check_optimizer_args, form_groups, scale_factors
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


class GradientAllreducer:
    """Averages (or sums) a list of gradients across the ranks of a process set."""

    def __init__(self, compression=Compression.none, sparse_as_dense=False, op=Average,
                 gradient_predivide_factor=1.0, groups=None, process_set=global_process_set,
                 name=None, scale_local_gradients=True):
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.prescale, self.postscale = scale_factors(op, gradient_predivide_factor)
        self.groups = groups
        self.process_set = process_set if process_set is not None else global_process_set
        self.name = name
        self.scale_local_gradients = scale_local_gradients
        # id -> variable: holding the variable keeps its id from being reused.
        self._local = {}
        # Local layers, resolved to their variables at each call: a layer of a subclassed
        # model has none until the first step builds it.
        self._local_layers = []
        self._traced = False

    def _warn_if_traced(self):
        if self._traced:
            warnings.warn("a local variable was registered after a training step was traced: "
                          "steps traced before (model.fit's, a tf.function's) still average "
                          "it. Register local variables before the first step.", stacklevel=3)

    def register_local(self, variable):
        """Marks ``variable`` as this rank's own: its gradient is never communicated.
        Register before the first traced step (a traced function keeps what it saw)."""
        if not _is_variable_or_tensor(variable):
            raise ValueError(f"register a variable as local, got {type(variable).__name__}")
        self._warn_if_traced()
        self._local[id(variable)] = variable

    def register_local_layers(self, layers):
        """Marks every trainable variable of ``layers`` as local, including variables the
        layers create after this call (when the first step builds them)."""
        self._warn_if_traced()
        self._local_layers.extend(layers)

    def _local_ids(self):
        ids = set(self._local)
        for layer in self._local_layers:
            ids.update(id(v) for v in layer.trainable_weights)
        return ids

    def _scaled_local(self, grad):
        """A local gradient divided by the set size (``scale_local_gradients``)."""
        if grad is None or not self.scale_local_gradients:
            return grad
        n = member_count(self.process_set)
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values / tf.cast(n, grad.values.dtype), grad.indices,
                                    grad.dense_shape)
        return grad / tf.cast(n, grad.dtype)

    def active(self):
        """False when there is nothing to average with (one rank, or not a member)."""
        ps = self.process_set
        if ps is not global_process_set and not ps.included():
            return False
        return member_count(ps) > 1

    def _dense_groups(self, positions, variables):
        """Lists of positions (into the gradient list) reduced together."""
        if self.groups is None or variables is None:
            return [positions]
        members = [variables[i] for i in positions]
        index = {id(v): i for i, v in zip(positions, members)}
        return [[index[id(v)] for v in group]
                for group in form_groups(members, self.groups, None)]

    @tf.autograph.experimental.do_not_convert
    def __call__(self, grads, variables=None, scale_local=True):
        """``grads`` reduced across ranks (None entries stay None); the gradients of local
        variables stay on this rank (scaled unless ``scale_local`` is False)."""
        grads = list(grads)
        if not tf.executing_eagerly():
            self._traced = True
        if not self.active():
            return grads
        out = list(grads)
        variables = list(variables) if variables is not None else None
        local = self._local_ids() if variables is not None else ()
        dense = []
        for i, g in enumerate(grads):
            if g is None:
                continue
            if local and id(variables[i]) in local:
                out[i] = self._scaled_local(g) if scale_local else g
                continue
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    out[i] = _sparse_allreduce(g, None, self.op, self.prescale, self.postscale,
                                               self.process_set)
                    continue
                g = tf.convert_to_tensor(g)
                grads[i] = g
            dense.append(i)
        for group in self._dense_groups(dense, variables):
            pairs = [self.compression.compress(tf.convert_to_tensor(grads[i])) for i in group]
            reduced = allreduce_list([c for c, _ in pairs], self.name, self.op, self.prescale,
                                     self.postscale, self.process_set, grouped=True)
            for i, r, (_, ctx) in zip(group, reduced, pairs):
                out[i] = self.compression.decompress(r, ctx)
        return out


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


def checked_local_layers(local_layers):
    """``local_layers`` (one Keras layer or a collection of them) as a list, with Horovod's
    error for anything else."""
    import keras
    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        return [local_layers]
    local_layers = list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    return local_layers


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
