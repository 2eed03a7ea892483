"""The Lightning strategy on spark_hvd's torch API, built for whichever Lightning package the
model comes from (``lightning.pytorch`` or the standalone ``pytorch_lightning``: their class
hierarchies are distinct, so a strategy must subclass the Trainer's own ``ParallelStrategy``).

Lightning 2.x removed its ``HorovodStrategy``; this one follows its design on spark_hvd:
parameters and optimizer state are broadcast from rank 0 when training starts, each optimizer
is wrapped in ``spark_hvd.torch.DistributedOptimizer`` (gradients are averaged by allreduces
that start while backward runs), and the averaged gradients are waited for right after the
closure's backward, before Lightning's ``on_before_optimizer_step`` hooks and gradient
clipping, so those see the averaged gradients on every rank. Lightning's collectives
(``reduce``, ``all_gather``, ``broadcast``, ``barrier``) are spark_hvd's.
"""

from __future__ import annotations

import importlib

_classes: dict = {}


def import_lightning(package: str = "lightning.pytorch"):
    """``package`` (``"lightning.pytorch"`` or ``"pytorch_lightning"``), or an ImportError that
    names what to install."""
    try:
        return importlib.import_module(package)
    except ImportError as error:
        dist = "lightning" if package.startswith("lightning") else "pytorch-lightning"
        raise ImportError(
            f"spark_hvd's Lightning support needs PyTorch Lightning: {package} cannot be "
            f"imported ({type(error).__name__}: {error}); install it with "
            f"`pip install {dist}`") from error


def package_of(model) -> str | None:
    """``"lightning.pytorch"`` or ``"pytorch_lightning"``: the package whose LightningModule
    ``model`` is; None when it is none (found from the class hierarchy, importing nothing)."""
    for cls in type(model).__mro__:
        if cls.__name__ == "LightningModule":
            root = cls.__module__.split(".")[0]
            if root == "lightning":
                return "lightning.pytorch"
            if root == "pytorch_lightning":
                return "pytorch_lightning"
    return None


def _reduce_op(hvd, reduce_op):
    """Lightning's reduce_op (None, a string or torch.distributed.ReduceOp) as spark_hvd's op."""
    name = "mean" if reduce_op is None else str(getattr(reduce_op, "name", reduce_op)).lower()
    name = name.rsplit(".", 1)[-1]
    ops = {"mean": hvd.Average, "avg": hvd.Average, "average": hvd.Average, "sum": hvd.Sum,
           "max": hvd.Max, "min": hvd.Min, "product": hvd.Product, "prod": hvd.Product}
    if name not in ops:
        raise ValueError(f"spark_hvd strategy: unsupported reduce_op {reduce_op!r} (one of "
                         f"{sorted(ops)})")
    return ops[name]


def _rank_zero_only_objects(pl):
    """Every ``rank_zero_only`` Lightning consults (one per package layer)."""
    objects = []
    for module in (f"{pl.__name__}.utilities.rank_zero", "lightning_utilities.core.rank_zero",
                   "lightning.fabric.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"):
        try:
            objects.append(importlib.import_module(module).rank_zero_only)
        except ImportError:
            pass
    return objects


def set_rank_zero(pl, rank: int) -> None:
    """Makes Lightning's rank-zero-only logging and loggers run on rank 0 alone."""
    for obj in _rank_zero_only_objects(pl):
        obj.rank = rank


def strategy_class(package: str = "lightning.pytorch"):
    """The strategy class for ``package``'s Trainer (built once per package)."""
    cls = _classes.get(package)
    if cls is None:
        cls = _classes[package] = _build(import_lightning(package))
    return cls


