"""Functions that run_elastic runs in the Spark tests (imported by value: cloudpickle)."""

import json
import os
import time


def record(pid_dir, **fields):
    """This worker's latest place, for the test that picks whom to kill."""
    if not pid_dir:
        return
    path = os.path.join(pid_dir, f"worker.{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), **fields}, f)
    os.replace(path + ".tmp", path)


def elastic_train(min_steps, max_steps, pid_dir=None, step_seconds=0.1, regrow_steps=3):
    """Trains a tiny model under hvd.elastic.run, one commit a step. Goes on past
    ``min_steps`` while the job is smaller than it started (up to ``max_steps``), and until it
    ran ``regrow_steps`` steps at its first size again after shrinking. ``sizes`` in the
    result: (time, size) of every committed step."""
    import torch

    import spark_hvd.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0, sizes=[], first_size=hvd.size(),
                                   shrunk=False, regrown=0)

    @hvd.elastic.run
    def train(state):
        while True:
            size = hvd.size()
            if size < state.first_size:
                state.shrunk = True
            elif state.shrunk:
                state.regrown += 1
            if state.step >= max_steps or (state.step >= min_steps and (
                    not state.shrunk or state.regrown > regrow_steps)):
                return
            record(pid_dir, rank=hvd.rank(), size=size, step=state.step)
            x = torch.full((8, 4), float(hvd.rank() + 1))
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
            state.sizes.append((time.time(), size))
            state.step += 1
            state.commit()
            time.sleep(step_seconds)

    train(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "steps": state.step,
            "sizes": state.sizes, "weight": model.weight.detach().flatten().tolist()}


def raise_on(rank, after_steps):
    """Every worker inits; ``rank`` raises after a few committed steps."""
    import spark_hvd.torch as hvd
    import torch
    hvd.init()
    state = hvd.elastic.TorchState(step=0)

    @hvd.elastic.run
    def train(state):
        while state.step < 1000:
            hvd.allreduce(torch.ones(1), name="x")
            state.step += 1
            state.commit()
            if state.step == after_steps and hvd.rank() == rank:
                raise ValueError(f"deliberate failure on rank {rank}")
            time.sleep(0.05)
    train(state)
    return "not reached"


def rank_and_size():
    import spark_hvd.numpy as hvd
    hvd.init()
    return hvd.rank(), hvd.size()
