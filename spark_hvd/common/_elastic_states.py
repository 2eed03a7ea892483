"""What the framework states (``TorchState``, ``TensorFlowKerasState``, ``TensorFlowState``)
add to :class:`~spark_hvd.common.elastic.HandledState`, once for every framework:

- ``sync()`` first lets each handler prepare (a newcomer builds its optimizer's slots), then
  compares what every rank is about to broadcast (each handler's *spec*: shapes and dtypes,
  sampler progress) with rank 0's in one ``allgather_object``. A mismatch raises ``ValueError``
  on every rank, naming the ranks and what differs, before any tensor moves: Horovod's state
  broadcast hung instead when a new worker's optimizer had no slots yet (#2652, #2285).
- ``reset()``, called after every reset whether or not a sync follows, lets each handler redo
  what depends on the ranks (the sampler's shards: Horovod #3399 skipped it without a sync).
- Plain attributes are deep-copied at commit, so ``restore()`` also undoes changes made in
  place (a list appended to); objects that cannot be copied are kept by reference, as in
  Horovod.

Every collective here has a fixed name: a newcomer's unnamed-op counters start at 0 while a
survivor's do not.
"""

import copy

import numpy as np

from .elastic import HandledState, StateHandler
from .objects import allgather_object, broadcast_object


class Handler(StateHandler):
    """A :class:`StateHandler` with the hooks :class:`SyncedState` calls (each optional)."""

    def prepare(self):
        """Called on every rank before the specs are compared."""

    def spec(self):
        """A picklable description every rank's must match rank 0's (None: nothing to
        check)."""
        return None

    def check(self, specs):
        """Problems (strings) in every rank's :meth:`spec`, rank 0's first. By default the
        ranks whose spec differs from rank 0's."""
        return [f"rank {r} has {describe(spec)}, rank 0 {describe(specs[0])}"
                for r, spec in enumerate(specs) if spec != specs[0]]

    def reset(self):
        """Called after every reset (new ranks), before any sync."""


def describe(spec):
    """A spec, short enough for an error message."""
    text = repr(spec)
    return text if len(text) <= 300 else text[:297] + "..."


def variables_spec(named):
    """The spec of ``[(name, shape, dtype)]``: shapes and dtypes by position (auto-generated
    names may differ between processes)."""
    return [(tuple(shape), str(dtype)) for _, shape, dtype in named]


def check_variables(what, named_by_rank):
    """Problems of :func:`variables_spec`-style lists: the first differing position, by name."""
    root = named_by_rank[0]
    problems = []
    for r, named in enumerate(named_by_rank[1:], start=1):
        if variables_spec(named) == variables_spec(root):
            continue
        if len(named) != len(root):
            problems.append(f"rank {r}'s {what} has {len(named)} tensors, rank 0's {len(root)}")
            continue
        i = next(i for i, (a, b) in enumerate(zip(named, root))
                 if variables_spec([a]) != variables_spec([b]))
        problems.append(f"rank {r}'s {what} tensor {i} ({named[i][0]}) is {named[i][2]} of shape "
                        f"{tuple(named[i][1])}, rank 0's ({root[i][0]}) {root[i][2]} of shape "
                        f"{tuple(root[i][1])}")
    return problems


def _detached(value):
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - not copyable: kept by reference, as Horovod did
        return value