def _build(pl):
    import torch

    fabric_name = "lightning.fabric" if pl.__name__.startswith("lightning.") else \
        "lightning_fabric"
    environments = importlib.import_module(f"{fabric_name}.plugins.environments")
    strategies = importlib.import_module(f"{pl.__name__}.strategies")

    def hvd():
        import spark_hvd.torch
        return spark_hvd.torch

    class SparkHvdEnvironment(environments.ClusterEnvironment):
        """The ranks of a spark_hvd job (started by ``spark-hvd-run`` or ``spark.run``, never
        by Lightning)."""

        @property
        def creates_processes_externally(self) -> bool:
            """Always True, since the launcher or Spark started the ranks, not Lightning."""
            return True

        @property
        def main_address(self) -> str:
            """Not used, since spark_hvd connects the ranks itself."""
            return "127.0.0.1"

        @property
        def main_port(self) -> int:
            """Not used (0), since spark_hvd connects the ranks itself."""
            return 0

        @staticmethod
        def detect() -> bool:
            """True in a process whose spark_hvd job is initialized."""
            return hvd().is_initialized()

        def world_size(self) -> int:
            """``hvd.size()``."""
            return hvd().size()

        def set_world_size(self, size: int) -> None:
            """Ignored: the launcher fixes the size."""

        def global_rank(self) -> int:
            """``hvd.rank()``."""
            return hvd().rank()

        def set_global_rank(self, rank: int) -> None:
            """Ignored: the launcher fixes the ranks."""

        def local_rank(self) -> int:
            """``hvd.local_rank()``."""
            return hvd().local_rank()

        def node_rank(self) -> int:
            """``hvd.cross_rank()``: the host's index."""
            return hvd().cross_rank()

    class SparkHvdStrategy(strategies.ParallelStrategy):
        """Data-parallel training over spark_hvd ranks, one process per device.

        Use it in a script started by ``spark-hvd-run`` or ``spark_hvd.spark.run`` (or let
        ``LightningEstimator`` use it)::

            trainer = Trainer(strategy=SparkHvdStrategy(), accelerator="cpu", devices=1)

        Args:
            compression: gradient compression (``spark_hvd.torch.Compression.fp16``).
            scale_learning_rate: multiply every optimizer's learning rate (and its LR
                schedulers' base rates) by the number of ranks, as Lightning 1.x's
                HorovodStrategy always did (off by default, as in spark_hvd's estimators).
            **kwargs: ``ParallelStrategy``'s (accelerator, parallel_devices,
                checkpoint_io, precision_plugin).
        """

        strategy_name = "spark_hvd"

        def __init__(self, compression=None, scale_learning_rate: bool = False, **kwargs):
            kwargs.setdefault("cluster_environment", SparkHvdEnvironment())
            super().__init__(**kwargs)
            self.compression = compression
            self.scale_learning_rate = scale_learning_rate

        @property
        def root_device(self) -> torch.device:
            """This rank's device (one per process: the one Lightning gives the strategy),
            else the CPU."""
            return self.parallel_devices[0] if self.parallel_devices else torch.device("cpu")

        @property
        def is_distributed(self) -> bool:
            """True, so Lightning gives the data loaders DistributedSamplers."""
            return True

        @property
        def distributed_sampler_kwargs(self) -> dict:
            """The samplers' ``num_replicas`` and ``rank``: spark_hvd's size and rank."""
            return {"num_replicas": self.world_size, "rank": self.global_rank}

        def setup_environment(self) -> None:
            """Initializes spark_hvd when the script has not, and tells Lightning's
            ``rank_zero_only`` this rank."""
            if not hvd().is_initialized():
                hvd().init()
            set_rank_zero(pl, self.global_rank)
            super().setup_environment()

        def model_to_device(self) -> None:
            """Moves the module to :attr:`root_device` (making a GPU the current one)."""
            if self.root_device.type == "cuda":
                torch.cuda.set_device(self.root_device)
            self.model.to(self.root_device)

        def setup(self, trainer) -> None:
            """For training: scales the learning rates when asked, broadcasts rank 0's weights
            and optimizer states, and wraps each optimizer in ``DistributedOptimizer``."""
            super().setup(trainer)
            if not trainer.training:
                return
            optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
            if self.scale_learning_rate:
                for optimizer in optimizers:
                    for group in optimizer.param_groups:
                        group["lr"] *= self.world_size
                for config in self.lr_scheduler_configs:
                    config.scheduler.base_lrs = [lr * self.world_size
                                                 for lr in config.scheduler.base_lrs]
            # Every rank starts from rank 0's weights and optimizer state.
            hvd().broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
            for optimizer in optimizers:
                hvd().broadcast_optimizer_state(optimizer, root_rank=0)
            self.optimizers = [self._distributed(o, trainer.accumulate_grad_batches)
                               for o in optimizers]

        def _distributed(self, optimizer, accumulate_grad_batches):
            # Hooks start each gradient's allreduce on the last of the accumulated backward
            # passes (Lightning scales the loss by 1/accumulate itself).
            if hasattr(optimizer, "skip_synchronize"):   # wrapped by the user already
                return optimizer
            in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
            named = [(n, p) for n, p in self.lightning_module.named_parameters()
                     if id(p) in in_optimizer]
            return hvd().DistributedOptimizer(
                optimizer, named_parameters=named,
                compression=self.compression or hvd().Compression.none,
                backward_passes_per_step=accumulate_grad_batches)

        def optimizer_step(self, optimizer, closure, model=None, **kwargs):
            """Runs the step with the averaged gradients: Lightning's
            ``on_before_optimizer_step`` and gradient clipping see them."""
            inner = getattr(optimizer, "_optimizer", optimizer)
            if not hasattr(inner, "skip_synchronize"):
                return super().optimizer_step(optimizer, closure, model, **kwargs)

            def closure_then_average():
                # The precision plugin runs on_before_optimizer_step and gradient clipping
                # after this returns: they must see the averaged gradients.
                result = closure()
                inner.synchronize()
                return result

            with inner.skip_synchronize():
                return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

        def load_optimizer_state_dict(self, checkpoint) -> None:
            """Loads the optimizers' states from ``checkpoint``, also into the optimizers
            the ``DistributedOptimizer`` wrappers wrap (which LR schedulers hold)."""
            super().load_optimizer_state_dict(checkpoint)
            # Loading gives the wrapper new state and param_groups; the optimizer it wraps
            # (which LR schedulers hold) must keep sharing them, or schedules stop applying.
            for optimizer in self.optimizers:
                original = getattr(optimizer, "_hvd_original", lambda: None)()
                if original is not None:
                    original.__dict__.update(state=optimizer.state,
                                             param_groups=optimizer.param_groups)

        def reduce(self, tensor, group=None, reduce_op="mean"):
            """Allreduces ``tensor`` over every rank (``self.log(..., sync_dist=True)``):
            ``reduce_op`` mean, sum, max, min or product; other values pass through."""
            if group is not None:
                raise ValueError("spark_hvd strategy: reduce over a process group is not "
                                 "supported; leave group unset")
            if not isinstance(tensor, torch.Tensor):
                return tensor
            return hvd().allreduce(tensor, op=_reduce_op(hvd(), reduce_op))

        def all_gather(self, tensor, group=None, sync_grads=False):
            """Every rank's ``tensor`` stacked on a new first dimension (Lightning's
            contract); the shapes must agree."""
            if group is not None:
                raise ValueError("spark_hvd strategy: all_gather over a process group is not "
                                 "supported; leave group unset")
            if not sync_grads:
                tensor = tensor.detach()
            return hvd().allgather(tensor.unsqueeze(0))

        def broadcast(self, obj, src: int = 0):
            """Rank ``src``'s ``obj`` on every rank (``broadcast_object``)."""
            return hvd().broadcast_object(obj, root_rank=src)

        def barrier(self, name=None, *args, **kwargs) -> None:
            """``hvd.barrier()`` when there is more than one rank."""
            if hvd().is_initialized() and hvd().size() > 1:
                hvd().barrier()

        def teardown(self) -> None:
            """Lightning's teardown, then frees the CUDA cache on a GPU."""
            super().teardown()
            if self.root_device.type == "cuda":
                torch.cuda.empty_cache()

    SparkHvdStrategy.__module__ = SparkHvdEnvironment.__module__ = __name__
    SparkHvdStrategy.__qualname__ = "SparkHvdStrategy"
    SparkHvdEnvironment.__qualname__ = "SparkHvdEnvironment"
    SparkHvdStrategy.Environment = SparkHvdEnvironment
    return SparkHvdStrategy
