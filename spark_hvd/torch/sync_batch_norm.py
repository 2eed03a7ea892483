"""Batch normalization with statistics computed over the whole global batch.

Each rank computes per-channel count, mean and sum of squared deviations of its local batch;
one allgather combines them exactly (Chan et al.'s parallel variance, no E[x^2] - E[x]^2
cancellation). Backward allreduces the per-channel sums of ``dy`` and ``dy * (x - mean)``.
Weight and bias gradients stay local, as for every other parameter: DistributedOptimizer
averages them. Works on CPU tensors (and on CUDA tensors through host staging).
"""

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..common._ops import Sum
from ..common.process_sets import global_process_set
from .collectives import allgather_async, allreduce_async, synchronize


def _compute_dtype(x):
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


class _SyncBatchNormFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, process_set):
        c = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        shape = [1, c] + [1] * (input.dim() - 2)
        x = input.to(_compute_dtype(input))
        count = input.numel() // c if c else 0
        if count:
            local_mean = x.mean(dims)
            local_m2 = x.var(dims, unbiased=False) * count
        else:
            local_mean = x.new_zeros(c)
            local_m2 = x.new_zeros(c)
        stats = torch.cat([x.new_tensor([float(count)]), local_mean, local_m2]).unsqueeze(0)
        stats = synchronize(allgather_async(stats, process_set=process_set))
        counts, means, m2s = stats[:, :1], stats[:, 1:c + 1], stats[:, c + 1:]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input "
                             f"size {list(input.shape)} on every rank together")
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        invstd = torch.rsqrt(m2 / total + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = (m2 / (total - 1)).to(running_var.dtype)
            running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        out = (x - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            out = out * weight.to(x.dtype).view(shape)
        if bias is not None:
            out = out + bias.to(x.dtype).view(shape)
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.total = total
        ctx.process_set = process_set
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        c = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        shape = [1, c] + [1] * (input.dim() - 2)
        x = input.to(_compute_dtype(input))
        dy = grad_output.to(x.dtype)
        xmu = x - mean.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else input.dtype)
        if ctx.needs_input_grad[0]:
            sums = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_xmu]), op=Sum,
                                               process_set=ctx.process_set))
            mean_dy = sums[:c] / ctx.total
            mean_dy_xmu = sums[c:] / ctx.total
            scale = invstd if weight is None else invstd * weight.to(x.dtype)
            correction = xmu * (invstd ** 2 * mean_dy_xmu).view(shape)
            grad_input = (dy - mean_dy.view(shape) - correction) * scale.view(shape)
            grad_input = grad_input.to(input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the global batch of every rank in ``process_set``.

    A drop-in replacement for ``torch.nn.BatchNorm1d/2d/3d`` (any input of shape
    ``(N, C, ...)``): in training, mean and variance are those of all ranks' batches together,
    so small per-rank batches normalize as one large batch would; running statistics are
    updated from the global statistics (identical on every rank). In eval mode with running
    statistics it is a plain local batch norm.

    Args:
        num_features: ``C`` of the input ``(N, C, ...)``.
        eps, momentum, affine, track_running_stats: as in ``torch.nn.BatchNorm2d``.
        process_set: the ranks whose batches are normalized together.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=global_process_set, device=None,
                 dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _momentum(self):
        if self.momentum is None:  # cumulative moving average
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def forward(self, input):
        """Normalizes ``input`` with the global batch statistics (training) or the running
        statistics (eval)."""
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        momentum = self._momentum() if self.training and self.track_running_stats else 0.0
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        if self.process_set.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, True, momentum, self.eps)
        running = self.training and self.track_running_stats
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias,
                                            self.running_mean if running else None,
                                            self.running_var if running else None,
                                            self.eps, momentum, self.process_set)

    @classmethod
    def convert_sync_batchnorm(cls, module, process_set=global_process_set):
        """Returns ``module`` with every ``torch.nn.BatchNorm*`` layer replaced by a
        :class:`SyncBatchNorm` carrying the same parameters and running statistics."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_set=process_set)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return out
