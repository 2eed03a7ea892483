"""An elastic training script for the launcher's tests (NumPy only, no framework).

Linear regression by SGD: every rank takes its own batch of each step, the gradients are
averaged with allreduce, every step is committed. Prints, per step,
``STEP rank=R size=S step=K t=TIME loss=L wid=W`` and at the end
``OK rank=R size=S step=K hash=H rounds=N wid=W`` (H: a hash of the weights' bytes, equal on every
rank when they agree bitwise).

Options:
  --steps N           steps to train (default 40)
  --sleep S           seconds per step (default 0.05)
  --kill WID:STEP     the worker with that id kills itself (SIGKILL) at that step (repeatable)
  --stop WID:STEP     the worker with that id stops itself (SIGSTOP) at that step: frozen
  --raise WID:STEP    the worker with that id raises ValueError at that step (a user error)
  --fail-on-host H    a worker started on host H exits with code 3 before init()
  --timed             also print KILL t= before a kill and RESTORE t= when a survivor's
                      collective failed (benchmarks/elastic.py)
  --grow-to N         keep training until the job has N ranks (at most --grow-wait s), then
                      --steps more steps
  --grow-wait S       (default 60)
"""

import argparse
import hashlib
import os
import signal
import sys
import time

import numpy as np

import spark_hvd.numpy as hvd
from spark_hvd.common.elastic import ObjectState, run_fn

if os.environ.get("FRAMEWORK") == "emulated-cuda":  # gradients as CUDA tensors: tests/fake_cuda
    import _emulated_cuda as hvd

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--sleep", type=float, default=0.05)
p.add_argument("--kill", action="append", default=[])
p.add_argument("--stop", default="")
p.add_argument("--raise", dest="raise_", default="")
p.add_argument("--fail-on-host", default="")
p.add_argument("--timed", action="store_true")
p.add_argument("--grow-to", type=int, default=0)
p.add_argument("--grow-wait", type=float, default=60.0)
args = p.parse_args()

WID = os.environ.get("SPARK_HVD_ELASTIC_WORKER_ID", "?")
rng = np.random.default_rng(0)
X = rng.normal(size=(512, 8))
W_TRUE = rng.normal(size=8)
Y = X @ W_TRUE


def at(*specs):
    for spec in specs:
        wid, _, step = spec.rpartition(":")
        if wid == WID:
            return int(step)
    return None


kill_at, raise_at, stop_at = at(*args.kill), at(args.raise_), at(args.stop)
rounds = 0


def loss_of(w):
    return float(np.mean((X @ w - Y) ** 2))


def train(state):
    global rounds
    rounds += 1
    started = time.time()
    target = None if args.grow_to else args.steps
    while True:
        if target is None and (hvd.size() >= args.grow_to
                               or time.time() - started >= args.grow_wait):
            target = state.step + args.steps
        if target is not None and state.step >= target:
            return state.w
        if kill_at is not None and state.step == kill_at:
            if args.timed:
                print(f"KILL t={time.time():.4f}", flush=True)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if stop_at is not None and state.step == stop_at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive, its sockets answered
        if raise_at is not None and state.step == raise_at:
            raise ValueError(f"user error on purpose at step {state.step}")
        rank, size = hvd.rank(), hvd.size()
        idx = np.random.default_rng(state.step * 1000 + rank).integers(0, len(X), 16)
        grad = 2 * X[idx].T @ (X[idx] @ state.w - Y[idx]) / len(idx)
        grad = hvd.allreduce(grad, name="grad", op=hvd.Average)
        state.w = state.w - 0.05 * grad
        state.step += 1
        print(f"STEP rank={rank} size={size} step={state.step} t={time.time():.3f} "
              f"loss={loss_of(state.w):.6g} wid={WID}", flush=True)
        time.sleep(args.sleep)
        state.commit()


if args.fail_on_host and os.environ.get("SPARK_HVD_HOSTNAME") == args.fail_on_host:
    sys.exit(3)
class TimedState(ObjectState):
    def restore(self):
        if args.timed:
            print(f"RESTORE t={time.time():.4f}", flush=True)
        super().restore()


hvd.init()
state = TimedState(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, w=np.zeros(8), step=0)
w = run_fn(train)(state)
digest = hashlib.sha256(np.ascontiguousarray(w).tobytes()).hexdigest()[:16]
print(f"OK rank={hvd.rank()} size={hvd.size()} step={state.step} hash={digest} rounds={rounds} "
      f"loss={loss_of(w):.6g} wid={WID} nccl={hvd.gpu_counters()['nccl_collectives']}",
      flush=True)
