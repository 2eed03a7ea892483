"""join() with uneven data: rank r has 2 + r batches. Ranks that run out join and keep
answering the others' gradient allreduces with zeros; join() returns the last rank to join.
Two epochs, so join works more than once per job.

Usage: torch_join.py
"""

import copy

import torch

import spark_hvd.torch as hvd
from _wutil import Checks
from torch_training import close, data, digest, mlp


def main():
    torch.set_num_threads(1)
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    c = Checks(rank)
    model = mlp()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    batches = lambda r: 2 + r  # noqa: E731
    for epoch in range(2):
        start = copy.deepcopy(ref)
        for step in range(batches(rank)):
            opt.zero_grad()
            x, t = data(rank, (4, 6), f"j{epoch}.{step}x"), data(rank, (4, 3), f"j{epoch}.{step}t")
            ((model(x) - t) ** 2).mean().backward()
            opt.step()
        last = c.run("join", hvd.join)
        c.check(last == n - 1, f"epoch {epoch}: join returned {last}, want {n - 1}")
        # the reference: at step k the ranks that still have data contribute, all n divide
        for step in range(batches(n - 1)):
            grads = {}
            for r in range(n):
                if step >= batches(r):
                    continue
                m = copy.deepcopy(ref)
                x, t = data(r, (4, 6), f"j{epoch}.{step}x"), data(r, (4, 3), f"j{epoch}.{step}t")
                ((m(x) - t) ** 2).mean().backward()
                for k, p in m.named_parameters():
                    grads[k] = grads.get(k, 0) + p.grad
            with torch.no_grad():
                for k, p in ref.named_parameters():
                    p -= 0.1 * grads[k] / n
            if step == batches(rank) - 1:
                mine = copy.deepcopy(ref)
        for (k, p), (_, q) in zip(model.named_parameters(), mine.named_parameters()):
            c.check(close(p.detach(), q.detach(), 1e-10), f"epoch {epoch}: {k} after my steps")
        # Horovod's recipe: continue from the last rank's weights
        hvd.broadcast_parameters(model.state_dict(), root_rank=last)
        ds = hvd.allgather_object(digest(dict(model.state_dict())))
        c.check(len(set(ds)) == 1, f"epoch {epoch}: weights differ after broadcast")
        for (k, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            c.check(close(p.detach(), q.detach(), 1e-10), f"epoch {epoch}: final {k}")
        del start
    hvd.shutdown()
    c.finish(size=n)


if __name__ == "__main__":
    main()
