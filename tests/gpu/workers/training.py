"""Training on CUDA: broadcast_parameters, broadcast_optimizer_state, DistributedOptimizer
and SyncBatchNorm, each against what one process computes on the whole batch.

Usage: training.py --expect single|nccl|host

1. Every rank builds its model and SGD (momentum) optimizer from its own seed and takes two
   local steps, so parameters, momentum buffers and lr differ; after broadcast_parameters and
   broadcast_optimizer_state from rank 0 they are equal on every rank (bit for bit), on CUDA.
2. DistributedOptimizer, 5 steps, each rank on its own batch (same batch size): parameters
   equal on every rank (bit for bit) and equal to one process training the same model with
   the same optimizer state on the concatenated batch (within float32 rounding).
3. SyncBatchNorm (ragged per-rank batches): output and input gradient equal to
   torch.nn.BatchNorm2d's over the concatenated batch; weight/bias gradients summed over the
   ranks equal BatchNorm2d's; running statistics equal.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import spark_hvd.torch as hvd
from _data import gen, put
from _gpu import C, main

RTOL, ATOL = 1e-4, 1e-5
BATCH = 8
STEPS = 5


def net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


def batch(tag, r, device):
    g = gen(tag, r)
    x = torch.randn(BATCH, 3, 8, 8, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    return x.to(device), y.to(device)


def flat(tensors):
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def equal_on_every_rank(t, what, device):
    """``t`` (a CUDA tensor) is the same bit for bit on every rank (allgathered, rows
    compared), and lives on ``device``."""
    C.on_device(t, device, what)
    rows = hvd.allgather(t.detach().reshape(1, -1), name=f"eq.{what}")
    for r in range(1, rows.shape[0]):
        if not torch.equal(rows[r], rows[0]):
            diff = (rows[r].double() - rows[0].double()).abs().max().item()
            C.fail(what, f"rank {r} differs from rank 0 (max abs diff {diff!r})")
    C.ok(f"{what}: equal on all {rows.shape[0]} ranks")


def optimizer_part(device, rank, size):
    torch.manual_seed(100 + rank)
    model = net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * (rank + 1), momentum=0.9)
    for s in range(2):  # local steps: momentum buffers now differ between ranks
        x, y = batch(f"local.{s}", rank, device)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    equal_on_every_rank(flat(model.parameters()), "parameters after broadcast_parameters",
                        device)
    bufs = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    for b in bufs:
        C.on_device(b, device, "momentum buffer after broadcast_optimizer_state")
    equal_on_every_rank(flat(bufs), "momentum buffers after broadcast_optimizer_state", device)
    C.check(opt.param_groups[0]["lr"] == 0.01, "lr after broadcast_optimizer_state is rank 0's",
            f"lr {opt.param_groups[0]['lr']}")

    # The reference: one process, the same start, the concatenated batch.
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.01, momentum=0.9)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    for s in range(STEPS):
        x, y = batch(f"train.{s}", rank, device)
        dopt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        dopt.step()
        xs, ys = zip(*(batch(f"train.{s}", r, device) for r in range(size)))
        ref_opt.zero_grad()
        F.cross_entropy(ref_model(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
        C.check(torch.isfinite(loss).item(), f"step {s}: loss {loss.item():.4f} is finite")
    params = flat(model.parameters())
    equal_on_every_rank(params, f"parameters after {STEPS} DistributedOptimizer steps", device)
    for p in model.parameters():
        C.on_device(p.grad, device, "gradient of a CUDA parameter")
    C.same(params, flat(ref_model.parameters()),
           f"DistributedOptimizer x{size} == one process on the concatenated batch",
           rtol=RTOL, atol=ATOL)


def sync_batch_norm_part(device, rank, size):
    channels = 4
    sizes = [3 + r for r in range(size)]  # ragged per-rank batches
    xs = [torch.randn(n, channels, 5, 5, generator=gen("sbn.x", r)) for r, n in
          enumerate(sizes)]
    ws = [torch.randn(n, channels, 5, 5, generator=gen("sbn.w", r)) for r, n in
          enumerate(sizes)]
    weight = torch.rand(channels, generator=gen("sbn.weight", 0)) + 0.5
    bias = torch.randn(channels, generator=gen("sbn.bias", 0))

    sbn = hvd.SyncBatchNorm(channels).to(device)
    ref = nn.BatchNorm2d(channels).to(device)
    with torch.no_grad():
        for m in (sbn, ref):
            m.weight.copy_(weight)
            m.bias.copy_(bias)
    sbn.train()
    ref.train()
    x = put(xs[rank], device).requires_grad_()
    out = sbn(x)
    (out * put(ws[rank], device)).sum().backward()

    x_all = put(torch.cat(xs), device).requires_grad_()
    out_all = ref(x_all)
    (out_all * put(torch.cat(ws), device)).sum().backward()

    lo = sum(sizes[:rank])
    mine = slice(lo, lo + sizes[rank])
    C.same(out, out_all[mine].detach(), f"SyncBatchNorm x{size} forward == BatchNorm2d on the "
           "whole batch", device=device, rtol=RTOL, atol=ATOL)
    C.same(x.grad, x_all.grad[mine], "SyncBatchNorm input gradient", device=device,
           rtol=RTOL, atol=ATOL)
    for name in ("weight", "bias"):
        g = getattr(sbn, name).grad
        C.on_device(g, device, f"SyncBatchNorm {name} gradient")
        total = hvd.allreduce(g, op=hvd.Sum, name=f"sbn.{name}.grad")
        C.same(total, getattr(ref, name).grad, f"SyncBatchNorm {name} gradient summed over "
               "ranks", device=device, rtol=RTOL, atol=ATOL)
    for name in ("running_mean", "running_var"):
        C.same(getattr(sbn, name), getattr(ref, name), f"SyncBatchNorm {name}", device=device,
               rtol=RTOL, atol=ATOL)


def body(args, device):
    rank, size = hvd.rank(), hvd.size()
    optimizer_part(device, rank, size)
    sync_batch_norm_part(device, rank, size)


if __name__ == "__main__":
    main(body)
