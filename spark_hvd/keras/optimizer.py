"""``DistributedOptimizer`` for Keras 3: gradients are averaged across ranks in ``apply``.

Keras 3 funnels every update through ``Optimizer.apply(grads, variables)`` on every backend
(``model.fit``'s train step calls ``apply_gradients``, or, on JAX, ``stateless_apply``, which
call ``apply``), so that is the hook: the gradients of one step go to the core together as
one grouped allreduce, then the wrapped optimizer applies them. How the gradients reach the
core is the backend's business (:mod:`spark_hvd.keras._backend`): TensorFlow's ops in the
``tf.function`` that ``model.fit`` traces, spark_hvd.torch's on torch, an ordered callback
out of the compiled step on JAX.

``backward_passes_per_step=N`` accumulates gradients locally; every N-th call allreduces the
sum (divided by N with ``average_aggregated_gradients``) and applies it. The calls in between
only advance ``optimizer.iterations`` (Horovod's semantics, so learning-rate schedules see every
step). On TensorFlow the sums live in (untracked) variables of spark_hvd's own; on torch and JAX
it is Keras' own ``gradient_accumulation_steps`` (its accumulators live in the optimizer's
state, which JAX's compiled step carries), and the accumulated gradients are reduced where Keras
applies them (``_clip_gradients``, on update steps only: in a ``lax.cond`` on JAX, whose
optimizer computes every step's update and keeps only the update steps'). A Keras optimizer
made with ``gradient_accumulation_steps`` gets the same on torch and JAX: one allreduce per
update, of the gradients averaged over its steps.

The optimizer is wrapped in place: its class becomes a subclass of its class with the same
name and module, so ``isinstance`` checks, ``get_config`` and saved models are those of the
plain optimizer (a saved model loads without spark_hvd; :func:`spark_hvd.keras.load_model`
wraps it again), and state it already has (after ``load_model``) is kept.
"""

import keras

from ..common._ops import Average
from ..common.gradients import check_adasum_size, check_optimizer_args, checked_local_layers
from ..common.process_sets import global_process_set
from . import _backend
from .compression import Compression


class _State:
    """spark_hvd's per-optimizer settings (a plain object: Keras does not track it)."""

    def __init__(self, allreducer, passes, average_aggregated, sparse_as_dense):
        self.allreducer = allreducer
        self.passes = passes
        self.average_aggregated = average_aggregated
        self.sparse_as_dense = sparse_as_dense
        self.accumulators = None
        self.counter = None
        # torch and JAX: Keras' own accumulation (gradient_accumulation_steps); the gradients of
        # the step being applied are reduced in _clip_gradients, for `variables`.
        self.keras_accumulation = False
        self.variables = None

    def build_accumulators(self, variables):
        if self.passes == 1 or self.accumulators is not None:
            return
        import tensorflow as tf
        with tf.init_scope():  # created once, outside any function being traced
            self.accumulators = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                                 for v in variables]
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False)


