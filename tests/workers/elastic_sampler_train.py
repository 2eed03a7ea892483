"""An elastic torch training script (run by spark-hvd-run --min-np ...): a TorchState with a
model, a DistributedOptimizer (Adam) and an ElasticSampler, under hvd.elastic.run. The state
keeps a ledger of how often each sample went into the model (every rank adds all ranks'
batches of each step), so it is rolled back by restore and synced from rank 0 with the model.
After every epoch each rank prints
``EPOCH rank=R size=S epoch=E bad=B`` (B: samples in the ledger other than E times, plus once
more for those borrowed from the next epoch as padding), and at the end
``DONE rank=R size=S steps=K weights_equal=True|False``.

Environment: KILL_HOST (the worker on that host SIGKILLs itself at step KILL_STEP; with
KILL_ONCE, a file, only the first time),
GROW_MARKER (rank 0 creates that file at step GROW_STEP: the test's discovery script then
lists one more host).
"""

import os
import signal
import time

import numpy as np
import torch

import spark_hvd.torch as hvd

N, B, EPOCHS = 203, 4, 3
HOST = os.environ.get("HOROVOD_HOSTNAME", "")


def at_step(name, step):
    return int(os.environ.get(f"{name}_STEP", -1)) == step


def first_kill():
    """True the first time, on any worker, unless KILL_ONCE names no file (then always): a
    worker that replaces the killed one on its host must not kill itself again."""
    path = os.environ.get("KILL_ONCE")
    if not path:
        return True
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
dataset = list(range(N))
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
loader = torch.utils.data.DataLoader(dataset, batch_size=B, sampler=sampler)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, steps=0,
                               ledger=np.zeros(N, np.int64))


@hvd.elastic.run
def train(state):
    while state.epoch < EPOCHS:
        for batch_idx, batch in enumerate(loader):
            if HOST == os.environ.get("KILL_HOST") and at_step("KILL", state.steps) \
                    and first_kill():
                os.kill(os.getpid(), signal.SIGKILL)
            if hvd.rank() == 0 and at_step("GROW", state.steps):
                open(os.environ["GROW_MARKER"], "w").close()
            everything = hvd.allgather_object(batch.tolist(), name="batch")
            optimizer.zero_grad()
            model(torch.ones(len(batch), 3)).sum().backward()
            optimizer.step()
            for indices in everything:
                np.add.at(state.ledger, indices, 1)
            sampler.record_batch(batch_idx, B)
            state.steps += 1
            if state.steps % 3 == 0:
                state.commit()
            time.sleep(0.05)
        state.epoch += 1
        sampler.set_epoch(state.epoch)
        state.commit()
        borrowed = np.unpackbits(sampler.state_dict()["done"], count=N).astype(int)
        bad = np.flatnonzero(state.ledger != state.epoch + borrowed)
        print(f"EPOCH rank={hvd.rank()} size={hvd.size()} epoch={state.epoch} bad={len(bad)} "
              f"samples={bad[:5].tolist()} counts={state.ledger[bad[:5]].tolist()}", flush=True)


train(state)
weights = hvd.allgather(model.weight.detach())
equal = all(torch.equal(weights[0], w) for w in weights)
print(f"DONE rank={hvd.rank()} size={hvd.size()} steps={state.steps} weights_equal={equal}",
      flush=True)
