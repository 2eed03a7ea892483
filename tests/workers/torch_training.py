"""spark_hvd.torch training APIs: DistributedOptimizer (every option and error), broadcast of
parameters / optimizer state / objects, SyncBatchNorm against a single-process reference,
model parallelism through differentiable collectives, process-set optimizers, the timeline.

Usage: torch_training.py TMPDIR

Every rank can rebuild every rank's data, so it computes the single-process reference (e.g.
the average of all ranks' gradients) itself.
"""

import copy
import hashlib
import json
import os
import sys
import warnings

import torch

import spark_hvd.torch as hvd
from _wutil import Checks, ref_adasum, seed_of


def data(rank, shape, tag):
    g = torch.Generator().manual_seed(seed_of(tag, rank, tuple(shape)) % (2 ** 31))
    return torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 5)
        self.fc2 = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def mlp():
    torch.manual_seed(0)
    return MLP().double()


def loss_of(model, rank, tag="d"):
    x, t = data(rank, (4, 6), tag + "x"), data(rank, (4, 3), tag + "t")
    return ((model(x) - t) ** 2).mean()


def grads_of(model, rank, tag="d"):
    m = copy.deepcopy(model)
    m.zero_grad()
    loss_of(m, rank, tag).backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def digest(obj):
    """Digest of nested tensors / scalars (bitwise)."""
    h = hashlib.sha256()

    def walk(x):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu()
            if t.dtype == torch.bfloat16:
                t = t.view(torch.int16)
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.contiguous().numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"{type(x).__name__}{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"{type(x).__name__}:{x!r}".encode())
    walk(obj)
    return h.hexdigest()


def same_everywhere(c, what, obj, process_set=hvd.global_process_set):
    ds = hvd.allgather_object(digest(obj), process_set=process_set)
    c.check(len(set(ds)) == 1, f"{what}: differs between ranks ({ds})")


def close(a, b, tol=1e-12):
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)


# -- DistributedOptimizer ---------------------------------------------------------------------

def optimizer_math(c, n, rank):
    """The averaged gradient equals the mean of every rank's gradient, for every option."""
    everyone = range(n)

    def run(tag, kw, expect, tol=1e-12, passes=("d",), set_passes=None):
        model = mlp()
        refs = {r: {} for r in everyone}
        for r in everyone:
            for p_tag in passes:
                for k, g in grads_of(model, r, p_tag).items():
                    refs[r][k] = refs[r].get(k, 0) + g
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), **kw)
        if set_passes is not None:
            opt.set_backward_passes_per_step(set_passes)
        for p_tag in passes:
            loss_of(model, rank, p_tag).backward()
        opt.synchronize()
        for name, p in model.named_parameters():
            want = expect([refs[r][name] for r in everyone])
            c.check(p.grad is not None and close(p.grad, want, tol),
                    f"{tag}: grad of {name} off by "
                    f"{(p.grad - want).abs().max().item() if p.grad is not None else 'None'}")
        with opt.skip_synchronize():
            opt.step()
        same_everywhere(c, f"{tag}: weights after step", dict(model.state_dict()))
        opt.zero_grad()

    mean = lambda gs: sum(gs) / n  # noqa: E731
    run("average", {}, mean)
    run("sum", {"op": hvd.Sum}, lambda gs: sum(gs))
    run("predivide", {"gradient_predivide_factor": 2.0}, mean)
    run("fp16", {"compression": hvd.Compression.fp16},
        lambda gs: sum(g.half().double() for g in gs) / n, tol=2e-3)
    run("groups=2", {"groups": 2}, mean)
    model_tmp = mlp()
    run("groups=list", {"groups": [[model_tmp.fc1.weight]]}, mean)  # foreign params: ignored
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        run("num_groups", {"num_groups": 3}, mean)
    run("backward_passes_per_step", {"backward_passes_per_step": 2}, mean, passes=("d", "e"))
    run("set_backward_passes_per_step", {}, mean, passes=("d", "e", "f"), set_passes=3)


