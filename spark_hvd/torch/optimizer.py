"""DistributedOptimizer: data-parallel training by averaging gradients across ranks.

    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

Every parameter gets a post-accumulate-grad hook. As soon as backward has finished a
parameter's gradient the hook starts its in-place allreduce, so communication overlaps the
rest of backward (the core fuses gradients that become ready together). Small gradients are
submitted in buckets of 256 KiB (``SPARK_HVD_GRADIENT_BUCKET_BYTES``; 0 = each alone) to save
engine wake-ups; CUDA gradients in buckets of 25 MiB, torch DDP's default, since every NCCL
collective costs a launch and a network round trip. ``step()`` first waits for all of them (``synchronize()``), then runs the
wrapped optimizer's own step.

The returned object is an instance of a subclass of the wrapped optimizer's class
(``isinstance(opt, torch.optim.SGD)`` holds) that shares its parameter groups, state,
defaults and hooks: state loaded into the optimizer before wrapping is kept, and learning-rate
schedulers work on either object.
"""

import warnings
import weakref
from contextlib import contextmanager

import torch

from ..common import _config, basics
from ..common.gradients import (check_adasum_size, check_optimizer_args, form_groups,
                                named_parameters_of, scale_factors)
from ..common.process_sets import global_process_set
from .collectives import (Adasum, Average, _allreduce_batch_async_, allreduce_async_,
                          grouped_allreduce_async_, sparse_allreduce_async, synchronize)
from .compression import Compression
from .functions import broadcast_object
from . import shared_gradients

_STEP_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                 "optimizer.synchronize(). This can cause training slowdown. You may want to "
                 "consider using optimizer.skip_synchronize() context if you use "
                 "optimizer.synchronize() in your code.")