class _DistributedOptimizer:
    """Methods mixed into the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    def register_local_var(self, var):
        """Keeps ``var``'s gradient on this rank (model parallelism): it is not averaged, only
        divided by the set size when ``scale_local_gradients`` (the default). Register before
        the first step: ``model.fit`` traces the step once."""
        self._hvd.allreducer.register_local(var)

    def build(self, variables):
        """Builds the wrapped optimizer (and the gradient accumulators, if any)."""
        super().build(variables)
        self._hvd.build_accumulators(self._trainable_variables)

    @property
    def iterations(self):
        """Every ``apply`` counts (Horovod's semantics), also while gradients accumulate."""
        if self._hvd.keras_accumulation:
            return self._iterations
        return super().iterations

    def _backend_apply_gradients(self, grads, trainable_variables):
        # The variables of the gradients Keras hands _clip_gradients (empty ones filtered out).
        self._hvd.variables = list(trainable_variables)
        return super()._backend_apply_gradients(grads, trainable_variables)

    def _clip_gradients(self, grads):
        state = self._hvd
        if state.keras_accumulation:
            grads = _backend.current().on_update_step(self, self._hvd_reduce_accumulated, grads)
        return super()._clip_gradients(grads)

    def _hvd_reduce_accumulated(self, grads):
        """Keras' accumulated gradients (its mean over the passes), averaged across ranks;
        summed over the passes unless ``average_aggregated_gradients`` (Horovod's default)."""
        state = self._hvd
        reduced = state.allreducer(list(grads), state.variables)
        if not state.average_aggregated:
            reduced = [None if r is None else r * state.passes for r in reduced]
        return reduced

    @_backend.not_converted
    def apply(self, grads, trainable_variables=None):
        """Averages ``grads`` across ranks, then applies them with the wrapped optimizer."""
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        state = self._hvd
        if state.keras_accumulation:  # reduced by _clip_gradients on update steps
            return super().apply(grads, trainable_variables)
        if state.passes == 1:
            variables = trainable_variables if trainable_variables is not None else \
                getattr(self, "_trainable_variables", None)
            return super().apply(state.allreducer(grads, variables), trainable_variables)
        return self._hvd_accumulate(grads, trainable_variables)

    def _hvd_accumulate(self, grads, trainable_variables):
        import tensorflow as tf

        from ..tensorflow.gradient_tape import dense_for_accumulation
        if not self.built:
            if trainable_variables is None:
                raise ValueError("the optimizer must be built (or given the variables) before "
                                 "its first apply()")
            self.build(trainable_variables)
            self.built = True
        state = self._hvd
        state.build_accumulators(self._trainable_variables)
        variables = trainable_variables if trainable_variables is not None else \
            self._trainable_variables
        accumulators = [state.accumulators[self._get_variable_index(v)] for v in variables]
        for g, acc in zip(grads, accumulators):
            if g is None:
                continue
            g = dense_for_accumulation(g, state.sparse_as_dense)
            acc.assign_add(tf.cast(g, acc.dtype))
        state.counter.assign_add(1)
        present = [g is not None for g in grads]

        def communicate_and_apply():
            summed = [acc.read_value() if p else None for acc, p in zip(accumulators, present)]
            reduced = state.allreducer(summed, variables)
            if state.average_aggregated:
                reduced = [None if r is None else r / state.passes for r in reduced]
            super(_DistributedOptimizer, self).apply(reduced, trainable_variables)
            for acc in accumulators:
                acc.assign(tf.zeros_like(acc))
            state.counter.assign(0)

        def only_count():
            self._iterations.assign_add(1)

        tf.cond(state.counter >= state.passes, communicate_and_apply, only_count)


_classes = {}


def _distributed_class(base):
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizer, base),
                   {"__module__": base.__module__, "__doc__": base.__doc__})
        _classes[base] = cls
    return cls


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='',
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Makes a Keras 3 optimizer average gradients across ranks before applying them.

    Args:
        optimizer: any ``keras.optimizers.Optimizer`` (built-in or custom); wrapped in place
            and returned.
        name: accepted for Horovod compatibility (the optimizer keeps its name, so its
            variables keep their checkpoint paths).
        compression: ``Compression.none`` or ``Compression.fp16`` (gradients sent as fp16).
        sparse_as_dense: densify ``tf.IndexedSlices`` gradients (embeddings) before reducing
            (TensorFlow backend; the torch and JAX backends give dense gradients).
        gradient_predivide_factor: with op=Average, divide by this factor before the sum and
            by ``size / factor`` after.
        op: ``Average`` (default), ``Sum`` or ``Adasum`` (gradients combined with Adasum; a
            power-of-two number of ranks).
        backward_passes_per_step: accumulate gradients locally over this many ``apply`` calls
            and communicate once (on torch and JAX through Keras' ``gradient_accumulation_steps``,
            which must then be unset or equal).
        average_aggregated_gradients: divide the accumulated gradients by
            ``backward_passes_per_step``.
        num_groups, groups: split the gradients into that many grouped allreduces, or lists
            of variables reduced together.
        process_set: the ranks that average their gradients.
        scale_local_gradients: divide the gradients of variables registered with
            ``register_local_var`` by the set size, as in Horovod.

    ``device_dense`` and ``device_sparse`` are accepted for Horovod compatibility. With one
    rank the gradients are applied unchanged.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got "
                         f"{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already a DistributedOptimizer")
    backend = _backend.name()
    groups = check_optimizer_args(op, gradient_predivide_factor, num_groups, groups,
                                  is_tensor=lambda v: hasattr(v, "assign") or hasattr(v, "shape"))
    check_adasum_size(op, _backend.set_size(process_set))
    passes = int(backward_passes_per_step)
    if passes < 1:
        raise ValueError("backward_passes_per_step must be > 0")
    keras_steps = getattr(optimizer, "gradient_accumulation_steps", None)
    # On TensorFlow the two accumulations would stack (N x M batches per update); elsewhere
    # they are one and the same.
    if passes > 1 and keras_steps and (keras_steps != passes or backend == "tensorflow"):
        raise ValueError(
            f"DistributedOptimizer(backward_passes_per_step={passes}) wraps an optimizer made "
            f"with gradient_accumulation_steps={keras_steps}: give only one of them"
            + ("." if backend == "tensorflow" else ", or the same number to both."))
    allreducer = _backend.current().gradient_allreducer(
        compression=compression, sparse_as_dense=sparse_as_dense, op=op,
        gradient_predivide_factor=gradient_predivide_factor, groups=groups,
        process_set=process_set, name=None, scale_local_gradients=scale_local_gradients)
    if backend != "tensorflow" and (passes > 1 or keras_steps):
        # Keras' accumulation: Keras averages over the steps, as the user who asked Keras for
        # it expects; backward_passes_per_step keeps Horovod's sum unless asked to average.
        average_aggregated_gradients = average_aggregated_gradients or passes == 1
        passes = int(keras_steps or passes)
        _use_keras_accumulation(optimizer, passes)
    state = _State(allreducer, passes, average_aggregated_gradients, sparse_as_dense)
    state.keras_accumulation = backend != "tensorflow" and passes > 1
    optimizer.__class__ = _distributed_class(type(optimizer))
    optimizer._hvd = state
    if passes > 1 and optimizer.built and not state.keras_accumulation:
        state.build_accumulators(optimizer._trainable_variables)
    return optimizer


