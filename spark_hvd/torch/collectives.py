"""Collectives on torch tensors: the asynchronous and in-place forms, handles, join, barrier.

The adapter only turns tensors into (pointer, dtype code, shape) for the core and back:

- A contiguous CPU tensor is handed to the core by its ``data_ptr()``: no copy. In-place ops
  (``allreduce_``, ``broadcast_``) and allreduce/broadcast outputs are written by the core
  directly into the tensor's memory.
- A CUDA tensor is handed to the core by its device pointer, with its device and the current
  stream (``cuda_built()``): the core waits for that stream's work so far on a stream of its
  own (an event, no host synchronisation) and runs NCCL there; no host copy.
- A non-contiguous tensor is made contiguous first (on its own device), and in-place ops copy
  the result back into it. Where the core has no CUDA runtime, CUDA tensors are staged through
  a host copy (counted in ``gpu_counters()["host_staged_bytes"]``).
- Results the core allocates (allgather, alltoall, reducescatter) are copied once into a new
  tensor of the result's shape (device to device for CUDA tensors).

Every ``*_async`` function returns a handle for :func:`poll` / :func:`synchronize`. The
differentiable synchronous forms (``allreduce``, ``allgather``, ...) are in
``spark_hvd.torch.differentiable``; everything is re-exported by ``spark_hvd.torch``.
"""

import ctypes

import torch

from ..common import _gpu, _ops, basics
from ..common._errors import as_collective_error
from ..common._native import (BFLOAT16, BOOL, FLOAT16, FLOAT32, FLOAT64, INT8, INT16, INT32,
                              INT64, OP_ALLGATHER, OP_ALLREDUCE, OP_ALLTOALL,
                              OP_BROADCAST, OP_JOIN, OP_REDUCESCATTER, UINT8, UINT16)
from ..common._ops import Adasum, Average, Sum
from ..common._outputs import wait_output_into
from ..common.process_sets import global_process_set, process_set_id

_DTYPES = {torch.uint8: UINT8, torch.int8: INT8, torch.uint16: UINT16, torch.int16: INT16,
           torch.int32: INT32, torch.int64: INT64, torch.float16: FLOAT16,
           torch.bfloat16: BFLOAT16, torch.float32: FLOAT32, torch.float64: FLOAT64,
           torch.bool: BOOL}

# The core wants a valid address even for zero bytes; empty tensors may have none.
_EMPTY = ctypes.create_string_buffer(8)
_EMPTY_PTR = ctypes.addressof(_EMPTY)


# -- tensors <-> buffers --------------------------------------------------------------------

def _dtype_code(tensor):
    code = _DTYPES.get(tensor.dtype)
    if code is None:
        raise ValueError(f"Tensor type {tensor.dtype} is not supported; spark_hvd supports "
                         + ", ".join(str(d).replace("torch.", "") for d in _DTYPES))
    return code


def _host(tensor):
    """``(buffer, staged)``: a contiguous tensor the core can read ``tensor``'s values from (on
    the CPU, or on its CUDA device when the core takes CUDA tensors), and whether it is a copy
    (False: it shares ``tensor``'s memory)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{tensor.layout} tensors are not supported here; sparse tensors are "
                         "reduced with sparse_allreduce_async (or densify them first)")
    if tensor.is_contiguous() and (tensor.is_cpu or (tensor.is_cuda and _core_takes_cuda())):
        return tensor, False  # the core reads and writes its memory; autograd never sees it
    t = tensor.detach()
    if not t.is_cpu and not (t.is_cuda and _core_takes_cuda()):
        _gpu.count_python_staged(t.numel() * t.element_size())
        t = t.to("cpu")
    return t.contiguous(), True


def _core_takes_cuda():
    return _gpu.status() >= 1


def _place(tensor):
    """Where the core finds ``tensor``'s buffer: ``(device kind, device, stream)``."""
    if tensor.is_cuda:
        return (1, tensor.device.index, torch.cuda.current_stream(tensor.device).cuda_stream)
    return _ops.HOST


def _ptr(tensor):
    return tensor.data_ptr() or _EMPTY_PTR