_ZERO_GRAD_ERROR = ("optimizer.zero_grad() was called after loss.backward() but before "
                    "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                    "cause a race condition.")
_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally.")
_ADASUM_SKIP = "Skipping synchronization is not supported when using Adasum optimizer."

# Names of the gradient allreduces must be unique among concurrently running ops: the n-th
# DistributedOptimizer a process creates prefixes them with its number (ranks create their
# optimizers in the same order, as they build the same model).
_instances = [0]

# Finished gradients are submitted together once this many bytes are ready (a gradient at
# least this large goes at once): each submission wakes the engine thread, and on a busy CPU a
# bucket of small gradients costs one wake-up instead of one per tensor (measured: the engine's
# CPU time per step of a 0.13 M-parameter CNN drops from 2-8 ms to under 2 ms at 2 ranks).
# SPARK_HVD_GRADIENT_BUCKET_BYTES=0 submits every gradient alone, the moment it is ready.
DEFAULT_BUCKET_BYTES = 256 << 10
# CUDA gradients: each NCCL collective costs a kernel launch and a network round trip (tens of
# microseconds on NVLink, milliseconds over sockets), so they go in buckets of torch DDP's
# default size: few collectives per step, and on large models still overlapped with backward.
DEFAULT_CUDA_BUCKET_BYTES = 25 << 20


class _DistributedOptimizer:
    """Methods mixed into the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense, process_set):
        all_params = [p for group in self.param_groups for p in group["params"]]
        names = named_parameters_of(named_parameters, all_params)
        k = _instances[0]
        _instances[0] += 1
        set_id = process_set.process_set_id or 0
        prefix = ("grad" if k == 0 else f"grad{k}") + (f".set{set_id}." if set_id else ".")
        self._name_prefix = prefix
        self._parameter_names = {p: prefix + names[id(p)] for p in all_params}
        self._compression = compression
        self.backward_passes_per_step = int(backward_passes_per_step)
        if self.backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self._scales = scale_factors(op, gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._groups = groups
        self._handles = {}           # param or group tuple -> (handle, compression ctx)
        self._allreduce_delay = {}   # param -> backward passes left before its allreduce
        self._requires_update = []   # params whose gradients are averaged
        self._p_to_group = {}
        self._group_counts = {}
        self._sparse_layout = {}     # param -> (sparse_dim) of the sparse grads it produced
        self._hook_handles = []
        self._pending = 0            # hook calls since the last synchronize
        self._generation = basics.generation()  # the init() whose core this step runs on
        self._ready = []             # finished gradients not yet submitted (the open bucket)
        self._ready_bytes = 0
        on_gpu = any(p.is_cuda for group in self.param_groups for p in group["params"])
        self._bucket_bytes = _config.env_int(
            "GRADIENT_BUCKET_BYTES", DEFAULT_CUDA_BUCKET_BYTES if on_gpu else DEFAULT_BUCKET_BYTES)
        self._synchronized = False
        self._should_synchronize = True
        self._included = process_set.included()
        active = self._included and (process_set.size() > 1 or _config.env_flag("ELASTIC"))
        # op=Adasum combines each rank's optimizer step, not its gradient (Horovod's delta
        # optimizer) wherever hooks run: param -> its value before this step's local update.
        self._adasum = op == Adasum and active
        self._adasum_start = {}
        if active:
            self._register_hooks()

    # -- hooks ------------------------------------------------------------------------------

    def _register_hooks(self, params=None):
        params = params if params is not None else \
            [p for group in self.param_groups for p in group["params"]]
        params = [p for p in params if p.requires_grad]
        if self._groups is not None and params:
            # Every rank must form the same groups: take rank 0's parameter order.
            order = broadcast_object([self._parameter_names[p] for p in params], root_rank=0,
                                     name=f"{self._name_prefix}order.{len(self._hook_handles)}",
                                     process_set=self.process_set)
            position = {name: i for i, name in enumerate(order)}
            params = sorted(params, key=lambda p: position.get(self._parameter_names[p], 0))
            for group in form_groups(params, self._groups, self._parameter_names.get):
                for p in group:
                    self._p_to_group[p] = group
                self._group_counts[group] = 0
        for p in params:
            self._requires_update.append(p)
            self._allreduce_delay[p] = self.backward_passes_per_step
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))
        # Gradients that the other ranks on this host can map are reduced in place there.
        shared_gradients.enable(params, self.process_set)

    def _make_hook(self, p):
        # The hook holds the optimizer weakly: a DistributedOptimizer that the script dropped
        # (replaced by a new one) is collected, and its hooks are removed.
        ref = weakref.ref(self)

        def hook(_param):
            self = ref()
            if self is None:
                return
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(_TOO_MANY_PASSES)
            self._pending += 1
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] > 0:
                return
            if self._adasum:
                self._handles[p] = self._adasum_delta_async(p)
                return
            group = self._p_to_group.get(p)
            if group is None:
                self._ready.append(p)
                self._ready_bytes += p.grad.numel() * p.grad.element_size()
                if self._ready_bytes >= self._bucket_bytes:
                    self._flush_ready()
                return
            self._group_counts[group] += 1
            if self._group_counts[group] == len(group):
                self._handles[group] = self._grouped_allreduce_grad_async(group)
        return hook

    def _ensure_grad(self, p):
        """A parameter without a gradient on this rank still takes part (other ranks may have
        one: dynamic graphs, unused branches): it contributes zeros."""
        if p.grad is None:
            layout = self._sparse_layout.get(p)
            if layout is not None and not self.sparse_as_dense:
                sparse_dim = layout
                p.grad = torch.sparse_coo_tensor(
                    torch.zeros((sparse_dim, 0), dtype=torch.int64, device=p.device),
                    torch.zeros((0,) + tuple(p.shape[sparse_dim:]), dtype=p.dtype,
                                device=p.device), p.shape, check_invariants=False)
            else:
                p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
        return p.grad

    def _allreduce_grad_async(self, p):
        tensor = self._ensure_grad(p)
        name = self._parameter_names[p]
        if tensor.is_sparse:
            self._sparse_layout[p] = tensor.sparse_dim()
            if not self.sparse_as_dense:
                return sparse_allreduce_async(tensor, name=name, op=self.op,
                                              process_set=self.process_set), None
            tensor = tensor.to_dense()
        compressed, ctx = self._compression.compress(tensor)
        pre, post = self._scales
        handle = allreduce_async_(compressed, name=name, op=self.op, prescale_factor=pre,
                                  postscale_factor=post, process_set=self.process_set)
        return handle, (ctx, compressed)

    def _adasum_delta_async(self, p):
        """Takes the wrapped optimizer's step for ``p`` alone, now, and starts the Adasum of
        the change it made; ``step()`` sets ``p`` to its old value plus the combined change.
        The update is computed while the rest of backward runs, as in Horovod. A parameter
        without a gradient on this rank is not stepped (as torch would skip it): its update
        is zero."""
        start = self._adasum_start.get(p)
        if start is None:
            start = self._adasum_start[p] = torch.empty_like(p, requires_grad=False)
        with torch.no_grad():
            start.copy_(p)
        if p.grad is not None:
            stashed = [group["params"] for group in self.param_groups]
            for group in self.param_groups:
                group["params"] = [p] if any(q is p for q in group["params"]) else []
            try:
                super().step()
            finally:
                for group, params in zip(self.param_groups, stashed):
                    group["params"] = params
        with torch.no_grad():
            p.sub_(start)
        compressed, ctx = self._compression.compress(p.data)
        handle = allreduce_async_(compressed, name=self._parameter_names[p], op=Adasum,
                                  process_set=self.process_set)
        return handle, (ctx, compressed)

    def _grouped_allreduce_grad_async(self, group):
        tensors, ctxs = [], []
        for p in group:
            t = self._ensure_grad(p)
            if t.is_sparse:
                t = t.to_dense()
            c, ctx = self._compression.compress(t)
            tensors.append(c)
            ctxs.append((ctx, c))
        self._group_counts[group] = 0
        pre, post = self._scales
        handle = grouped_allreduce_async_(tensors, name=self._parameter_names[group[0]],
                                          op=self.op, prescale_factor=pre,
                                          postscale_factor=post, process_set=self.process_set)
        return handle, ctxs

    def _flush_ready(self):
        """Submits the open bucket: its dense gradients in one batch (one engine wake-up;
        the core still negotiates and fuses them tensor by tensor), sparse ones alone."""
        ready, self._ready, self._ready_bytes = self._ready, [], 0
        dense = []
        for p in ready:
            grad = self._ensure_grad(p)
            if grad.is_sparse and not self.sparse_as_dense:
                self._handles[p] = self._allreduce_grad_async(p)
            else:
                dense.append(p)
        if len(dense) == 1:
            self._handles[dense[0]] = self._allreduce_grad_async(dense[0])
        elif dense:
            tensors, ctxs = [], []
            for p in dense:
                t = p.grad.to_dense() if p.grad.is_sparse else p.grad
                c, ctx = self._compression.compress(t)
                tensors.append(c)
                ctxs.append((ctx, c))
            pre, post = self._scales
            handle = _allreduce_batch_async_(tensors, [self._parameter_names[p] for p in dense],
                                             self.op, pre, post, self.process_set)
            self._handles[tuple(dense)] = (handle, ctxs)

    def _store_result(self, p, output, ctx):
        """Writes a finished allreduce back: into the gradient, or with Adasum the parameter
        (its start plus the combined update)."""
        if ctx is not None:
            output = self._compression.decompress(output, ctx[0])
        if self._adasum:
            with torch.no_grad():
                torch.add(self._adasum_start[p], output, out=p.data)
            return
        grad = p.grad
        if grad.is_sparse:
            p.grad = output if output.is_sparse else output.to_sparse(grad.sparse_dim())
        elif output.data_ptr() != grad.data_ptr():
            grad.copy_(output)

    def __del__(self):
        for h in getattr(self, "_hook_handles", ()):
            h.remove()

    # -- public API -------------------------------------------------------------------------

    def synchronize(self):
        """Waits until every gradient has been averaged across ranks and written into
        ``p.grad``. Gradients whose allreduce has not started (parameters that received no
        gradient on this rank, partially filled groups) are submitted now, zeros where there
        is no gradient, so ranks never wait on each other forever.

        With op=Adasum, as in Horovod, this does nothing: ``step()`` applies the combined
        updates."""
        if self._adasum:
            return
        self._synchronize()

    def _synchronize(self):
        if not self._included:
            self._synchronized = True
            return
        started = set(self._ready)
        for key in self._handles:
            started.update(key if isinstance(key, tuple) else (key,))
        for p in self._requires_update:
            if p in started:
                continue
            group = self._p_to_group.get(p)
            if self._adasum:
                self._handles[p] = self._adasum_delta_async(p)
            elif group is None:
                self._ready.append(p)
            else:
                self._handles[group] = self._grouped_allreduce_grad_async(group)
                started.update(group)
        if self._ready:
            self._flush_ready()
        error = None
        for key, (handle, ctx) in self._handles.items():
            try:  # wait for every op (their buffers must outlive them) before raising
                output = synchronize(handle)
                if isinstance(key, tuple):
                    for gp, out, gctx in zip(key, output, ctx):
                        self._store_result(gp, out, gctx)
                else:
                    self._store_result(key, output, ctx)
            except Exception as e:  # noqa: BLE001 - re-raised below
                error = error or e
                if self._adasum:  # the parameter holds its update: put the weights back
                    for p in key if isinstance(key, tuple) else (key,):
                        self._restore_start(p)
        self._end_step()
        self._synchronized = True
        if error is not None:
            raise error

    def _end_step(self):
        """Forgets this step's allreduces: the next backward starts counting afresh."""
        self._generation = basics.generation()
        self._ready.clear()
        self._ready_bytes = 0
        self._handles.clear()
        for p in self._requires_update:
            self._allreduce_delay[p] = self.backward_passes_per_step
        for group in self._group_counts:
            self._group_counts[group] = 0
        self._pending = 0

    def _restore_start(self, p):
        with torch.no_grad():
            p.copy_(self._adasum_start[p])

    def _abandon_adasum_step(self):
        """After a failed closure: waits for the updates in flight (their buffers are the
        parameters) and puts every parameter back to where the step started."""
        for key, (handle, _) in self._handles.items():
            try:
                synchronize(handle)
            except Exception:  # noqa: BLE001 - the closure's error is the one to report
                pass
            self._restore_start(key)
        self._end_step()

    def set_backward_passes_per_step(self, passes):
        """Changes how many backward passes accumulate locally before each allreduce (takes
        effect from the next pass; the counts of passes already run restart)."""
        passes = int(passes)
        if passes < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    @contextmanager
    def skip_synchronize(self):
        """Makes ``step()`` skip its synchronize, for when you called ``synchronize()``
        yourself (e.g. to clip the averaged gradients)::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        if self._adasum:
            raise AssertionError(_ADASUM_SKIP)
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Averages the gradients (unless inside ``skip_synchronize()``), then performs the
        wrapped optimizer's step. With op=Adasum each parameter took its step during backward:
        this sets the parameters to the Adasum-combined steps of all ranks."""
        if self._adasum:
            try:
                loss = closure() if closure is not None else None
            except BaseException:
                self._abandon_adasum_step()
                raise
            self._synchronize()
            self._synchronized = False
            self._tell_schedulers()
            return loss
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_WARNING)
            self.synchronize()
        self._synchronized = False
        loss = super().step(closure)
        self._tell_schedulers()
        return loss

    def _tell_schedulers(self):
        """An LR scheduler made before wrapping watches the original optimizer's ``step()``,
        which this one replaces: tell it a step happened, or its first ``step()`` warns that
        it came before ``optimizer.step()`` (torch's flag, set as its own wrapper would)."""
        original = self._hvd_original()
        if original is not None and "step" in original.__dict__:
            original._opt_called = True

    # Keep torch from wrapping this step in its profiling/hook wrapper: the wrapped
    # optimizer's step (called above) already runs the step hooks, once.
    step.hooked = True

    def zero_grad(self, set_to_none=True):
        """Clears the gradients; refuses while gradient allreduces are in flight."""
        if (self._handles or self._pending) and self._generation != basics.generation():
            # The step failed with the core it ran on (an elastic reset since): its
            # allreduces are gone with that core, not in flight.
            self._end_step()
        if self._handles or self._pending:
            raise AssertionError(_ZERO_GRAD_ERROR)
        return super().zero_grad(set_to_none)

    def add_param_group(self, param_group):
        """Adds a parameter group; its parameters' gradients are averaged too (named by
        their position, so add groups in the same order on every rank)."""
        super().add_param_group(param_group)
        if not hasattr(self, "_parameter_names"):
            return
        group_index = len(self.param_groups) - 1
        new = [p for p in self.param_groups[-1]["params"] if p not in self._parameter_names]
        for i, p in enumerate(new):
            self._parameter_names[p] = f"{self._name_prefix}group{group_index}.{i}"
        if self._hook_handles or (self._included and _config.env_flag("ELASTIC")):
            self._register_hooks(new)


