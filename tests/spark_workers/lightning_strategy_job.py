"""A Lightning script run by ``spark-hvd-run`` with spark_hvd's strategy and no estimator:
Lightning's DistributedSampler shards a DataLoader by the strategy's ranks, the weights end
equal on every rank, ``scale_learning_rate`` scales the optimizer and its scheduler, gradient
clipping sees the averaged gradients, and the strategy's collectives (reduce with each op,
all_gather, broadcast, barrier) give what Lightning expects. Prints ``OK rank=R`` or ``FAIL``
lines."""

import sys

import lightning as L
import torch

from spark_hvd.lightning import SparkHvdStrategy

failures = []


def check(condition, what):
    if not condition:
        failures.append(what)


class Indexed(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.full((2,), float(i) / 64)
        return i, x, x.sum()


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)
        self.seen = {}    # epoch -> row indices this rank trained on
        self.grad_norms = []

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        self.seen.setdefault(self.current_epoch, []).extend(index.tolist())
        return torch.nn.functional.mse_loss(self.fc(x).squeeze(-1), y)

    def on_before_optimizer_step(self, optimizer):
        norm = torch.cat([p.grad.flatten() for p in self.parameters()]).norm()
        self.grad_norms.append(float(norm))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)]


def main():
    import spark_hvd.torch as hvd
    hvd.init()
    # Different initial weights per rank: the strategy must broadcast rank 0's.
    torch.manual_seed(1234 + hvd.rank())
    model = Model()
    strategy = SparkHvdStrategy(scale_learning_rate=True)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1e-3)
    loader = torch.utils.data.DataLoader(Indexed(), batch_size=4)
    trainer.fit(model, loader)
    rank, size = hvd.rank(), hvd.size()
    check((trainer.global_rank, trainer.world_size) == (rank, size),
          f"trainer ranks {(trainer.global_rank, trainer.world_size)}")
    # Each epoch the sampler gave this rank its half of the 64 rows, disjoint from the other's.
    everyone = hvd.allgather_object(model.seen)
    for epoch in (0, 1):
        rows = [sorted(seen[epoch]) for seen in everyone]
        check(all(len(r) == 64 // size for r in rows) and
              sorted(sum(rows, [])) == list(range(64)), f"rows of epoch {epoch}: {rows}")
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = hvd.allgather(weights.unsqueeze(0))
    check(all(torch.equal(gathered[0], g) for g in gathered), f"weights differ: {gathered}")
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    check(abs(lr - 0.1 * size) < 1e-9, f"lr {lr}")
    check(trainer.lr_scheduler_configs[0].scheduler.base_lrs == [0.1 * size],
          f"base_lrs {trainer.lr_scheduler_configs[0].scheduler.base_lrs}")
    # Clipping ran on the averaged gradients: the same norms before it on every rank.
    norms = hvd.allgather_object(model.grad_norms)
    check(all(n == norms[0] for n in norms) and len(norms[0]) == 16, f"norms {norms}")

    value = torch.tensor([float(rank + 1)])
    check(float(strategy.reduce(value)) == (size + 1) / 2, "reduce mean")
    check(float(strategy.reduce(value, reduce_op="sum")) == size * (size + 1) / 2, "reduce sum")
    check(float(strategy.reduce(value, reduce_op="max")) == size, "reduce max")
    check(float(strategy.reduce(value, reduce_op=torch.distributed.ReduceOp.MIN)) == 1,
          "reduce ReduceOp.MIN")
    check(strategy.reduce("not a tensor") == "not a tensor", "reduce of a non-tensor")
    check(strategy.reduce_boolean_decision(rank == 0, all=False) is True, "decision any")
    check(strategy.reduce_boolean_decision(rank == 0, all=True) is (size == 1), "decision all")
    stacked = strategy.all_gather(torch.tensor([rank, 10 * rank]))
    check(stacked.tolist() == [[r, 10 * r] for r in range(size)], f"all_gather {stacked}")
    check(strategy.broadcast({"from": rank}, src=size - 1) == {"from": size - 1}, "broadcast")
    strategy.barrier("done")
    for failure in failures:
        print(f"FAIL rank={rank} {failure}", flush=True)
    if not failures:
        print(f"OK rank={rank}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