def _on(tensor, device):
    """``tensor`` (on the CPU) moved to ``device`` when that is another device."""
    return tensor if device.type == "cpu" else tensor.to(device)


def _copy_back(staged, tensor):
    with torch.no_grad():
        tensor.copy_(staged)
    return tensor


def _allocate(dtype, device=None):
    def allocate(shape, nbytes):
        t = torch.empty(shape, dtype=dtype, device=device)
        return t, _ptr(t)
    return allocate


def _output_stream(tensor):
    """The stream a CUDA result is copied on (None for host results)."""
    return torch.cuda.current_stream(tensor.device).cuda_stream if tensor.is_cuda else None


def _auto_name(kind, name, set_id):
    """Horovod's naming (unnamed ops numbered per kind, so ranks must issue them in the same
    order), counted per process set (shared with every adapter, see ``_ops.auto_name``)."""
    return _ops.auto_name(kind, name, set_id)


def _reduce_op(op, average, default=Average):
    return _ops.resolve_reduce_op(op, average, default)


def _enqueue(records):
    try:
        return _ops.enqueue(records)
    except ValueError as e:
        raise as_collective_error(e) from None


def _enqueue_allreduce(*args):
    try:
        return _ops.enqueue_allreduce(*args)
    except ValueError as e:
        raise as_collective_error(e) from None


def _enqueue_one(*args, **kwargs):
    try:
        return _ops.enqueue_one(*args, **kwargs)
    except ValueError as e:
        raise as_collective_error(e) from None


def _staged_batch(tensors, inplace, record, single=False):
    """Hands a batch of tensors to the core in one enqueue and returns the handle of their ops.

    Each tensor is staged (:func:`_host`) and gets an output (its own buffer in place, a new
    tensor otherwise); ``record(i, host, out)`` builds tensor ``i``'s op record. The handle's
    result is the list of results: in place, the tensors themselves (staged ones copied back);
    otherwise the new tensors, on the inputs' devices. ``single``: the one result, not a list.
    """
    tensors = list(tensors)
    hosts, outs, staged, records = [], [], [], []
    for i, t in enumerate(tensors):
        host, copy = _host(t)
        out = host if inplace else torch.empty_like(host)
        records.append(record(i, host, out))
        hosts.append(host)
        outs.append(out)
        staged.append(copy)
    ids = _enqueue(records) if records else []

    def finish(ids):
        _ops.wait_all(ids)
        if inplace:
            results = [_copy_back(h, t) if s else t for h, t, s in zip(hosts, tensors, staged)]
        else:
            results = [_on(o, t.device) for o, t in zip(outs, tensors)]
        return results[0] if single else results
    return _ops.Handle(ids, finish, keepalive=(hosts, outs))


class _Composite:
    """A handle made of other handles; ``combine`` builds the result from theirs."""

    def __init__(self, handles, combine):
        self._handles = handles
        self._combine = combine
        self._done = False
        self._result = None

    def poll(self):
        """True once every part has finished."""
        return self._done or all(h.poll() for h in self._handles)

    def wait(self):
        """Waits for every part and returns the combined result."""
        if not self._done:
            results = [h.wait() for h in self._handles]
            self._result = self._combine(*results)
            self._done = True
        return self._result

    def __call__(self):
        return synchronize(self)


def poll(handle):
    """True if the asynchronous operation behind ``handle`` has finished; :func:`synchronize`
    then returns without blocking."""
    return handle.poll()


def synchronize(handle):
    """Waits for the asynchronous operation behind ``handle`` and returns its result (the
    output tensor; a list for grouped ops; ``(output, received_splits)`` for alltoall). Raises
    the operation's error on every rank if it failed."""
    if handle is None:
        return None
    try:
        return handle.wait()
    except ValueError as e:
        raise as_collective_error(e) from None


# -- allreduce ------------------------------------------------------------------------------