def adasum_optimizer(c, n, rank):
    """op=Adasum (Horovod's delta optimizer): each rank takes its optimizer's step on its own
    gradient during backward, and step() sets the weights to where they started plus the
    Adasum of every rank's step. Checked against a simulation of every rank's optimizer over
    three steps (momentum: the ranks' local states diverge while the weights stay equal). A
    parameter without gradients is not moved (weight decay would move it if it were
    stepped); a closure that fails after backward leaves the weights where they were."""
    if n & (n - 1):
        return  # refused: see optimizer_behaviour
    import numpy as np
    model = mlp()
    sims = [copy.deepcopy(model) for _ in range(n)]
    sgd = dict(lr=0.1, momentum=0.9, weight_decay=0.1)
    sim_opts = [torch.optim.SGD(m.parameters(), **sgd) for m in sims]
    unused = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([{"params": model.parameters()}, {"params": [unused]}], **sgd),
        named_parameters=[*model.named_parameters(), ("unused", unused)], op=hvd.Adasum)
    c.raises("Adasum skip_synchronize", AssertionError, opt.skip_synchronize().__enter__,
             match="Adasum")
    for step in range(3):
        start = {k: v.clone() for k, v in model.state_dict().items()}
        deltas = []
        for r, (m, o) in enumerate(zip(sims, sim_opts)):
            m.load_state_dict(start)
            o.zero_grad()
            loss_of(m, r, f"s{step}").backward()
            o.step()
            deltas.append({k: (v - start[k]).numpy() for k, v in m.state_dict().items()})
        want = {k: start[k].numpy() + ref_adasum([d[k] for d in deltas]) for k in start}
        opt.zero_grad()
        loss_of(model, rank, f"s{step}").backward()
        opt.synchronize()  # no-op with Adasum (Horovod): step() applies the combined updates
        opt.step()
        for k, v in model.state_dict().items():
            err = float(np.abs(v.numpy() - want[k]).max())
            c.check(err < 1e-12, f"Adasum step {step}: {k} off by {err}")
        same_everywhere(c, f"Adasum step {step}: weights", dict(model.state_dict()))
    c.check(torch.equal(unused.detach(), torch.ones(3, dtype=torch.float64)),
            f"Adasum moved a parameter without gradients: {unused}")
    opt.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def failing_closure():
        loss_of(model, rank, "s9").backward()  # the local updates start here
        raise RuntimeError("closure failed")
    c.raises("Adasum closure error", RuntimeError, opt.step, failing_closure, match="closure")
    c.check(all(torch.equal(v, before[k]) for k, v in model.state_dict().items()),
            "Adasum: a failed closure left the weights moved")
    opt.zero_grad()
    loss_of(model, rank, "s9").backward()
    c.run("Adasum step after a failed closure", opt.step)
    same_everywhere(c, "Adasum weights after a failed closure", dict(model.state_dict()))
    opt.zero_grad()


