"""The classic Horovod PyTorch MNIST recipe on spark_hvd.

    spark-hvd-run -np 2 python examples/pytorch/mnist.py --epochs 3
    spark-hvd-run -np 2 python examples/pytorch/mnist.py --data mnist.npz --checkpoint-dir ckpt

Without ``--data`` it trains on synthetic MNIST-shaped data (28x28 grey images of 10 classes,
learnable, nothing downloaded). ``--data`` takes an ``.npz`` with ``x_train``, ``y_train``,
``x_test``, ``y_test`` (the layout of Keras' ``mnist.npz``: uint8 images, int labels).

The Horovod steps are marked "Horovod:"; everything else is plain PyTorch.
"""

import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.data.distributed
from torch import nn, optim

import spark_hvd.torch as hvd


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="spark_hvd PyTorch MNIST example")
    p.add_argument("--batch-size", type=int, default=64, help="input batch size per rank")
    p.add_argument("--test-batch-size", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01, help="learning rate for one rank")
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log-interval", type=int, default=10, help="batches between log lines")
    p.add_argument("--fp16-allreduce", action="store_true", help="fp16 gradient compression")
    p.add_argument("--use-adasum", action="store_true", help="Adasum (not supported yet)")
    p.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    p.add_argument("--data", default=None, help=".npz with x_train/y_train/x_test/y_test")
    p.add_argument("--train-samples", type=int, default=6000, help="synthetic training size")
    p.add_argument("--test-samples", type=int, default=1000, help="synthetic test size")
    p.add_argument("--checkpoint-dir", default=None, help="rank 0 saves a checkpoint per epoch")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per rank")
    return p.parse_args(argv)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(n, seed):
    """MNIST-shaped data that can be learned: each class is a fixed random blocky pattern,
    samples are that pattern shifted by a pixel or two, plus noise."""
    rng = np.random.default_rng(1234)  # the class patterns: the same for every split
    blocks = (rng.random((10, 7, 7)) > 0.7).astype(np.float32)
    patterns = np.kron(blocks, np.ones((4, 4), np.float32))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n)
    images = np.empty((n, 28, 28), np.float32)
    for i, k in enumerate(labels):
        dy, dx = rng.integers(-2, 3, size=2)
        images[i] = np.roll(patterns[k], (dy, dx), axis=(0, 1))
    images += rng.normal(0, 0.3, size=images.shape).astype(np.float32)
    return images, labels


def load(args):
    if args.data:
        with np.load(args.data) as f:
            xtr, ytr, xte, yte = (f["x_train"], f["y_train"], f["x_test"], f["y_test"])
        xtr, xte = xtr.astype(np.float32) / 255.0, xte.astype(np.float32) / 255.0
    else:
        xtr, ytr = synthetic_mnist(args.train_samples, seed=1)
        xte, yte = synthetic_mnist(args.test_samples, seed=2)

    def dataset(x, y):
        x = (torch.from_numpy(np.ascontiguousarray(x)).unsqueeze(1) - 0.1307) / 0.3081
        return torch.utils.data.TensorDataset(x, torch.from_numpy(np.asarray(y)).long())
    return dataset(xtr, ytr), dataset(xte, yte)


def metric_average(value, name):
    """Horovod: average a metric over all ranks."""
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main(argv=None):
    args = parse_args(argv)

    # Horovod: initialize, then pin one CPU thread (or GPU) per process.
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.num_threads)

    train_dataset, test_dataset = load(args)
    # Horovod: each rank reads its own shard of the data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler)

    model = Net()
    # Horovod: scale the learning rate by the number of ranks (Adasum needs no scaling).
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Horovod: start every rank from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: average gradients across ranks while backward runs.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor)

    def train(epoch):
        model.train()
        # Horovod: a different shuffle every epoch, consistent across ranks.
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                # Horovod: len(train_sampler) is the number of samples of this rank.
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                      f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}",
                      flush=True)

    def test():
        model.eval()
        test_loss, test_accuracy = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                pred = output.argmax(dim=1)
                test_accuracy += pred.eq(target).float().sum().item()
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)
        # Horovod: average the metrics over the ranks.
        test_loss = metric_average(test_loss, "avg_loss")
        test_accuracy = metric_average(test_accuracy, "avg_accuracy")
        if hvd.rank() == 0:
            print(f"\nTest set: Average loss: {test_loss:.4f}, "
                  f"Accuracy: {100.0 * test_accuracy:.2f}%\n", flush=True)
        return test_accuracy

    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        train(epoch)
        accuracy = test()
        # Horovod: only rank 0 writes checkpoints.
        if args.checkpoint_dir and hvd.rank() == 0:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            path = os.path.join(args.checkpoint_dir, f"checkpoint-{epoch}.pt")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, path + ".tmp")
            os.replace(path + ".tmp", path)
    if hvd.rank() == 0:
        print(f"FINAL accuracy={accuracy:.4f} ranks={hvd.size()}", flush=True)
    hvd.shutdown()
    return accuracy


if __name__ == "__main__":
    main()