class SyncedState(HandledState):
    """A :class:`HandledState` whose ``sync()`` checks first (see the module docstring).

    Args:
        handlers: ``{attribute: Handler}`` (plain :class:`StateHandler` objects work too: they
            are neither checked nor reset).
        kwargs: plain picklable Python objects, exposed as attributes.
    """

    def __init__(self, handlers, get_rank, **kwargs):
        super().__init__(handlers, bcast_object=self._broadcast_objects, get_rank=get_rank,
                         **kwargs)
        self._saved_state = _detached(self._saved_state)

    @staticmethod
    def _broadcast_objects(obj):
        return broadcast_object(obj, 0, name="elastic.state.objects")

    def save(self):
        super().save()
        self._saved_state = _detached(self._saved_state)

    def restore(self):
        super().restore()
        for attr, value in self._saved_state.items():
            setattr(self, attr, _detached(value))

    def sync(self):
        handlers = self._handlers
        for handler in handlers.values():
            _call(handler, "prepare")
        every = allgather_object({name: _call(handler, "spec") for name, handler in
                                  handlers.items()}, name="elastic.state.specs")
        problems = [f"rank {r} tracks {sorted(specs)}, rank 0 {sorted(every[0])}"
                    for r, specs in enumerate(every) if specs.keys() != every[0].keys()]
        if not problems:
            for name, handler in handlers.items():
                if hasattr(handler, "check"):
                    problems += [f"{name}: {p}"
                                 for p in handler.check([specs[name] for specs in every])]
        if problems:
            raise ValueError("elastic state sync: the ranks' states do not match, so rank 0's "
                             "cannot be broadcast (nothing was changed): " + "; ".join(problems))
        super().sync()
        self._saved_state = _detached(self._saved_state)

    def reset(self):
        for handler in self._handlers.values():
            _call(handler, "reset")
        super().reset()


def _call(handler, hook):
    """``handler.hook()``, or None for a handler without it (one written for Horovod)."""
    method = getattr(handler, hook, None)
    return method() if method is not None else None


# -- models, optimizers and lists of variables (TensorFlow and Keras of every backend) --------

def variables_of(obj):
    """The variables of a Keras model or optimizer (Keras 3: a property; Keras 2 optimizers:
    a method), or of a list of variables."""
    if isinstance(obj, (list, tuple)):
        return list(obj)
    variables = obj.variables
    return list(variables() if callable(variables) else variables)


class VariablesHandler(Handler):
    """A model, an optimizer or a list of variables: saved as NumPy copies of the values.

    Args:
        value: the model, optimizer or list.
        what: its name in errors and in the broadcast's op names.
        broadcast: ``broadcast(variables, name)`` assigns rank 0's values to ``variables``.
        dtype_name: ``dtype_name(variable)``, the dtype's name in the spec.
        before_save: called before values are read (Keras on JAX keeps ``fit``'s state
            outside the variables until it is synced).
    """

    def __init__(self, value, what, broadcast, dtype_name, before_save=None):
        self._what = what
        self._broadcast = broadcast
        self._dtype_name = dtype_name
        self._before_save = before_save or (lambda: None)
        super().__init__(value)

    def save(self):
        self._before_save()
        self._saved = [np.array(v, copy=True) for v in variables_of(self.value)]

    def restore(self):
        # An optimizer builds its slots lazily: variables created after the last save keep
        # their values, as in Horovod.
        for var, saved in zip(variables_of(self.value), self._saved):
            var.assign(saved)

    def spec(self):
        return [(getattr(v, "path", None) or v.name, tuple(v.shape), self._dtype_name(v))
                for v in variables_of(self.value)]

    def check(self, specs):
        return check_variables(self._what, specs)

    def sync(self):
        self._before_save()
        variables = variables_of(self.value)
        if variables:
            self._broadcast(variables, f"elastic.{self._what}")


class OptimizerHandler(VariablesHandler):
    """A Keras optimizer, built for the model's trainable variables before a sync if it is
    not yet (a new worker's optimizer has no slots until its first step)."""

    def __init__(self, optimizer, model, broadcast, dtype_name, before_save=None):
        self._model = model
        super().__init__(optimizer, "optimizer", broadcast, dtype_name, before_save)

    def prepare(self):
        if getattr(self.value, "built", True) is False:
            self.value.build(self._model.trainable_variables)


def model_handlers(model, optimizer, broadcast, dtype_name, before_save=None):
    """The handlers of a Keras model and its optimizer (``model.optimizer`` when None; none
    for a model without one)."""
    if not getattr(model, "built", True):
        raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
    optimizer = optimizer or getattr(model, "optimizer", None)
    handlers = {"model": VariablesHandler(model, "model", broadcast, dtype_name, before_save)}
    if optimizer is not None:
        handlers["optimizer"] = OptimizerHandler(optimizer, model, broadcast, dtype_name,
                                                 before_save)
    return handlers
