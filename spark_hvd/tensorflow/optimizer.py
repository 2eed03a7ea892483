"""``DistributedOptimizer`` for TensorFlow, and the ``tf.compat.v1`` session helpers.

- A Keras 3 optimizer (``tf.keras.optimizers.*``, ``keras.optimizers.*``) is wrapped by
  ``spark_hvd.keras.DistributedOptimizer`` (averages the gradients in ``apply``), so
  ``model.fit`` and custom loops with ``optimizer.apply_gradients`` both work.
- A ``tf.compat.v1.train.Optimizer`` is wrapped the TF1 way: ``compute_gradients`` (and so
  ``minimize``) returns averaged gradients. With ``BroadcastGlobalVariablesHook`` this keeps the
  classic recipe working in a ``tf.compat.v1`` graph::

      tf.compat.v1.disable_eager_execution()
      opt = hvd.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer(0.001 * hvd.size()))
      train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
      hooks = [hvd.BroadcastGlobalVariablesHook(0), tf.compat.v1.train.StopAtStepHook(100)]
      with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
          while not sess.should_stop():
              sess.run(train_op)

  TF 2.21 still ships ``tf.compat.v1.train`` optimizers, sessions and hooks; only Keras 3
  layers cannot be used in such graphs (build the model with ``tf.compat.v1`` ops).
"""

import tensorflow as tf

from ..common.process_sets import global_process_set
from .collectives import Adasum, Average, member_count
from .compression import Compression
from .functions import broadcast_variables
from .gradient_tape import GradientAllreducer, check_args, dense_for_accumulation

_LegacyOptimizer = tf.compat.v1.train.Optimizer


class _PassAccumulator:
    """``backward_passes_per_step`` for a ``tf.compat.v1`` optimizer, in graph ops (so it
    works in sessions and eagerly): every pass adds its gradients into local variables; the
    N-th pass allreduces the sums (divided by N with ``average_aggregated_gradients``) and the
    wrapped optimizer applies them; on the other passes nothing is applied and only the global
    step advances, as in Horovod (it counts backward passes)."""

    def __init__(self, passes, average, sparse_as_dense, allreducer):
        self.passes = passes
        self.average = average
        self.sparse_as_dense = sparse_as_dense
        self.allreducer = allreducer
        self.sums = None
        self.counter = None

    def _local_variable(self, initial, name):
        # Per-rank state: a local variable, which MonitoredTrainingSession initializes and
        # BroadcastGlobalVariablesHook (global variables only) leaves alone.
        return tf.compat.v1.Variable(initial, trainable=False, name=name,
                                     collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])

    def gradients(self, grads, variables):
        """The allreduced sums on every N-th pass, this pass's local gradients otherwise."""
        present = [i for i, g in enumerate(grads) if g is not None]
        dense = [dense_for_accumulation(grads[i], self.sparse_as_dense) for i in present]
        if self.sums is None:
            self.counter = self._local_variable(tf.constant(0, tf.int32), "passes_counter")
            self.sums = [self._local_variable(tf.zeros_like(g), f"gradient_sum_{i}")
                         for i, g in zip(present, dense)]
        if len(self.sums) != len(dense):
            raise ValueError("backward_passes_per_step > 1: the set of variables with a "
                             "gradient changed between passes")
        cleared = tf.cond(tf.equal(self.counter.read_value(), 0),
                          lambda: tf.group([s.assign(tf.zeros_like(s)) for s in self.sums]),
                          tf.no_op)
        with tf.control_dependencies([cleared]):
            added = [s.assign_add(g) for s, g in zip(self.sums, dense)]
        with tf.control_dependencies(added):
            count = self.counter.assign_add(1)

        def reduce_sums():
            reduced = self.allreducer([s.read_value() for s in self.sums],
                                      [variables[i] for i in present])
            if self.average:
                reduced = [g / self.passes for g in reduced]
            with tf.control_dependencies(reduced):
                reset = self.counter.assign(0)
            with tf.control_dependencies([reset]):
                return [tf.identity(g) for g in reduced]

        with tf.control_dependencies([count]):
            out = tf.cond(tf.equal(count, self.passes), reduce_sums,
                          lambda: [tf.identity(g) for g in dense])
        out = out if isinstance(out, (list, tuple)) else [out]
        result = list(grads)
        for i, g in zip(present, out):
            result[i] = g
        return result

    def apply(self, apply_fn, grads_and_vars, global_step):
        """Runs ``apply_fn`` on the passes that reduced; advances ``global_step`` on the
        others."""
        def skip():
            if global_step is None:
                return tf.no_op()
            return tf.group(global_step.assign_add(tf.constant(1, global_step.dtype.base_dtype)))

        with tf.control_dependencies([g for g, _ in grads_and_vars if g is not None]):
            applying = tf.equal(self.counter.read_value(), 0)
        return tf.cond(applying, lambda: tf.group(apply_fn()), skip)