def _allreduce_handle(tensors, inplace, name, op, prescale, postscale, process_set, grouped):
    kind = "grouped_allreduce" if grouped else "allreduce"
    ps = process_set_id(process_set)
    group = _auto_name(kind, name, ps) if grouped else None
    n = len(tensors)
    prescale, postscale = float(prescale), float(postscale)

    def record(i, host, out):
        op_name = f"{group}.{i}" if grouped else _auto_name(kind, name, ps)
        return _ops.make_op(OP_ALLREDUCE, op_name, _dtype_code(host), host.shape, _ptr(host),
                            _ptr(out), reduce_op=op, prescale=prescale, postscale=postscale,
                            process_set=ps, group=group, group_size=n if grouped else 0,
                            place=_place(host))
    return _staged_batch(tensors, inplace, record, single=not grouped)


def _allreduce_one(tensor, inplace, name, op, prescale, postscale, process_set):
    """One tensor's allreduce: the per-tensor hot path (no lists, no closure for CPU tensors)."""
    ps = process_set_id(process_set)
    host, staged = _host(tensor)
    out = host if inplace else torch.empty_like(host)
    h = _enqueue_allreduce(_auto_name("allreduce", name, ps), _dtype_code(host), host.shape,
                           _ptr(host), _ptr(out), op, float(prescale), float(postscale), ps,
                           _place(host))
    if not staged:
        return _ops.ResultHandle(h, tensor if inplace else out, keepalive=(host, out))

    def finish(ids):
        _ops.wait(ids[0])
        return _copy_back(host, tensor) if inplace else _on(out, tensor.device)
    return _ops.Handle([h], finish, keepalive=(host, out))


def _allreduce_batch_async_(tensors, names, op, prescale, postscale, process_set):
    """In-place allreduces of several tensors submitted in one batch (one enqueue, one engine
    wake-up) but negotiated individually, so the core may fuse them with anything else; the
    handle's result is the list of tensors. Used by DistributedOptimizer's gradient buckets."""
    ps = process_set_id(process_set)
    names = list(names)

    def record(i, host, out):
        return _ops.make_op(OP_ALLREDUCE, names[i], _dtype_code(host), host.shape, _ptr(host),
                            _ptr(out), reduce_op=op, prescale=float(prescale),
                            postscale=float(postscale), process_set=ps, place=_place(host))
    return _staged_batch(tensors, True, record)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts reducing ``tensor`` over the ranks of ``process_set``; the input is not modified.

    ``op`` is Average (default), Sum, Min, Max, Product or Adasum (``average`` is its deprecated
    boolean spelling); ``prescale_factor`` / ``postscale_factor`` multiply the tensor before /
    after the reduction. Ranks must issue the same ``name`` (or their unnamed ops in the same
    order) with the same shape and dtype. ``synchronize(handle)`` returns a new tensor.
    """
    op = _reduce_op(op, average)
    return _allreduce_one(tensor, False, name, op, prescale_factor, postscale_factor,
                          process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """In-place :func:`allreduce_async`: ``tensor`` receives the result (``synchronize``
    returns it)."""
    op = _reduce_op(op, average)
    return _allreduce_one(tensor, True, name, op, prescale_factor, postscale_factor,
                          process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """In-place allreduce: reduces ``tensor`` over the ranks and writes the result into it
    (not differentiable). Returns ``tensor``."""
    if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided and \
            tensor.is_contiguous() and (tensor.is_cpu or (tensor.is_cuda and _core_takes_cuda())):
        # The latency-bound hot path: no handle, enqueue and wait in one native call (the
        # engine then sends the op at once). Other tensors are staged by the general path.
        op = _reduce_op(op, average)
        ps = process_set_id(process_set)
        ptr = _ptr(tensor)
        try:
            _ops.allreduce_now(_auto_name("allreduce", name, ps), _dtype_code(tensor),
                               tensor.shape, ptr, ptr, op, float(prescale_factor),
                               float(postscale_factor), ps, tensor, _place(tensor),
                               named=name is not None)
        except ValueError as e:
            raise as_collective_error(e) from None
        return tensor
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Starts an allreduce of a list of tensors that are negotiated together and fused into
    as few collectives as possible; ``synchronize`` returns a list of new tensors."""
    op = _reduce_op(op, average)
    return _allreduce_handle(list(tensors), False, name, op, prescale_factor, postscale_factor,
                             process_set, grouped=True)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """In-place :func:`grouped_allreduce_async`: each tensor receives its result."""
    op = _reduce_op(op, average)
    return _allreduce_handle(list(tensors), True, name, op, prescale_factor, postscale_factor,
                             process_set, grouped=True)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """In-place grouped allreduce; returns ``tensors`` (as a list)."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Starts a reduction of a sparse COO tensor: indices and values are allgathered (a sparse
    sum is the concatenation of the entries); with op=Average the values are divided by the
    set size. ``synchronize`` returns a sparse tensor of the same size (uncoalesced)."""
    op = _reduce_op(op, None)
    if op not in (Average, Sum):
        raise ValueError("sparse allreduce supports op=Average and op=Sum only")
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async needs a sparse COO tensor")
    base = _auto_name("sparse_allreduce", name, process_set_id(process_set))
    indices = tensor._indices().detach().transpose(0, 1).contiguous()
    values = tensor._values().detach()
    h_values = allgather_async(values, name=f"{base}.values", process_set=process_set)
    h_indices = allgather_async(indices, name=f"{base}.indices", process_set=process_set)
    n = process_set.size() if process_set is not None else basics.size()

    def combine(all_values, all_indices):
        if op == Average:
            all_values = all_values / n if all_values.is_floating_point() else \
                torch.div(all_values, n, rounding_mode="trunc")
        return torch.sparse_coo_tensor(all_indices.transpose(0, 1), all_values, tensor.size(),
                                       device=tensor.device, check_invariants=False)
    return _Composite([h_values, h_indices], combine)