def optimizer_behaviour(c, n, rank):
    # explicit groups by parameter
    model = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   groups=[[model.fc1.weight, model.fc2.weight]])
    loss_of(model, rank).backward()
    opt.step()
    same_everywhere(c, "explicit groups", dict(model.state_dict()))
    # a subclass instance of the wrapped class; state loaded before wrapping is kept
    model = mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_of(model, 0).backward()
    base.step()
    base.zero_grad()
    buf = base.state[model.fc1.weight]["momentum_buffer"]
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    c.check(isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD",
            f"class {type(opt)}")
    c.check(opt.state[model.fc1.weight]["momentum_buffer"] is buf, "state kept after wrapping")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loss_of(model, rank).backward()
    opt.step()
    sched.step()
    c.check(abs(opt.param_groups[0]["lr"] - 0.05) < 1e-12, "lr scheduler")
    same_everywhere(c, "momentum training", dict(model.state_dict()))
    opt.zero_grad()
    c.raises("wrap twice", ValueError, hvd.DistributedOptimizer, opt, match="already")
    # gradient clipping: synchronize, clip, step inside skip_synchronize (no warning)
    loss_of(model, rank).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    c.check(norm <= 0.01 + 1e-9, f"clipped norm {norm}")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    c.check(not [x for x in w if "skip_synchronize" in str(x.message)], "warned inside skip")
    same_everywhere(c, "clipped step", dict(model.state_dict()))
    opt.zero_grad()
    # step() after an explicit synchronize() without skip_synchronize(): Horovod's warning
    loss_of(model, rank).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt.step()
    c.check(any("skip_synchronize" in str(x.message) for x in w), "no warning on double sync")
    opt.zero_grad()
    # zero_grad between backward and step is refused; the pending allreduces still complete
    loss_of(model, rank).backward()
    c.raises("zero_grad after backward", AssertionError, opt.zero_grad, match="zero_grad")
    opt.synchronize()
    opt.zero_grad()
    # more backward passes than backward_passes_per_step
    loss_of(model, rank).backward()
    c.raises("too many passes", AssertionError, lambda: loss_of(model, rank).backward(),
             match="backward_passes_per_step")
    opt.synchronize()
    opt.zero_grad()
    # argument errors (Horovod's messages)
    m = mlp()
    sgd = lambda: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    c.raises("named_parameters not tuples", ValueError, hvd.DistributedOptimizer, sgd(),
             named_parameters=list(m.parameters()), match="tuples")
    c.raises("duplicate names", ValueError, hvd.DistributedOptimizer, sgd(),
             named_parameters=[("a", p) for p in m.parameters()], match="duplicates: a")
    c.raises("unnamed parameter", ValueError, hvd.DistributedOptimizer, sgd(),
             named_parameters=list(m.named_parameters())[1:], match="not named")
    if n & (n - 1):
        c.raises("Adasum", NotImplementedError, hvd.DistributedOptimizer, sgd(), op=hvd.Adasum,
                 match="power-of-two")
    c.raises("predivide with Sum", ValueError, hvd.DistributedOptimizer, sgd(), op=hvd.Sum,
             gradient_predivide_factor=2.0, match="gradient_predivide_factor")
    c.raises("groups=-1", ValueError, hvd.DistributedOptimizer, sgd(), groups=-1,
             match="groups")
    c.raises("groups duplicate", ValueError, hvd.DistributedOptimizer, sgd(),
             groups=[[m.fc1.weight, m.fc1.weight]], match="only appear once")
    c.raises("groups not tensors", ValueError, hvd.DistributedOptimizer, sgd(),
             groups=[["x"]], match="tensors")
    c.raises("not an optimizer", ValueError, hvd.DistributedOptimizer, object(),
             match="torch.optim.Optimizer")
    # wrapping the same parameters again: the dropped optimizer's hooks go away with it
    model = mlp()
    for _ in range(2):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        for _ in range(2):
            loss_of(model, rank).backward()
            opt.step()
            opt.zero_grad()
    c.check(len(model.fc1.weight._post_accumulate_grad_hooks or {}) == 1, "stale hooks")
    same_everywhere(c, "re-wrapped optimizer", dict(model.state_dict()))


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.a = torch.nn.Linear(4, 2)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x, use_b):
        h = self.body(x)
        return self.a(h).sum() + (self.b(h).sum() if use_b else 0)


