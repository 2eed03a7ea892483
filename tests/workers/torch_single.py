"""spark_hvd.torch in a process started without a launcher: a job of size 1.

Usage: torch_single.py
"""

import torch

import spark_hvd.torch as hvd
from _wutil import Checks


def main():
    torch.set_num_threads(1)
    hvd.init()
    c = Checks(0)
    c.check(hvd.size() == 1 and hvd.rank() == 0 and hvd.is_initialized(), "size 1 job")
    t = torch.arange(5.0)
    c.check(torch.equal(hvd.allreduce(t), t), "allreduce on one rank")
    c.check(torch.equal(hvd.allgather(t), t), "allgather on one rank")
    model = torch.nn.Linear(3, 2)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    c.check(not opt._hook_handles, "hooks installed at size 1")
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).sum().backward()
        o.step()
    c.check(torch.equal(model.weight, ref.weight), "size-1 step equals the plain step")
    # Adasum is accepted at size 1 (as in Horovod: nothing to combine)
    hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    bn, ref_bn = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    x = torch.randn(5, 3)
    c.check(torch.allclose(bn(x), ref_bn(x)), "SyncBatchNorm at size 1")
    adam = torch.optim.Adam(model.parameters())
    hvd.broadcast_optimizer_state(adam, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    c.check(hvd.broadcast_object({"a": 1}) == {"a": 1}, "broadcast_object")
    hvd.shutdown()
    c.check(not hvd.is_initialized(), "shutdown")
    hvd.init()  # re-init after shutdown
    c.check(torch.equal(hvd.allreduce(t, op=hvd.Sum), t), "allreduce after re-init")
    hvd.shutdown()
    c.finish()


if __name__ == "__main__":
    main()
