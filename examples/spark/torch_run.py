"""Train the MNIST-style CNN on Spark executors with spark_hvd.spark.run.

    PYSPARK_PYTHON=$(which python) spark-submit --master local[2] examples/spark/torch_run.py
    spark-submit --master spark://host:7077 examples/spark/torch_run.py --num-proc 4 --epochs 3

Each Spark task runs ``train`` as one rank: the function is the usual Horovod training script
(init, shard the data by rank, scale the learning rate, broadcast the initial state, wrap the
optimizer), only it is a function, and it returns a value: rank 0's trained weights and its
accuracy come back to the driver. The data is synthetic (MNIST-shaped, learnable, nothing is
downloaded), so the example needs no DataFrame; the Estimators (spark_hvd.estimators) are the
way to train on one.
"""

import argparse
import time


def train(epochs, lr, batch_size, train_samples, test_samples, seed=42):
    """One rank of the job. Runs in a Python process a Spark task starts for it."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn, optim

    import spark_hvd.torch as hvd

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
            self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
            self.fc1 = nn.Linear(320, 50)
            self.fc2 = nn.Linear(50, 10)

        def forward(self, x):
            x = F.relu(F.max_pool2d(self.conv1(x), 2))
            x = F.relu(F.max_pool2d(self.conv2(x), 2))
            x = F.relu(self.fc1(x.view(-1, 320)))
            return F.log_softmax(self.fc2(x), dim=1)

    def synthetic_mnist(n, data_seed):
        """Each class is a fixed blocky 28x28 pattern; samples are shifted, noisy copies."""
        rng = np.random.default_rng(1234)
        patterns = np.kron((rng.random((10, 7, 7)) > 0.7).astype(np.float32),
                           np.ones((4, 4), np.float32))
        rng = np.random.default_rng(data_seed)
        labels = rng.integers(0, 10, size=n)
        images = np.stack([np.roll(patterns[k], tuple(rng.integers(-2, 3, size=2)), axis=(0, 1))
                           for k in labels])
        images += rng.normal(0, 0.3, size=images.shape).astype(np.float32)
        return (torch.from_numpy(images).unsqueeze(1),
                torch.from_numpy(labels).long())

    # Horovod: initialize, one CPU thread per rank (or: torch.cuda.set_device(hvd.local_rank())
    # when Spark gave this task a GPU).
    hvd.init()
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else \
        torch.device("cpu")

    # Horovod: every rank trains on its own shard.
    x_train, y_train = synthetic_mnist(train_samples, data_seed=1)
    x_test, y_test = synthetic_mnist(test_samples, data_seed=2)
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]

    model = Net().to(device)
    # Horovod: scale the learning rate by the number of ranks.
    optimizer = optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.5)
    # Horovod: start from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # Horovod: average the gradients over the ranks during backward.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    history = []
    for epoch in range(1, epochs + 1):
        model.train()
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            optimizer.zero_grad()
            loss = F.nll_loss(model(x_train[idx].to(device)), y_train[idx].to(device))
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            shard = slice(hvd.rank(), None, hvd.size())
            output = model(x_test[shard].to(device))
            correct = output.argmax(dim=1).eq(y_test[shard].to(device)).float().mean()
        # Horovod: average the metric over the ranks.
        accuracy = hvd.allreduce(correct.cpu(), name="accuracy").item()
        history.append(accuracy)
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} test accuracy {accuracy:.3f}",
                  flush=True)

    weights = {k: v.cpu() for k, v in model.state_dict().items()} if hvd.rank() == 0 else None
    hvd.shutdown()
    return {"history": history, "weights": weights}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-proc", type=int, default=None,
                   help="ranks (Spark tasks); default spark.default.parallelism")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--train-samples", type=int, default=4000)
    p.add_argument("--test-samples", type=int, default=1000)
    args = p.parse_args(argv)

    from pyspark.sql import SparkSession

    import spark_hvd.spark

    spark = SparkSession.builder.appName("spark_hvd torch_run example").getOrCreate()
    t0 = time.monotonic()
    results = spark_hvd.spark.run(
        train, args=(args.epochs, args.lr, args.batch_size, args.train_samples,
                     args.test_samples), num_proc=args.num_proc)
    seconds = time.monotonic() - t0
    history = results[0]["history"]
    params = sum(v.numel() for v in results[0]["weights"].values())
    print(f"trained on {len(results)} ranks in {seconds:.1f} s; accuracy per epoch "
          f"{[round(a, 3) for a in history]}; rank 0 returned {params} weights")
    print(f"FINAL accuracy={history[-1]:.4f} ranks={len(results)}")
    spark.stop()


if __name__ == "__main__":
    main()