def scheduler_and_resume(c, n, rank):
    """An LR scheduler made on the optimizer before wrapping drives the wrapper's learning rate
    without torch's "scheduler.step() before optimizer.step()" warning, and a checkpoint of the
    wrapper (state_dict) resumes into a fresh one that then trains identically."""
    torch.manual_seed(3)
    model = mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        lrs = []
        for s in range(3):
            opt.zero_grad()
            loss_of(model, rank, f"sched{s}").backward()
            opt.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    order = [str(x.message) for x in w if "lr_scheduler.step()" in str(x.message)]
    c.check(not order, f"scheduler warned: {order}")
    c.check(lrs == [0.05, 0.025, 0.0125], f"learning rates {lrs}")
    checkpoint = {"model": copy.deepcopy(model.state_dict()),
                  "opt": copy.deepcopy(opt.state_dict())}
    resumed = mlp()
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=resumed.named_parameters())
    resumed.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["opt"])
    c.check(opt2.param_groups[0]["lr"] == 0.0125, "resumed learning rate")
    for m, o in ((model, opt), (resumed, opt2)):
        o.zero_grad()
        loss_of(m, rank, "after").backward()
        o.step()
    c.check(all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters())),
            "the resumed optimizer trains as the original")
    same_everywhere(c, "resumed weights", dict(resumed.state_dict()))


def unused_parameters(c, n, rank):
    """Rank 0 uses head b, the others never do: their zeros take part, nobody hangs."""
    torch.manual_seed(1)
    model = TwoHeads().double()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step in range(3):
        model(data(rank, (3, 4), f"u{step}"), rank == 0).backward()
        opt.step()
        opt.zero_grad()
        grads = {}
        for r in range(n):
            m = copy.deepcopy(ref)
            m(data(r, (3, 4), f"u{step}"), r == 0).backward()
            for k, p in m.named_parameters():
                grads[k] = grads.get(k, 0) + (p.grad if p.grad is not None else 0)
        with torch.no_grad():
            for k, p in ref.named_parameters():
                p -= 0.1 * grads[k] / n
    for (k, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        c.check(close(p.detach(), q.detach(), 1e-10), f"unused params: {k}")
    same_everywhere(c, "unused params", dict(model.state_dict()))


def dynamic_requires_grad(c, n, rank):
    """Horovod's GAN pattern: generator and discriminator trained in turns."""
    torch.manual_seed(2)
    gen = torch.nn.Conv2d(1, 10, 1)
    disc = torch.nn.Conv2d(10, 1, 1)
    inp = data(rank, (1, 1, 8, 8), "gan").float()
    gen_opt = hvd.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1),
                                       named_parameters=gen.named_parameters())
    disc_opt = hvd.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1),
                                        named_parameters=disc.named_parameters())

    def step(train_gen):
        for p in gen.parameters():
            p.requires_grad_(train_gen)
        for p in disc.parameters():
            p.requires_grad_(not train_gen)
        gen_opt.zero_grad()
        disc_opt.zero_grad()
        disc(gen(inp)).sum().backward()
        for p in gen.parameters():
            c.check(train_gen == (p.grad is not None and bool(p.grad.abs().max() > 0)),
                    "generator gradient presence")
        for p in disc.parameters():
            c.check((not train_gen) == (p.grad is not None and bool(p.grad.abs().max() > 0)),
                    "discriminator gradient presence")
        (gen_opt if train_gen else disc_opt).step()
    for _ in range(3):
        step(True)
        step(False)
    for p in list(gen.parameters()) + list(disc.parameters()):
        p.requires_grad_(True)
    same_everywhere(c, "GAN", [dict(gen.state_dict()), dict(disc.state_dict())])


