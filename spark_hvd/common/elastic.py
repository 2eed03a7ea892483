"""Horovod's ``hvd.elastic`` API, the framework-independent half.

``hvd.elastic.run(func)`` (:func:`run_fn`) runs ``func(state)`` and keeps it running while the
job's ranks change: in a worker of an elastic job (``spark-hvd-run --min-np ...``,
``--host-discovery-script ...``, or ``spark_hvd.run(..., min_num_proc=...)``) a lost peer
(``HorovodInternalError``) makes every survivor restore its last commit, and a change of hosts
(``HostsUpdatedInterrupt``, raised by :meth:`State.commit` on every rank at the same commit)
makes every rank keep its state; both then join the driver's next round (``shutdown()`` then
``init()``), run the reset callbacks, sync from the new rank 0 when the driver says so (one flag
for every member of the round), and call ``func`` again. Outside an elastic job ``run`` syncs
the state once and calls ``func`` (a lost peer ends the job as usual).

:meth:`State.check_host_updates` costs one native call when nothing changed: the driver's
"hosts updated" notice reaches rank 0's core, which carries it to every rank with the next
response batch, so every rank sees it after the same collective, without a broadcast.

The framework modules (``spark_hvd.torch.elastic``, ``spark_hvd.tensorflow.elastic``,
``spark_hvd.keras.elastic``) add their model/optimizer states on top of :class:`ObjectState`.
"""

import functools
import queue

from . import _elastic_agent
from . import _elastic_protocol as _proto
from ._native import lib as _lib
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt

HostUpdateResult = _proto.HostUpdateResult

ALTERNATIVES = (
    "Run the job elastic (spark-hvd-run --min-np N ... or spark_hvd.run(fn, min_num_proc=N, "
    "...)), or run a fixed-size job and restart it from your last checkpoint when a rank fails.")


class ElasticNotSupportedError(NotImplementedError):
    """Raised by the parts of Horovod's elastic API that spark_hvd does not support."""


def refuse(what):
    """Raises :class:`ElasticNotSupportedError` for ``what``."""
    raise ElasticNotSupportedError(f"{what} is not supported by spark_hvd. {ALTERNATIVES}")


def _default_reset():
    from . import basics
    basics._elastic_reset()


def run_fn(func, reset=None):
    """Horovod's ``run_fn(func, reset)`` behind every ``hvd.elastic.run``: returns a wrapper
    ``wrapper(state, *args, **kwargs)`` that runs ``func`` until it returns, across resets.

    ``reset`` stops the core and joins the next round (default: ``shutdown()`` then
    ``init()``). Exceptions other than ``HorovodInternalError`` and ``HostsUpdatedInterrupt``
    propagate: in an elastic job they end the job with their traceback, and the host of the
    rank that raised is not blamed.
    """
    reset = reset or _default_reset

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        agent = None
        if _elastic_agent.active():
            from . import basics
            basics.init()  # joins round 1 if the script did not call init() first
            agent = _elastic_agent.get()
            agent.register_listener(state)
            agent.in_run = True
        # The first entry syncs, as in Horovod, except in a round whose members the driver
        # told not to (survivors of an interrupt, all at the same commit): one flag for all.
        sync = True
        if agent is not None and agent.round is not None and agent.entries_in_round == 0:
            sync = agent.round.sync
        try:
            while True:
                try:
                    if sync:
                        state.sync()
                        if agent is not None:
                            agent.note_sync()
                    if agent is not None:
                        agent.entries_in_round += 1
                    return func(state, *args, **kwargs)
                except HorovodInternalError as e:
                    if agent is None:
                        raise
                    state.restore()
                    agent.rejoin_because(_proto.REASON_FAILURE, e)
                except HostsUpdatedInterrupt:
                    if agent is None:
                        raise
                    agent.rejoin_because(_proto.REASON_INTERRUPT)
                reset()
                state.on_reset()
                sync = agent.round.sync
        finally:
            if agent is not None:
                agent.remove_listener(state)
                agent.in_run = False

    return wrapper


class State:
    """State kept in host memory and synchronized across the ranks (Horovod's ``State``).

    Subclasses define :meth:`save`, :meth:`restore`, :meth:`sync` and optionally
    :meth:`reset`; :meth:`commit` and :meth:`check_host_updates` are the same for all.

    Args:
        bcast_object: broadcasts a picklable object from rank 0 to every rank.
        get_rank: returns this process's rank.
    """

    def __init__(self, bcast_object, get_rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks = []
        # (timestamp, HostUpdateResult) of every "hosts updated" notice heard (Horovod's
        # attributes; scripts watch them).
        self._host_messages = queue.Queue()
        self._last_updated_timestamp = 0

    def register_reset_callbacks(self, callbacks):
        """Registers functions to call after each reset (the ranks changed), in order."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        """Runs :meth:`reset` and the registered reset callbacks (after every reset)."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res):
        """The driver says hosts were added or removed (called by the worker's listener)."""
        self._host_messages.put((timestamp, update_res))

    def commit(self):
        """Saves the state to host memory (:meth:`save`), then raises
        ``HostsUpdatedInterrupt`` if hosts were added or removed (on every rank at the same
        commit)."""
        self.save()
        agent = _elastic_agent._agent
        if agent is not None:
            agent.commits += 1
        self.check_host_updates()

    def check_host_updates(self):
        """Raises ``HostsUpdatedInterrupt`` when the driver announced a change of hosts that
        this rank has not acted on. Every rank raises after the same collective (the notice
        travels with the core's responses), so they all leave at the same commit, or none
        does. One native call when nothing changed; never raises outside elastic jobs."""
        agent = _elastic_agent._agent
        if agent is None:
            return
        notice = _lib.shvd_released_notice()
        if notice <= agent.acted_notice:
            return
        agent.acted_notice = notice
        update = HostUpdateResult.no_update
        while True:
            try:
                timestamp, result = self._host_messages.get_nowait()
            except queue.Empty:
                break
            update |= result
            self._last_updated_timestamp = max(self._last_updated_timestamp, timestamp)
        raise HostsUpdatedInterrupt(update == HostUpdateResult.removed)

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
        """Resets objects and variables after the ranks changed (e.g. a sampler's shards)."""


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
