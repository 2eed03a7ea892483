"""spark_hvd.torch's public surface without a job: every Horovod name with Horovod's argument
names and defaults, docstrings, the mpi_ops alias, compression and the shared gradient rules."""

import inspect
import warnings

import pytest
import torch

import spark_hvd.torch as hvd
from spark_hvd.common import gradients

# Horovod's torch API: name -> leading parameter names (in order).
SIGNATURES = {
    "allreduce": ["tensor", "average", "name", "compression", "op", "prescale_factor",
                  "postscale_factor", "process_set"],
    "allreduce_async": ["tensor", "average", "name", "op", "prescale_factor",
                        "postscale_factor", "process_set"],
    "allreduce_": ["tensor", "average", "name", "op", "prescale_factor", "postscale_factor",
                   "process_set"],
    "allreduce_async_": ["tensor", "average", "name", "op", "prescale_factor",
                         "postscale_factor", "process_set"],
    "grouped_allreduce": ["tensors", "average", "name", "compression", "op", "prescale_factor",
                          "postscale_factor", "process_set"],
    "grouped_allreduce_async": ["tensors", "average", "name", "op", "prescale_factor",
                                "postscale_factor", "process_set"],
    "grouped_allreduce_": ["tensors", "average", "name", "op", "prescale_factor",
                           "postscale_factor", "process_set"],
    "grouped_allreduce_async_": ["tensors", "average", "name", "op", "prescale_factor",
                                 "postscale_factor", "process_set"],
    "sparse_allreduce_async": ["tensor", "name", "op", "process_set"],
    "allgather": ["tensor", "name", "process_set"],
    "allgather_async": ["tensor", "name", "process_set"],
    "grouped_allgather": ["tensors", "name", "process_set"],
    "grouped_allgather_async": ["tensors", "name", "process_set"],
    "broadcast": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_async": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_async_": ["tensor", "root_rank", "name", "process_set"],
    "alltoall": ["tensor", "splits", "name", "process_set"],
    "alltoall_async": ["tensor", "splits", "name", "process_set"],
    "reducescatter": ["tensor", "name", "compression", "op", "process_set", "prescale_factor",
                      "postscale_factor"],
    "reducescatter_async": ["tensor", "name", "op", "process_set", "prescale_factor",
                            "postscale_factor"],
    "grouped_reducescatter": ["tensors", "name", "compression", "op", "process_set",
                              "prescale_factor", "postscale_factor"],
    "grouped_reducescatter_async": ["tensors", "name", "op", "process_set", "prescale_factor",
                                    "postscale_factor"],
    "join": ["device"],
    "barrier": ["process_set"],
    "poll": ["handle"],
    "synchronize": ["handle"],
    "broadcast_parameters": ["params", "root_rank", "prefix", "process_set"],
    "broadcast_optimizer_state": ["optimizer", "root_rank", "prefix", "process_set"],
    "broadcast_object": ["obj", "root_rank", "name", "process_set"],
    "allgather_object": ["obj", "name", "process_set"],
    "DistributedOptimizer": ["optimizer", "named_parameters", "compression",
                             "backward_passes_per_step", "op", "gradient_predivide_factor",
                             "num_groups", "groups", "sparse_as_dense", "process_set"],
    "SyncBatchNorm": ["num_features", "eps", "momentum", "affine", "track_running_stats"],
    "init": ["comm", "process_sets"],
    "start_timeline": ["file_path", "mark_cycles"],
}
OTHER_NAMES = ["shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
               "cross_size", "cross_rank", "is_homogeneous", "mpi_threads_supported",
               "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
               "ddl_built", "ccl_built", "cuda_built", "rocm_built", "stop_timeline", "Average",
               "Sum", "Adasum", "Min", "Max", "Product", "ProcessSet", "global_process_set",
               "add_process_set", "remove_process_set", "Compression", "HorovodInternalError"]


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_horovod_signature(name):
    params = list(inspect.signature(getattr(hvd, name)).parameters)
    assert params[:len(SIGNATURES[name])] == SIGNATURES[name]


def test_horovod_defaults():
    sig = inspect.signature(hvd.DistributedOptimizer).parameters
    assert sig["backward_passes_per_step"].default == 1
    assert sig["op"].default == hvd.Average
    assert sig["compression"].default is hvd.Compression.none
    assert sig["process_set"].default is hvd.global_process_set
    assert inspect.signature(hvd.allreduce).parameters["op"].default is None  # = Average
    assert inspect.signature(hvd.reducescatter).parameters["op"].default == hvd.Average
    assert inspect.signature(hvd.broadcast_object).parameters["root_rank"].default == 0
    assert inspect.signature(hvd.join).parameters["device"].default == -1


