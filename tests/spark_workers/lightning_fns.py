"""LightningModules, callbacks and a data module the LightningEstimator tests send to the ranks.
The tests register this module with cloudpickle "by value", so the ranks need not import it."""

import json
import os

import lightning as L
import torch


class Regressor(L.LightningModule):
    """y = x·w + b on the 4-vector ``features``; logs train_loss per epoch and val_loss."""

    def __init__(self, lr=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, features):
        return self.fc(features).squeeze(-1)

    def _loss(self, batch):
        return torch.nn.functional.mse_loss(self(batch["features"]), batch["label"])

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class ScheduledWeightedRegressor(Regressor):
    """Per-row loss weights from the sample-weight column, and an LR halved every epoch."""

    def _loss(self, batch):
        squared = (self(batch["features"]) - batch["label"]) ** 2
        return (squared * batch["weight"]).mean()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1,
                                                             gamma=0.5)]


class NanRegressor(Regressor):
    """A loss that becomes NaN at the third batch of the first epoch."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == 2 else loss


class RankRecorder(L.Callback):
    """Writes what it saw on each rank to ``<directory>/rank<r>.log`` (one JSON per line):
    the Trainer's rank and world size as the strategy reports them, every epoch started and
    ended, and at the end a checksum of the weights (equal on every rank when gradients are
    averaged)."""

    def __init__(self, directory):
        self.directory = directory

    def _log(self, trainer, **fields):
        fields.update(rank=trainer.global_rank, world=trainer.world_size)
        with open(os.path.join(self.directory, f"rank{trainer.global_rank}.log"), "a") as f:
            f.write(json.dumps(fields) + "\n")

    def on_fit_start(self, trainer, pl_module):
        import spark_hvd.torch as hvd
        self._log(trainer, event="fit_start", hvd_rank=hvd.rank(),
                  strategy=type(trainer.strategy).__name__)

    def on_train_epoch_start(self, trainer, pl_module):
        self._log(trainer, event="epoch_start", epoch=trainer.current_epoch)

    def on_train_epoch_end(self, trainer, pl_module):
        self._log(trainer, event="epoch_end", epoch=trainer.current_epoch,
                  metrics=sorted(trainer.callback_metrics))

    def on_fit_end(self, trainer, pl_module):
        weights = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        self._log(trainer, event="fit_end", weights=weights.tolist(),
                  global_step=trainer.global_step)


def read_rank_logs(directory, rank):
    with open(os.path.join(directory, f"rank{rank}.log")) as f:
        return [json.loads(line) for line in f]


class ParquetDataModule(L.LightningDataModule):
    """A data module in Horovod's style: built by the estimator with the shard keywords
    (train_dir, cur_shard, shard_count, schema_fields, ...) and reading the Parquet shards
    itself with pyarrow, every shard_count-th file from cur_shard."""

    def __init__(self, train_dir, val_dir, has_val, train_batch_size, cur_shard, shard_count,
                 schema_fields, store, **kwargs):
        super().__init__()
        self.train_dir, self.cur_shard, self.shard_count = train_dir, cur_shard, shard_count
        self.batch_size, self.columns, self.store = train_batch_size, schema_fields, store

    def train_dataloader(self):
        import numpy as np
        import pyarrow.parquet as pq
        names = sorted(n for n in self.store.listdir(self.train_dir) if n.endswith(".parquet"))
        tables = [pq.read_table(self.store.fs_path(self.store.join(self.train_dir, n)),
                                filesystem=self.store.filesystem, columns=self.columns)
                  for n in names[self.cur_shard::self.shard_count]]
        features = np.concatenate([np.stack(t.column("features").to_pylist()) for t in tables])
        labels = np.concatenate([t.column("label").to_numpy() for t in tables])
        rows = [{"features": torch.tensor(x, dtype=torch.float32),
                 "label": torch.tensor(y, dtype=torch.float32)}
                for x, y in zip(features, labels)]
        return torch.utils.data.DataLoader(rows, batch_size=self.batch_size, shuffle=False)