def _use_keras_accumulation(optimizer, steps):
    """Sets Keras' ``gradient_accumulation_steps`` on ``optimizer``; one already built gets
    the accumulators Keras' ``build`` would have made."""
    optimizer.gradient_accumulation_steps = steps
    if optimizer.built and not getattr(optimizer, "_accumulated_gradients", None):
        optimizer._accumulated_gradients = [
            optimizer.add_variable_from_reference(v, name="gradient_accumulator")
            for v in optimizer._trainable_variables]


def PartialDistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='',
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """``DistributedOptimizer`` that leaves the gradients of ``local_layers`` on each rank
    (model parallelism: layers whose weights differ between ranks on purpose).

    Args:
        local_layers: a Keras layer or a collection of them; their trainable variables (also
            those created when the first step builds the layers) are local. None: the same
            as ``DistributedOptimizer``.
        scale_local_gradients: divide the local gradients by the set size (Horovod's default).

    The other arguments are ``DistributedOptimizer``'s. Pair it with
    ``callbacks.BroadcastGlobalVariablesCallback(0, local_variables=...)`` so the local
    weights are not overwritten by the root's.
    """
    layers = checked_local_layers(local_layers)
    optimizer = DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    optimizer._hvd.allreducer.register_local_layers(layers)
    return optimizer