def sparse_gradients(c, n, rank):
    for dense, op in ((False, hvd.Average), (True, hvd.Average), (False, hvd.Sum),
                      (True, hvd.Sum)):
        torch.manual_seed(3)
        emb = torch.nn.Embedding(10, 3, sparse=True).double()
        ref = copy.deepcopy(emb)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=dense, op=op)
        idx = lambda r: torch.tensor([r % 10, (3 * r + 1) % 10, 7])  # noqa: E731
        (emb(idx(rank)) * data(rank, (3, 3), "sp")).sum().backward()
        opt.synchronize()
        want = torch.zeros(10, 3, dtype=torch.float64)
        for r in range(n):
            m = copy.deepcopy(ref)
            (m(idx(r)) * data(r, (3, 3), "sp")).sum().backward()
            want += m.weight.grad.to_dense()
        if op == hvd.Average:
            want /= n
        g = emb.weight.grad
        c.check(g.is_sparse and close(g.to_dense(), want),
                f"sparse grads (sparse_as_dense={dense}, op={op})")
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
        same_everywhere(c, f"sparse training {dense} {op}", dict(emb.state_dict()))
        # a rank without gradient in a step: an empty sparse gradient takes part
        if rank == 0:
            (emb(idx(0)) * 1.0).sum().backward()
        opt.step()
        opt.zero_grad()
        same_everywhere(c, f"sparse, rank 0 only {dense} {op}", dict(emb.state_dict()))
    # sparse_allreduce_async directly
    t = torch.sparse_coo_tensor(torch.tensor([[rank % 4]]), torch.tensor([float(rank + 1)]),
                                (4,), check_invariants=True)
    got = hvd.synchronize(hvd.sparse_allreduce_async(t, name="sparse.direct", op=hvd.Sum))
    want = torch.zeros(4)
    for r in range(n):
        want[r % 4] += r + 1
    c.check(got.is_sparse and torch.equal(got.to_dense(), want), f"sparse_allreduce {got}")


def process_set_optimizers(c, n, rank, sets):
    """Each process set averages among its own members only."""
    mine = next(ps for ps in sets if ps.included())
    model = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=mine)
    loss_of(model, rank).backward()
    opt.synchronize()
    refs = [grads_of(mlp(), r) for r in mine.ranks]
    for k, p in model.named_parameters():
        c.check(close(p.grad, sum(g[k] for g in refs) / len(refs)), f"process set grad {k}")
    with opt.skip_synchronize():
        opt.step()
    same_everywhere(c, "process-set training", dict(model.state_dict()), process_set=mine)


def process_set_functions(c, n, rank, sets):
    """broadcast_parameters, broadcast_optimizer_state, broadcast_object, allgather_object,
    barrier and SyncBatchNorm within a process set: roots are global ranks (Horovod's rule), and
    only the set's members take part (the other set runs the same calls at the same time)."""
    mine = next(ps for ps in sets if ps.included())
    members, me = mine.ranks, mine.rank()
    root = len(members) - 1  # the set's last member
    torch.manual_seed(10 + rank)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    loss_of(model, rank).backward()
    opt.step()
    before = hvd.allgather_object(digest(dict(model.state_dict())), process_set=mine)
    hvd.broadcast_parameters(model.state_dict(), root_rank=members[root], process_set=mine)
    hvd.broadcast_optimizer_state(opt, root_rank=members[root], process_set=mine)
    c.check(digest(dict(model.state_dict())) == before[root],
            "broadcast_parameters took the set root's weights")
    c.check(opt.param_groups[0]["lr"] == 0.01 * (members[root] + 1), "set root's lr")
    same_everywhere(c, "process-set optimizer state", opt.state_dict(), process_set=mine)
    got = hvd.broadcast_object({"from": rank}, root_rank=members[root], process_set=mine)
    c.check(got == {"from": members[root]}, f"broadcast_object in the set: {got}")
    got = hvd.allgather_object(rank, process_set=mine)
    c.check(got == members, f"allgather_object in the set: {got} != {members}")
    hvd.barrier(process_set=mine)
    # SyncBatchNorm over the set's batches only
    xs = {r: data(r, (2 + r, 3), "psbn") for r in range(n)}
    bn = hvd.SyncBatchNorm(3, process_set=mine).double()
    ref = torch.nn.BatchNorm1d(3).double()
    y = bn(xs[rank])
    yr = ref(torch.cat([xs[r] for r in members]))
    start = sum(2 + r for r in members[:me])
    c.check(close(y, yr[start:start + 2 + rank], 1e-10), "SyncBatchNorm within the set")
    c.check(close(bn.running_mean, ref.running_mean, 1e-10), "SyncBatchNorm set running mean")


# -- broadcasts -------------------------------------------------------------------------------

