"""Training throughput of a CNN on synthetic data, like Horovod's PyTorch synthetic benchmark.

    spark-hvd-run -np 2 python examples/pytorch/synthetic_benchmark.py
    spark-hvd-run -np 2 python examples/pytorch/synthetic_benchmark.py --model resnet18 \\
        --image-size 64 --batch-size 16       # needs torchvision

Prints images/s per rank for every iteration, their mean +- 1.96 std, and the total over all
ranks. On CPUs, one rank per core with ``--num-threads 1`` is the efficient setup.
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn, optim

import spark_hvd.torch as hvd


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="spark_hvd PyTorch synthetic benchmark")
    p.add_argument("--model", default="cnn",
                   help="'cnn' (built in) or a torchvision.models name (e.g. resnet18)")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--num-warmup-batches", type=int, default=5)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--fp16-allreduce", action="store_true")
    p.add_argument("--use-adasum", action="store_true")
    return p.parse_args(argv)


class SmallCNN(nn.Module):
    """A compact CIFAR-style network (about 0.3 M parameters)."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.c1 = nn.Conv2d(3, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 64, 3, padding=1)
        self.c3 = nn.Conv2d(64, 128, 3, padding=1)
        self.bn1, self.bn2, self.bn3 = nn.BatchNorm2d(32), nn.BatchNorm2d(64), nn.BatchNorm2d(128)
        self.fc1 = nn.Linear(128, 256)
        self.fc2 = nn.Linear(256, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.c1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.c2(x))), 2)
        x = F.relu(self.bn3(self.c3(x)))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc2(F.relu(self.fc1(x)))


def build_model(name, num_classes):
    if name == "cnn":
        return SmallCNN(num_classes)
    try:
        from torchvision import models
    except ImportError:
        raise SystemExit(f"--model {name} needs torchvision; use --model cnn") from None
    return getattr(models, name)(num_classes=num_classes)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)

    model = build_model(args.model, args.num_classes)
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, args.num_classes, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of ranks: {hvd.size()} (CPU, {args.num_threads} thread(s) each)")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {rate:.1f} img/sec per rank")
        rates.append(rate)
    mean, conf = float(np.mean(rates)), float(1.96 * np.std(rates))
    log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} +-"
        f"{hvd.size() * conf:.1f}")
    hvd.shutdown()
    return mean


if __name__ == "__main__":
    main()