# -- allgather ------------------------------------------------------------------------------

def _gather_like(kind, op_kind, tensors, name, process_set, grouped, reduce_op=Sum,
                 prescale=1.0, postscale=1.0):
    """Allgather / reducescatter: the core allocates each result, copied once into a tensor."""
    ps = process_set_id(process_set)
    group = _auto_name(kind, name, ps) if grouped else None
    records, hosts = [], []
    n = len(tensors)
    for i, t in enumerate(tensors):
        host, _ = _host(t)
        if host.dim() == 0 and op_kind == OP_ALLGATHER:
            host = host.reshape(1)  # a scalar is gathered as one row
        op_name = f"{group}.{i}" if grouped else _auto_name(kind, name, ps)
        records.append(_ops.make_op(op_kind, op_name, _dtype_code(host), host.shape, _ptr(host),
                                    None, reduce_op=reduce_op, prescale=float(prescale),
                                    postscale=float(postscale), process_set=ps, group=group,
                                    group_size=n if grouped else 0, place=_place(host)))
        hosts.append(host)
    ids = _enqueue(records) if records else []

    def finish(ids):
        results, error = [], None
        for hid, host, t in zip(ids, hosts, tensors):
            try:  # collect (and release) every part even when one failed
                out, _ = wait_output_into(hid, _allocate(host.dtype, host.device),
                                          stream=_output_stream(host))
                results.append(_on(out, t.device))
            except Exception as e:  # noqa: BLE001 - re-raised below
                error = error or e
        if error is not None:
            raise error
        return results if grouped else results[0]
    return _ops.Handle(ids, finish, keepalive=hosts)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts concatenating every rank's ``tensor`` along the first dimension, in rank order.
    The first dimension may differ between ranks; the others must agree."""
    return _gather_like("allgather", OP_ALLGATHER, [tensor], name, process_set, grouped=False)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Starts an allgather of each tensor of a list, negotiated together;
    ``synchronize`` returns a list."""
    return _gather_like("grouped_allgather", OP_ALLGATHER, list(tensors), name, process_set,
                        grouped=True)


# -- broadcast ------------------------------------------------------------------------------

def _broadcast_handle(tensor, root_rank, name, process_set, inplace):
    host, staged = _host(tensor)
    out = host if inplace else torch.empty_like(host)
    ps = process_set_id(process_set)
    h = _enqueue_one(OP_BROADCAST, _auto_name("broadcast", name, ps), _dtype_code(host),
                     host.shape, _ptr(host), _ptr(out), root_rank=int(root_rank),
                     process_set=ps, place=_place(host))

    def finish(ids):
        _ops.wait_all(ids)
        if inplace:
            return _copy_back(host, tensor) if staged else tensor
        return _on(out, tensor.device)
    return _ops.Handle([h], finish, keepalive=(host, out))