class _LegacyDistributedOptimizer(_LegacyOptimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer``: gradients are averaged in
    ``compute_gradients``; everything else is the wrapped optimizer's."""

    def __init__(self, optimizer, name, use_locking, allreducer, accumulator=None):
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._allreducer = allreducer
        self._accumulator = accumulator

    def register_local_var(self, var):
        """Keeps ``var``'s gradient on this rank (model parallelism): it is not averaged, only
        divided by the set size when ``scale_local_gradients`` (the default). Register before
        building the training op."""
        self._allreducer.register_local(var)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``(gradient, variable)`` pairs with the gradients averaged
        across ranks (one grouped allreduce; every N-th pass with backward_passes_per_step)."""
        gradients = self._optimizer.compute_gradients(*args, **kwargs)
        if not gradients:
            return gradients
        grads, variables = zip(*gradients)
        if self._accumulator is not None:
            return list(zip(self._accumulator.gradients(list(grads), variables), variables))
        return list(zip(self._allreducer(grads, variables), variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Calls the wrapped optimizer's ``apply_gradients`` (with backward_passes_per_step,
        only on the passes whose gradients were reduced)."""
        if self._accumulator is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                   name=name)
        grads_and_vars = list(grads_and_vars)
        return self._accumulator.apply(
            lambda: self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                    name=name),
            grads_and_vars, global_step)

    def get_slot(self, *args, **kwargs):
        """Calls the wrapped optimizer's ``get_slot``."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        """Calls the wrapped optimizer's ``get_slot_names``."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        """Calls the wrapped optimizer's ``variables``."""
        return self._optimizer.variables(*args, **kwargs)


class _LegacyAdasumOptimizer(_LegacyDistributedOptimizer):
    """op=Adasum for a ``tf.compat.v1`` optimizer (Horovod's TF1 Adasum optimizer): every
    rank applies its own gradients with the wrapped optimizer, the ranks combine the changes
    this made to the variables with Adasum, and each variable becomes its value before the
    step plus the combined change."""

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's own gradients (this rank's)."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Applies this rank's gradients, then sets the variables to their starting values
        plus the Adasum of every rank's change."""
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        variables = [v for _, v in grads_and_vars]
        starts = [tf.compat.v1.Variable(
            tf.zeros(v.shape, v.dtype.base_dtype), trainable=False,
            collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
            name=v.op.name.replace("/", "_") + "_adasum_start") for v in variables]
        with tf.control_dependencies([s.assign(v) for s, v in zip(starts, variables)]):
            applied = self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                      name=name)
        # Every read is ordered after the update (and so after the starts were saved): a read
        # outside these dependencies may run first and see the previous step's start.
        with tf.control_dependencies([applied]):
            saved = [tf.identity(s) for s in starts]
            deltas = [tf.identity(v) - s for v, s in zip(variables, saved)]
        # A local variable keeps its own change, unscaled (it is a change, not a gradient).
        combined = self._allreducer(deltas, variables, scale_local=False)
        return tf.group(*[v.assign(s + c) for v, s, c in zip(variables, saved, combined)])


