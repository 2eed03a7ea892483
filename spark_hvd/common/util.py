"""Helpers under Horovod's names (``horovod.common.util``) for scripts and tests that import them.

Only what code outside Horovod uses: what was built (``extension_available``, ``gloo_built``,
``mpi_built``, ...), ``env`` to set environment variables for a block, ``_cache`` and
``is_version_greater_equal_than``, and the small list helpers. Nothing here loads the native
core until a ``*_built`` function is called.
"""

import contextlib
import importlib.util
import os
import warnings

# The frameworks spark_hvd has an adapter for; Horovod's list also names mxnet, which spark_hvd
# has none for (extension_available('mxnet') is False).
_ADAPTERS = {"tensorflow": "tensorflow", "torch": "torch", "keras": "keras"}


def _cache(f):
    """Memoises ``f`` on its positional and keyword arguments (which must be hashable)."""
    cache = {}

    def wrapper(*args, **kwargs):
        key = (args, frozenset(kwargs.items()))
        if key not in cache:
            cache[key] = f(*args, **kwargs)
        return cache[key]

    wrapper.__name__ = getattr(f, "__name__", "wrapper")
    wrapper.__doc__ = getattr(f, "__doc__", None)
    return wrapper


@_cache
def extension_available(ext_base_name, verbose=False):
    """True when spark_hvd can serve ``ext_base_name`` ('tensorflow', 'torch', 'keras'): the
    framework is installed (spark_hvd's adapters need no separate build). False otherwise,
    'mxnet' included. Found without importing the framework, as Horovod's check avoids it too."""
    module = _ADAPTERS.get(ext_base_name)
    available = module is not None and importlib.util.find_spec(module) is not None
    if verbose:
        print(f"Extension {ext_base_name} has {'' if available else 'not '}been built.")
    return available


def gpu_available(ext_base_name, verbose=False):
    """False: spark_hvd's core has no GPU data path (CUDA tensors are staged through host
    memory), so Horovod's GPU-only tests skip."""
    if verbose:
        print(f"Extension {ext_base_name} is not running with GPU.")
    return False


def _basics():
    from . import basics
    return basics


def mpi_built(verbose=False):
    """False: MPI is not a data transport of spark_hvd (mpirun still launches jobs)."""
    return _basics().mpi_built()


def gloo_built(verbose=False):
    """True: the embedded TCP/shared-memory transport fills Horovod's Gloo slot."""
    return _basics().gloo_built()


def nccl_built(verbose=False):
    """False: no NCCL transport."""
    return _basics().nccl_built()


def ddl_built(verbose=False):
    """False: IBM DDL is not supported."""
    return _basics().ddl_built()


def ccl_built(verbose=False):
    """False: oneCCL is not supported."""
    return _basics().ccl_built()


@contextlib.contextmanager
def env(**kwargs):
    """Sets environment variables for the ``with`` block and restores the previous values (or
    their absence) afterwards; arguments whose value is None are ignored."""
    values = {k: v for k, v in kwargs.items() if v is not None}
    backup = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, old in backup.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def get_average_backwards_compatibility_fun(reduce_ops):
    """Horovod's resolver of the deprecated ``average=`` argument against ``op=``: returns
    ``impl(op, average)`` giving the op to use (``reduce_ops`` provides Average and Sum)."""
    def impl(op, average):
        if op is not None:
            if average is not None:
                raise ValueError("The op parameter supersedes average. "
                                 "Please provide only one of them.")
            return op
        if average is not None:
            warnings.warn("Parameter `average` has been replaced with `op` and will be removed "
                          "in v1.0", DeprecationWarning)
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average
    return impl


def num_rank_is_power_2(num_rank):
    """True when ``num_rank`` is a power of two (what Adasum needs)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def split_list(items, n):
    """Splits ``items`` into ``n`` contiguous chunks whose lengths differ by at most one (the
    first ``len % n`` get one more)."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def is_iterable(x):
    """True when ``iter(x)`` works."""
    try:
        iter(x)
    except TypeError:
        return False
    return True


@_cache
def is_version_greater_equal_than(ver, target):
    """``ver >= target`` as versions (PEP 440); both must be strings and ``target`` of the form
    major.minor.patch, else ValueError (Horovod's contract)."""
    from packaging import version
    if not (isinstance(ver, str) and isinstance(target, str)):
        raise ValueError(f"This function only accepts string arguments; received ver={ver!r} "
                         f"({type(ver).__name__}), target={target!r} ({type(target).__name__})")
    if len(target.split(".")) != 3:
        raise ValueError("We only accept target version values in the form of "
                         f"major.minor.patch. Received: {target}")
    return version.parse(ver) >= version.parse(target)