def _broadcast_many_(tensors, root_rank, names, process_set):
    """In-place broadcast of many tensors submitted in one batch (one enqueue, one wait);
    ``names[i]`` may be None (auto-named). Used for parameters and optimizer state."""
    ps = process_set_id(process_set)
    names = list(names)

    def record(i, host, out):
        return _ops.make_op(OP_BROADCAST, _auto_name("broadcast", names[i], ps),
                            _dtype_code(host), host.shape, _ptr(host), _ptr(out),
                            root_rank=int(root_rank), process_set=ps, place=_place(host))
    return _staged_batch(tensors, True, record)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts broadcasting the ``root_rank``'s ``tensor`` (``root_rank`` counts within
    ``process_set``); ``synchronize`` returns a new tensor. The input is not modified."""
    return _broadcast_handle(tensor, root_rank, name, process_set, inplace=False)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place :func:`broadcast_async`: ``tensor`` receives the root's values."""
    return _broadcast_handle(tensor, root_rank, name, process_set, inplace=True)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast: ``tensor`` receives the root rank's values (not differentiable).
    Returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall -------------------------------------------------------------------------------

def _splits_tuple(splits):
    if splits is None:
        return ()
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu().reshape(-1).tolist()
    return _ops.check_splits(splits)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts an alltoall: ``splits[i]`` consecutive rows of ``tensor`` go to member ``i``
    (without ``splits`` the first dimension is divided evenly). ``synchronize`` returns
    ``(received rows concatenated in rank order, received splits as an int32 tensor)``."""
    host, _ = _host(tensor)
    ps = process_set_id(process_set)
    h = _enqueue_one(OP_ALLTOALL, _auto_name("alltoall", name, ps), _dtype_code(host),
                     host.shape, _ptr(host), None, process_set=ps,
                     splits=_splits_tuple(splits), place=_place(host))
    want = basics.size()

    def finish(ids):
        out, received = wait_output_into(ids[0], _allocate(host.dtype, host.device),
                                         want_ints=want, stream=_output_stream(host))
        return _on(out, tensor.device), torch.tensor(received, dtype=torch.int32)
    return _ops.Handle([h], finish, keepalive=host)


# -- reducescatter --------------------------------------------------------------------------

_scatter_op = _ops.resolve_scatter_op  # Average or Sum; any other op is a CollectiveError


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Starts a reducescatter: the tensor is reduced over the ranks (Average or Sum) and each
    rank receives its block of the first dimension (the first ``rows % n`` members get one
    row more)."""
    return _gather_like("reducescatter", OP_REDUCESCATTER, [tensor], name, process_set,
                        grouped=False, reduce_op=_scatter_op(op), prescale=prescale_factor,
                        postscale=postscale_factor)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Starts a reducescatter of each tensor of a list, negotiated together;
    ``synchronize`` returns a list."""
    return _gather_like("grouped_reducescatter", OP_REDUCESCATTER, list(tensors), name,
                        process_set, grouped=True, reduce_op=_scatter_op(op),
                        prescale=prescale_factor, postscale=postscale_factor)


# -- join and barrier -----------------------------------------------------------------------

def join(device=-1):
    """Declares that this rank has run out of data. Until every rank has joined it keeps
    taking part in the other ranks' allreduces (contributing zeros), so a DistributedOptimizer
    on ranks with more batches does not hang. Blocks until all ranks joined and returns the
    rank that joined last. ``device`` is accepted for Horovod compatibility."""
    h = _enqueue_one(OP_JOIN, "__join__", UINT8, (), None, None)
    try:
        return int(_ops.wait_ints(h, keepalive=None)[0])
    except ValueError as e:
        raise as_collective_error(e) from None


def barrier(process_set=global_process_set):
    """Returns once every rank of ``process_set`` has called barrier."""
    try:
        _ops.barrier_now(process_set_id(process_set))
    except ValueError as e:
        raise as_collective_error(e) from None