def broadcasts(c, n, rank):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 3, 3)
            self.bn = torch.nn.BatchNorm2d(3)
            self.fc = torch.nn.Linear(3, 2)

    for root in (0, n - 1):
        torch.manual_seed(100 + rank)  # different weights everywhere
        net = Net()
        net.bn.num_batches_tracked += rank
        want = hvd.broadcast_object(dict(net.state_dict()), root_rank=root)
        hvd.broadcast_parameters(net.state_dict(), root_rank=root)
        c.check(digest(dict(net.state_dict())) == digest(want), f"state_dict from {root}")
        torch.manual_seed(200 + rank)
        net = Net()
        hvd.broadcast_parameters(net.named_parameters(), root_rank=root)
        same_everywhere(c, f"named_parameters from {root}", list(net.parameters()))
        torch.manual_seed(300 + rank)
        net = Net()
        hvd.broadcast_parameters(list(net.parameters()), root_rank=root)
        same_everywhere(c, f"parameter list from {root}", list(net.parameters()))
    c.raises("bad params type", ValueError, hvd.broadcast_parameters, 3, 0, match="invalid")
    # A fresh optimizer's state broadcast leaves zero gradients on the trainable parameters
    # (as Horovod's dummy step does) and none on frozen ones; the weights are untouched.
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    trained = torch.nn.Parameter(torch.full((3,), float(rank)))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([frozen, trained], lr=0.1, momentum=0.9))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    c.check(frozen.grad is None, f"frozen parameter got a gradient: {frozen.grad}")
    c.check(trained.grad is not None and torch.equal(trained.grad, torch.zeros(3)),
            f"trainable parameter's gradient after the state broadcast: {trained.grad}")
    c.check(torch.equal(trained.detach(), torch.full((3,), float(rank))), "weights touched")
    # objects
    obj = hvd.broadcast_object({"rank": rank, "t": torch.ones(2) * rank}, root_rank=n - 1)
    c.check(obj["rank"] == n - 1 and torch.equal(obj["t"], torch.ones(2) * (n - 1)),
            f"broadcast_object {obj}")
    got = hvd.allgather_object(("r", rank))
    c.check(got == [("r", r) for r in range(n)], f"allgather_object {got}")

    # Closures and classes defined here travel too (cloudpickle, as in Horovod).
    class Local:
        def __init__(self, v):
            self.v = v
    offset = 10 * rank
    fn = hvd.broadcast_object(lambda x: x + offset, root_rank=n - 1)
    c.check(fn(1) == 10 * (n - 1) + 1, "broadcast_object of a closure")
    got = hvd.allgather_object(Local(rank))
    c.check([o.v for o in got] == list(range(n)), "allgather_object of a local class")


OPTIMIZERS = [
    ("SGD", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)),
    ("Adam", lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99), amsgrad=True)),
    ("AdamW", lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)),
    ("RMSprop", lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True)),
    ("Adagrad", lambda ps: torch.optim.Adagrad(ps, lr=0.01, lr_decay=0.01)),
    ("Adadelta", lambda ps: torch.optim.Adadelta(ps)),
    ("LBFGS", lambda ps: torch.optim.LBFGS(ps, lr=0.1, history_size=3)),
    ("Adamax", lambda ps: torch.optim.Adamax(ps, lr=0.01)),
    ("NAdam", lambda ps: torch.optim.NAdam(ps, lr=0.01, momentum_decay=0.005)),
    ("RAdam", lambda ps: torch.optim.RAdam(ps, lr=0.01, decoupled_weight_decay=True,
                                           weight_decay=0.01)),
    ("ASGD", lambda ps: torch.optim.ASGD(ps, lr=0.01, t0=1)),
    ("Rprop", lambda ps: torch.optim.Rprop(ps, lr=0.01, etas=(0.4, 1.3))),
]