_classes = {}


def _distributed_class(base):
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizer, base),
                   {"__module__": __name__, "__doc__": base.__doc__})
        _classes[base] = cls
    return cls


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wraps a ``torch.optim.Optimizer`` so that gradients are averaged across ranks.

    Args:
        optimizer: the optimizer to wrap (any ``torch.optim.Optimizer``).
        named_parameters: ``model.named_parameters()``; names the allreduces (better
            diagnostics). Every optimized parameter must be named, each name once.
        compression: ``Compression.none`` or ``Compression.fp16`` (gradients sent as fp16).
        backward_passes_per_step: gradients are accumulated locally over this many
            ``backward()`` calls and allreduced once (call ``step()`` after them).
        op: ``Average`` (default), ``Sum`` or ``Adasum``. With Adasum (a power-of-two
            number of ranks) each rank applies the wrapped optimizer to its own gradients
            during backward and ``step()`` combines the resulting updates with Adasum
            (Horovod's delta optimizer; do not scale the learning rate by the number of
            ranks; ``groups`` are not used and ``synchronize()`` does nothing). The local
            update happens during backward, so clipping or unscaling gradients between
            ``backward()`` and ``step()`` has no effect, and ``step()`` must follow every
            backward (it also puts the parameters back from their updates).
        gradient_predivide_factor: with op=Average, gradients are divided by this factor
            before the sum and by ``size / factor`` after.
        num_groups: deprecated spelling of ``groups=<int>``.
        groups: an int (split parameters into that many groups, each reduced by one grouped
            allreduce) or a list of lists of parameters that are reduced together.
        sparse_as_dense: densify sparse gradients before the allreduce (otherwise they are
            allgathered as indices and values).
        process_set: the ranks that average their gradients.

    With one rank in the process set, no hooks are installed and ``step()`` is the wrapped
    optimizer's step (as in Horovod; set ``SPARK_HVD_ELASTIC=1`` to keep the hooks).
    """
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already a DistributedOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                         f"{type(optimizer).__name__}")
    groups = check_optimizer_args(op, gradient_predivide_factor, num_groups, groups,
                                  is_tensor=lambda t: isinstance(t, torch.Tensor))
    if process_set is None:
        process_set = global_process_set
    check_adasum_size(op, process_set.size())
    cls = _distributed_class(type(optimizer))
    dist = cls.__new__(cls)
    # Share everything but per-instance wrappers of the original's methods (an LR scheduler
    # created before wrapping patches ``optimizer.step``): those would bypass synchronize().
    dist.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                          if k not in ("step", "zero_grad")})
    dist._hvd_original = weakref.ref(optimizer)
    dist._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                    gradient_predivide_factor, groups, sparse_as_dense, process_set)
    return dist