def test_every_name_and_docstring():
    for name in list(SIGNATURES) + OTHER_NAMES:
        assert hasattr(hvd, name), name
    for name in hvd.__all__:
        obj = getattr(hvd, name)
        if callable(obj) and getattr(obj, "__module__", "").startswith("spark_hvd.torch"):
            assert inspect.getdoc(obj), f"{name} has no docstring"
    import spark_hvd.torch.collectives as col
    import spark_hvd.torch.differentiable as dif
    import spark_hvd.torch.functions as fun
    import spark_hvd.torch.optimizer as opt
    import spark_hvd.torch.sync_batch_norm as sbn
    for mod in (col, dif, fun, opt, sbn):
        for name, obj in vars(mod).items():
            if not name.startswith("_") and inspect.isfunction(obj) and \
                    obj.__module__ == mod.__name__:
                assert inspect.getdoc(obj), f"{mod.__name__}.{name} has no docstring"


def test_mpi_ops_alias():
    from spark_hvd.torch import differentiable, mpi_ops
    for name in hvd.__all__:
        assert getattr(mpi_ops, name) is getattr(hvd, name)
    # Horovod's autograd Functions, imported from mpi_ops by some scripts
    for name in ("HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather",
                 "HorovodGroupedAllgather", "HorovodBroadcast", "HorovodAlltoall",
                 "HorovodReducescatter", "HorovodGroupedReducescatter"):
        assert getattr(mpi_ops, name) is getattr(differentiable, name)
        assert issubclass(getattr(mpi_ops, name), torch.autograd.Function)


def test_gpu_build_flags():
    # NCCL needs the CUDA runtime; ROCm is not supported (tests/test_gpu_loading.py checks
    # what each says against the libraries this machine has).
    assert isinstance(hvd.cuda_built(), bool) and isinstance(hvd.nccl_built(), bool)
    assert hvd.cuda_built() or not hvd.nccl_built()
    assert not hvd.rocm_built()


def test_compression():
    t = torch.randn(5, dtype=torch.float64)
    c, ctx = hvd.Compression.fp16.compress(t)
    assert c.dtype == torch.float16
    back = hvd.Compression.fp16.decompress(c, ctx)
    assert back.dtype == torch.float64 and torch.allclose(back, t, atol=1e-2)
    for dtype in (torch.int32, torch.bool, torch.float16):
        x = torch.ones(3, dtype=dtype)
        c, ctx = hvd.Compression.fp16.compress(x)
        assert c is x and hvd.Compression.fp16.decompress(c, ctx) is x
    c, ctx = hvd.Compression.none.compress(t)
    assert c is t and hvd.Compression.none.decompress(c, ctx) is t
    from spark_hvd.torch.compression import Compressor

    class Halve(Compressor):
        @staticmethod
        def compress(tensor):
            return tensor / 2, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor * 2
    assert torch.equal(Halve.decompress(*Halve.compress(t)), t)


def test_gradient_rules():
    assert gradients.scale_factors(hvd.Average, 4.0) == (0.25, 4.0)
    assert gradients.scale_factors(hvd.Sum, 1.0) == (1.0, 1.0)
    assert gradients.split_into_groups(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert gradients.split_into_groups([1, 2], 5) == [[1], [2]]
    assert gradients.reducescatter_grad_scale(hvd.Average, 4, 2.0, 3.0) == 6.0
    assert gradients.reducescatter_grad_scale(hvd.Sum, 4, 2.0, 3.0) == 24.0
    assert gradients.slice_offset([2, 3, 4], 2) == 5
    assert gradients.find_duplicates(["a", "b", "a", "a"]) == ["a"]
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        gradients.check_optimizer_args(hvd.Sum, 2.0)
    with pytest.raises(ValueError, match="groups"):
        gradients.check_optimizer_args(hvd.Average, groups=0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert gradients.check_optimizer_args(hvd.Average, num_groups=3) == 3
    assert any(issubclass(x.category, DeprecationWarning) for x in w)
    p, q = torch.zeros(1), torch.zeros(2)
    assert gradients.named_parameters_of(None, [p, q]) == {id(p): "allreduce.noname.0",
                                                           id(q): "allreduce.noname.1"}
    with pytest.raises(ValueError, match="not named"):
        gradients.named_parameters_of([("p", p)], [p, q])
    groups = gradients.form_groups([p, q, torch.zeros(3)], [[q]], None)
    assert [len(g) for g in groups] == [1, 1, 1] and groups[0][0] is q


def test_collective_error_is_both():
    assert issubclass(hvd.CollectiveError, ValueError)
    assert issubclass(hvd.CollectiveError, RuntimeError)
    assert not issubclass(hvd.CollectiveError, hvd.HorovodInternalError)