def optimizer_state(c, n, rank):
    for name, make in OPTIMIZERS:
        # "others only": state the root lacks is dropped on the other ranks
        for scenario in ("root only", "everyone", "nobody", "others only"):
            tag = f"{name}/{scenario}"
            model = mlp()
            opt = make(model.parameters())
            opt.param_groups[0]["lr"] = 0.01 * (rank + 1)  # options differ too
            lr_type = type(opt.param_groups[0]["lr"])
            steps = {"root only": 2 if rank == 0 else 0, "everyone": rank + 1, "nobody": 0,
                     "others only": 0 if rank == 0 else 1}
            for s in range(steps[scenario]):
                def closure(s=s):
                    opt.zero_grad()
                    loss = loss_of(model, rank, f"os{s}")
                    loss.backward()
                    return loss
                opt.step(closure)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            same_everywhere(c, f"{tag}: optimizer state", opt.state_dict())
            c.check(type(opt.param_groups[0]["lr"]) is lr_type, f"{tag}: lr type")
            c.check(abs(opt.param_groups[0]["lr"] - 0.01) < 1e-15, f"{tag}: lr from root")
            # training continues identically everywhere
            def closure():
                opt.zero_grad()
                loss = loss_of(model, 0, "same")
                loss.backward()
                return loss
            opt.step(closure)
            same_everywhere(c, f"{tag}: training after broadcast",
                            [dict(model.state_dict()), opt.state_dict()])
    # a DistributedOptimizer's state too (including Adam's betas tuple)
    model = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1)),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    c.check(isinstance(opt.param_groups[0]["betas"], tuple), "betas stays a tuple")
    loss_of(model, rank).backward()
    opt.step()
    same_everywhere(c, "DistributedOptimizer state", [dict(model.state_dict()),
                                                      opt.state_dict()])


# -- SyncBatchNorm ----------------------------------------------------------------------------

def sync_batch_norm(c, n, rank):
    cases = [((3, 4), {}), ((2, 4, 5), {}), ((2, 4, 3, 3), {}),
             ((2, 4, 3, 3), {"momentum": None}), ((3, 4, 2), {"affine": False}),
             ((2, 4, 3), {"track_running_stats": False})]
    for shape, kw in cases:
        tag = f"syncbn {shape} {kw}"
        rows = lambda r: shape[0] + r  # noqa: E731 - uneven per-rank batches
        xs = [data(r, (rows(r),) + shape[1:], tag) for r in range(n)]
        ws = [data(r, (rows(r),) + shape[1:], tag + "w") for r in range(n)]
        torch.manual_seed(4)
        bn = hvd.SyncBatchNorm(shape[1], **kw).double()
        if bn.affine:
            with torch.no_grad():
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.5, 0.5)
        ref_cls = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d}
        ref = ref_cls[len(shape)](shape[1], **kw).double()
        ref.load_state_dict(bn.state_dict())
        for it in range(2):
            x = xs[rank].clone().requires_grad_()
            y = bn(x)
            (ws[rank] * y).sum().backward()
            xr = torch.cat(xs).clone().requires_grad_()
            yr = ref(xr)
            (torch.cat(ws) * yr).sum().backward()
            start = sum(rows(r) for r in range(rank))
            c.check(close(y, yr[start:start + rows(rank)], 1e-10), f"{tag}: output {it}")
            c.check(close(x.grad, xr.grad[start:start + rows(rank)], 1e-9),
                    f"{tag}: input grad {it}")
            if bn.affine:
                gw = hvd.allreduce(bn.weight.grad, op=hvd.Sum)
                gb = hvd.allreduce(bn.bias.grad, op=hvd.Sum)
                c.check(close(gw, ref.weight.grad, 1e-9) and close(gb, ref.bias.grad, 1e-9),
                        f"{tag}: weight/bias grads {it}")
                bn.zero_grad()
                ref.zero_grad()
            if bn.track_running_stats:
                c.check(close(bn.running_mean, ref.running_mean, 1e-10) and
                        close(bn.running_var, ref.running_var, 1e-10) and
                        int(bn.num_batches_tracked) == int(ref.num_batches_tracked),
                        f"{tag}: running stats {it}")
        bn.eval()
        ref.eval()
        x = xs[rank]
        yr = ref(torch.cat(xs))
        start = sum(rows(r) for r in range(rank))
        c.check(close(bn(x), yr[start:start + rows(rank)], 1e-10), f"{tag}: eval")
    # float32 and conversion of a model's BatchNorm layers
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3))
    conv = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
    c.check(isinstance(conv[1], hvd.SyncBatchNorm), "convert_sync_batchnorm")
    out = conv(data(rank, (2, 2, 3, 3), "f32").float())
    c.check(out.dtype == torch.float32 and out.shape == (2, 3, 3, 3), "float32 SyncBatchNorm")
    c.raises("1-D input", ValueError, hvd.SyncBatchNorm(3), torch.ones(3), match="2D")