def _is_keras_optimizer(optimizer):
    try:
        import keras
    except ImportError:  # pragma: no cover - TF 2.16+ depends on Keras
        return False
    return isinstance(optimizer, keras.optimizers.Optimizer)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense='',
                         device_sparse='', compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wraps an optimizer so that gradients are averaged across ranks before they are applied.

    Args:
        optimizer: a Keras 3 optimizer (handed to ``spark_hvd.keras.DistributedOptimizer``)
            or a ``tf.compat.v1.train.Optimizer``.
        name: name of the wrapper (TF1) / prefix of the allreduces.
        compression: ``Compression.none`` or ``Compression.fp16``.
        sparse_as_dense: densify ``tf.IndexedSlices`` gradients before reducing them.
        backward_passes_per_step: accumulate gradients locally over this many passes, then
            allreduce and apply once (a TF1 optimizer's global step still counts every pass).
        op: ``Average`` (default), ``Sum`` or ``Adasum`` (a power-of-two number of ranks:
            Keras optimizers combine the gradients with Adasum; a TF1 optimizer applies each
            rank's gradients and combines the resulting changes, as in Horovod).
        gradient_predivide_factor: with op=Average, divide by this factor before the sum and
            by ``size / factor`` after.
        average_aggregated_gradients: divide the accumulated gradients by
            ``backward_passes_per_step``.
        num_groups, groups: split the gradients into grouped allreduces (see
            ``DistributedGradientTape``).
        process_set: the ranks that average their gradients.
        scale_local_gradients: divide the gradients of variables registered with the
            result's ``register_local_var`` by the set size, as in Horovod.

    ``use_locking`` is passed to the TF1 wrapper; ``device_dense`` and ``device_sparse`` are
    accepted for Horovod compatibility.
    """
    if _is_keras_optimizer(optimizer):
        from ..keras.optimizer import DistributedOptimizer as KerasDistributedOptimizer
        return KerasDistributedOptimizer(
            optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
            groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)
    if not isinstance(optimizer, _LegacyOptimizer):
        raise ValueError(f"DistributedOptimizer wraps a Keras optimizer or a "
                         f"tf.compat.v1.train.Optimizer, got {type(optimizer).__name__}")
    groups = check_args(op, gradient_predivide_factor, num_groups, groups, process_set)
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    allreducer = GradientAllreducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                                    groups, process_set, name=None,
                                    scale_local_gradients=scale_local_gradients)
    if op == Adasum and member_count(process_set) > 1:
        if int(backward_passes_per_step) > 1:
            raise ValueError("op=Adasum with a tf.compat.v1 optimizer supports "
                             "backward_passes_per_step=1 only")
        return _LegacyAdasumOptimizer(optimizer, name, use_locking, allreducer)
    accumulator = None
    if backward_passes_per_step > 1:
        accumulator = _PassAccumulator(int(backward_passes_per_step),
                                       average_aggregated_gradients, sparse_as_dense, allreducer)
    return _LegacyDistributedOptimizer(optimizer, name, use_locking, allreducer, accumulator)


def broadcast_global_variables(root_rank):
    """Returns an op that assigns ``root_rank``'s values to every global variable of the
    default ``tf.compat.v1`` graph (run it once after initialization).

    TF2 code runs eagerly and has no global variables: use
    ``hvd.broadcast_variables(model.variables, root_rank)`` (or the Keras
    ``BroadcastGlobalVariablesCallback``) instead.
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. Please use "
            "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """``SessionRunHook`` that broadcasts every global variable from ``root_rank`` when the
    session is created (after initialization or restore from a checkpoint), so every rank
    starts from the same state. For ``tf.compat.v1.train.MonitoredTrainingSession``."""

    def __init__(self, root_rank, device=''):
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None
        self.device = device

    def begin(self):
        """Builds the broadcast op in the session's graph."""
        if not self.bcast_op or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        """Runs the broadcast."""
        session.run(self.bcast_op)
