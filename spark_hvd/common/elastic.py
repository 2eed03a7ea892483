"""Horovod's ``hvd.elastic`` API, the framework-independent half.

Elastic training (``hvd.elastic.run``: a job that survives failed ranks and grows or shrinks as
hosts come and go) is not implemented in spark_hvd yet, so :func:`run_fn` and the names that
only make sense with it refuse with :class:`ElasticNotSupportedError`, which says what to do
instead. The state objects work: in a fixed-size job ``sync()`` makes every rank's state rank
0's, ``commit()`` keeps a copy in host memory and ``restore()`` returns to it, exactly as in
Horovod (``commit()`` never raises ``HostsUpdatedInterrupt``: the hosts never change).

The framework modules (``spark_hvd.torch.elastic``, ``spark_hvd.tensorflow.elastic``,
``spark_hvd.keras.elastic``) add their model/optimizer states on top of :class:`ObjectState`.
"""

ALTERNATIVES = (
    "Run a fixed-size job instead (spark-hvd-run -np N, spark_hvd.run(fn, np=N) or "
    "spark_hvd.spark.run(fn, num_proc=N)) and restart it from your last checkpoint when a rank "
    "fails; the elastic state objects (hvd.elastic.ObjectState, TorchState, KerasState, ...) "
    "work in a fixed-size job: sync(), commit() and restore() behave as in Horovod.")


class ElasticNotSupportedError(NotImplementedError):
    """Raised by the parts of Horovod's elastic API that need elastic training."""


def refuse(what):
    """Raises :class:`ElasticNotSupportedError` for ``what`` (e.g. ``"hvd.elastic.run"``)."""
    raise ElasticNotSupportedError(
        f"{what}: elastic training (recovering from failed ranks, adding or removing hosts "
        f"while training) is not implemented in spark_hvd yet. {ALTERNATIVES}")


def run_fn(func, reset):
    """Horovod's ``run_fn(func, reset)`` behind every ``hvd.elastic.run``: refused."""
    del func, reset
    refuse("hvd.elastic.run")


class State:
    """State kept in host memory and synchronized across the ranks (Horovod's ``State``).

    Args:
        bcast_object: broadcasts a picklable object from rank 0 to every rank.
        get_rank: returns this process's rank.
    """

    def __init__(self, bcast_object, get_rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Registers functions to call after a reset event. A fixed-size job has none, so they
        are kept and never called."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        """Runs :meth:`reset` and the registered reset callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Saves the state to host memory (:meth:`save`). Horovod also checks here whether hosts
        were added or removed; in a fixed-size job they never are."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Nothing to check: the hosts of a fixed-size job never change."""

    def save(self):
        """Saves the state to host memory."""
        raise NotImplementedError()

    def restore(self):
        """Restores the last committed state, undoing any uncommitted modifications."""
        raise NotImplementedError()

    def sync(self):
        """Makes every rank's state rank 0's."""
        raise NotImplementedError()

    def reset(self):
        """Resets objects and variables after a reset event (none in a fixed-size job)."""


class ObjectState(State):
    """State of plain Python objects, each given as a keyword argument and exposed as an
    attribute (``state.epoch``). Horovod's ``ObjectState``."""

    def __init__(self, bcast_object, get_rank, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


class StateHandler:
    """Saves, restores and synchronizes one framework object (a model, an optimizer, a list of
    variables) of a :class:`HandledState`. Each framework module subclasses it and defines
    ``save()`` (copy the object's state to host memory), ``restore()`` (load that copy back)
    and ``sync()`` (make the object's state rank 0's on every rank)."""

    def __init__(self, value):
        self.value = value
        self.save()

    def set_value(self, value):
        """The state's attribute was given a new object: track that one from now on."""
        self.value = value
        self.save()


class HandledState(ObjectState):
    """An :class:`ObjectState` whose framework objects are tracked by handlers.

    Args:
        handlers: ``{attribute name: StateHandler}``; each handler's object becomes the
            attribute, and assigning a new object to the attribute tracks that one.
        bcast_object, get_rank: as for :class:`State`.
        kwargs: plain Python objects, as for :class:`ObjectState`.
    """

    def __init__(self, handlers, bcast_object, get_rank, **kwargs):
        self._handlers = dict(handlers)
        for name, handler in self._handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank, **kwargs)

    def save(self):
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self):
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        # The synced state is also the committed one, so a restore() before the next commit()
        # returns to rank 0's state, not to this rank's state from before the sync.
        for handler in self._handlers.values():
            handler.sync()
            handler.save()
        super().sync()

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)