# -- model parallelism ------------------------------------------------------------------------

def model_parallel(c, n, rank):
    """A two-stage model across ranks: rank 0 holds stage 1, the last rank stage 2; the
    activation moves with a differentiable broadcast, the gradient comes back through it."""
    torch.manual_seed(5)
    stage1, stage2 = torch.nn.Linear(4, 3).double(), torch.nn.Linear(3, 1).double()
    ref1, ref2 = copy.deepcopy(stage1), copy.deepcopy(stage2)
    x, t = data(0, (5, 4), "mp"), data(0, (5, 1), "mpt")
    last = n - 1
    h = stage1(x) if rank == 0 else torch.zeros(5, 3, dtype=torch.float64, requires_grad=True)
    h = hvd.broadcast(h, root_rank=0, name="mp.act")
    loss = ((stage2(h) - t) ** 2).mean() if rank == last else h.sum() * 0
    loss.backward()
    ((ref2(ref1(x)) - t) ** 2).mean().backward()
    if rank == 0:
        # broadcast's gradient is averaged over the ranks (Horovod's rule)
        c.check(close(stage1.weight.grad * n, ref1.weight.grad, 1e-12), "stage 1 gradient")
    if rank == last:
        c.check(close(stage2.weight.grad, ref2.weight.grad, 1e-12), "stage 2 gradient")


def timeline(c, rank, tmp):
    path = os.path.join(tmp, "timeline.json")
    hvd.start_timeline(path, mark_cycles=True)
    for i in range(3):
        hvd.allreduce(torch.ones(8), name=f"tl.op{i}")
    hvd.stop_timeline()
    hvd.barrier()
    if rank == 0:
        text = open(path).read() if os.path.exists(path) else ""
        c.check("tl.op2" in text, "timeline lacks the op names")
        try:
            json.loads(text.rstrip().rstrip(",") + ("" if text.rstrip().endswith("]") else "]"))
        except ValueError as e:
            c.fail(f"timeline is not JSON: {e}")


def main():
    tmp = sys.argv[1]
    n_env = int(os.environ["SPARK_HVD_SIZE"])
    torch.set_num_threads(1)
    sets = [hvd.ProcessSet(list(range(0, n_env, 2))), hvd.ProcessSet(list(range(1, n_env, 2)))]
    hvd.init(process_sets=sets)
    rank, n = hvd.rank(), hvd.size()
    c = Checks(rank)
    for fn, args in ((optimizer_math, ()), (adasum_optimizer, ()), (optimizer_behaviour, ()),
                     (scheduler_and_resume, ()), (unused_parameters, ()),
                     (dynamic_requires_grad, ()), (sparse_gradients, ()),
                     (process_set_optimizers, (sets,)), (process_set_functions, (sets,)),
                     (broadcasts, ()), (optimizer_state, ()),
                     (sync_batch_norm, ()), (model_parallel, ())):
        c.run(fn.__name__, fn, c, n, rank, *args)
    c.run("timeline", timeline, c, rank, tmp)
    hvd.shutdown()
    c.finish(size=n)


if __name__ == "__main__":
    main()
