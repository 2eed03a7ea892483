"""Horovod API coverage, one mode per launch (each mode calls init itself): hvd.elastic states
(torch, Keras), keras load_model(legacy_opts=), init(process_sets="dynamic"),
HOROVOD_TIMELINE=DYNAMIC with start_timeline / stop_timeline, HOROVOD_* warnings once per
process, and the environment the launcher's Horovod flags give the ranks.

Usage: horovod_api.py MODE [ARGS...]
"""

import json
import os
import sys

import numpy as np

from _wutil import Checks


def elastic_torch(c):
    """TorchState / ObjectState: sync() gives every rank rank 0's model, optimizer and
    objects; restore() undoes changes since the last commit(); run syncs and calls once
    outside an elastic job; ElasticSampler shards the dataset."""
    import torch

    import spark_hvd.torch as hvd
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(rank)  # different weights on every rank
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
    state = hvd.elastic.TorchState(model, opt, epoch=10 + rank, batch=rank)
    state.sync()
    weights = hvd.allgather(model.weight.detach().reshape(1, -1))
    c.check(torch.equal(weights[0], weights[-1]), f"weights differ after sync: {weights}")
    c.check(opt.param_groups[0]["lr"] == 0.1, f"lr after sync {opt.param_groups[0]['lr']}")
    c.check((state.epoch, state.batch) == (10, 0), f"objects after sync {state.epoch}")
    synced = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    state.epoch = 99
    state.restore()
    c.check(torch.equal(model.weight, synced), "restore() did not bring the weights back")
    c.check(state.epoch == 10, f"restore() left epoch {state.epoch}")
    with torch.no_grad():
        model.weight.add_(1.0)
    state.epoch = 11
    state.commit()
    with torch.no_grad():
        model.weight.add_(5.0)
    state.restore()
    c.check(torch.equal(model.weight, synced + 1.0), "restore() after commit()")
    c.check(state.epoch == 11, f"epoch after commit/restore {state.epoch}")
    obj = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=rank * 7)
    obj.sync()
    c.check(obj.step == 0, f"ObjectState.sync gave {obj.step}")

    calls = []

    @hvd.elastic.run
    def train(state, x):
        calls.append(x)
        return state.epoch

    # Outside an elastic job: sync, then one call (a lost peer would end the job as usual).
    c.check(train(state, 5) == 11 and calls == [5], f"elastic.run gave {calls}")
    sampler = hvd.elastic.ElasticSampler(range(4))
    c.check(len(sampler) == 4 // hvd.size(), f"ElasticSampler shard of {len(sampler)}")
    hvd.shutdown()


def elastic_keras(c, workdir):
    """KerasState (spark_hvd.keras and spark_hvd.tensorflow.keras) syncs, restores and
    commits; the state callbacks update it during fit; TensorFlow's elastic.run runs once;
    load_model(legacy_opts=False) loads and wraps, legacy_opts=True is a clear error."""
    import keras
    import tensorflow as tf

    import spark_hvd.keras as hvd
    import spark_hvd.tensorflow as tfhvd
    import spark_hvd.tensorflow.keras as tfkhvd
    from spark_hvd.keras.optimizer import _DistributedOptimizer
    hvd.init()
    rank = hvd.rank()
    c.check(tfkhvd.elastic.KerasState is hvd.elastic.KerasState, "two KerasState classes")
    v = 1.0 if rank == 0 else 2.0
    model = keras.Sequential([keras.layers.Dense(2)])
    model.build((2, 2))
    model.set_weights([np.full((2, 2), v, np.float32), np.full(2, v, np.float32)])
    state = hvd.elastic.KerasState(model, keras.optimizers.Adam(0.001), batch=20 + rank,
                                   epoch=10 + rank)
    state.sync()
    c.check(all(np.allclose(w, 1.0) for w in model.get_weights()), "weights after sync")
    c.check((state.batch, state.epoch) == (20, 10), "objects after sync")
    model.set_weights([w * 3 for w in model.get_weights()])
    state.batch = 21
    state.restore()
    c.check(all(np.allclose(w, 1.0) for w in model.get_weights()), "weights after restore")
    c.check(state.batch == 20, f"batch after restore {state.batch}")
    model.set_weights([w * 3 for w in model.get_weights()])
    state.commit()
    state.restore()
    c.check(all(np.allclose(w, 3.0) for w in model.get_weights()), "commit then restore")

    variables = [tf.Variable(float(rank + 5))]
    tf_state = tfhvd.elastic.TensorFlowState(variables, step=rank)
    tf_state.sync()
    c.check(float(variables[0].numpy()) == 5.0 and tf_state.step == 0, "TensorFlowState sync")

    fit_model = keras.Sequential([keras.layers.Dense(1)])
    fit_model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                      loss="mse")
    fit_model.build((None, 2))
    fit_state = hvd.elastic.KerasState(fit_model, batch=0, epoch=0)
    x, y = np.ones((8, 2), np.float32), np.ones((8, 1), np.float32)
    fit_model.fit(x, y, batch_size=2, epochs=2, verbose=0, callbacks=[
        hvd.elastic.CommitStateCallback(fit_state, batches_per_commit=2),
        hvd.elastic.UpdateBatchStateCallback(fit_state),
        hvd.elastic.UpdateEpochStateCallback(fit_state)])
    c.check((fit_state.epoch, fit_state.batch) == (2, 0),
            f"callbacks left epoch {fit_state.epoch}, batch {fit_state.batch}")

    calls = []
    tfhvd.elastic.run(lambda s, x: calls.append(x))(fit_state, 7)
    c.check(calls == [7], f"tensorflow elastic.run outside an elastic job called {calls}")

    path = os.path.join(workdir, f"model.{rank}.keras")
    fit_model.save(path)
    for module in (hvd, tfkhvd):
        loaded = module.load_model(path, legacy_opts=False)
        c.check(isinstance(loaded.optimizer, _DistributedOptimizer),
                f"{module.__name__}.load_model: optimizer {type(loaded.optimizer)} not wrapped")
        c.raises(f"{module.__name__}.load_model(legacy_opts=True)", ValueError,
                 module.load_model, path, legacy_opts=True,
                 match=["legacy_opts", "Keras 3", "legacy_opts=False"])
    hvd.shutdown()


def dynamic_sets(c):
    """init(process_sets="dynamic") allows add/remove at run time; another string is a
    ValueError; without it, add_process_set names the way to enable it. Three ranks or more
    (the set [0, 1] must not be the global set)."""
    import spark_hvd.numpy as hvd
    c.raises("init(process_sets='static')", ValueError, hvd.init, process_sets="static",
             match=["'dynamic'"])
    hvd.init(process_sets="dynamic")
    ps = c.run("add_process_set", hvd.add_process_set, [0, 1])
    if ps is not None:
        if ps.included():
            got = hvd.allreduce(np.ones(3), op=hvd.Sum, process_set=ps)
            c.check(np.all(got == 2), f"allreduce on the added set gave {got}")
        c.check(hvd.remove_process_set(ps), "remove_process_set returned False")
    hvd.shutdown()
    hvd.init()
    c.raises("add_process_set without dynamic", ValueError, hvd.add_process_set, [0, 1],
             match=["process_sets='dynamic'", "DYNAMIC_PROCESS_SETS"])
    hvd.shutdown()


def dynamic_timeline(c, path):
    """With HOROVOD_TIMELINE=DYNAMIC no timeline runs (and no file named DYNAMIC appears)
    until start_timeline; ops between start and stop are in the file (with cycle marks), ops
    after stop are not."""
    import spark_hvd.numpy as hvd
    hvd.init()
    hvd.allreduce(np.ones(4), name="before_start")
    hvd.barrier()
    c.check(not os.path.exists("DYNAMIC"), "a file named DYNAMIC was created")
    if hvd.rank() == 0:  # the others may look after rank 0 started it
        c.check(not os.path.exists(path), "the timeline file exists before start_timeline")
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(np.ones(4), name="while_recording")
    hvd.barrier()
    hvd.stop_timeline()
    # The timeline is rank 0's (the coordinator's) view: a request another rank sends before
    # rank 0 has stopped is recorded, as in Horovod. The barrier makes "after_stop" start
    # only once every rank, rank 0 included, has passed stop_timeline.
    hvd.barrier()
    hvd.allreduce(np.ones(4), name="after_stop")
    hvd.barrier()
    if hvd.rank() == 0:
        with open(path) as f:
            events = json.load(f)  # stop_timeline closed it as valid JSON
        text = json.dumps(events)
        c.check("while_recording" in text, "the recorded op is missing")
        leaked = [n for n in ("before_start", "after_stop") if n in text]
        c.check(not leaked, f"ops outside start/stop were recorded: {leaked}: {text}")
        c.check("CYCLE_START" in text, "mark_cycles=True gave no CYCLE_START")
    hvd.shutdown()


def env_warnings(c):
    """Warned HOROVOD_* variables are reported through the spark_hvd logger once per process,
    even across a second init; the test reads stderr."""
    import spark_hvd.numpy as hvd
    for _ in range(2):
        hvd.init()
        hvd.barrier()
        hvd.shutdown()


def env(c, *names):
    """Prints NAME=value for the variables the test asks about (as the ranks see them)."""
    for name in names:
        print(f"ENV {name}={os.environ.get(name, '<unset>')}", flush=True)


def _rank_info(base, scale=1):
    import spark_hvd.numpy as hvd
    hvd.init()
    total = hvd.allreduce(np.array([float(base + hvd.rank())]), op=hvd.Sum)
    return {"rank": hvd.rank(), "size": hvd.size(), "total": float(total[0]) * scale}


def _fail_on_rank_1():
    import spark_hvd.numpy as hvd
    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("rank 1 gives up")
    hvd.barrier()  # rank 0 waits here until the job is stopped


def run_driver(c, case):
    """Not a rank: the driver of spark_hvd.run (Horovod's horovod.run), printing what it
    returned or raised as one JSON line for the test."""
    import spark_hvd
    from spark_hvd.spark import RunError
    if case == "ok":
        out = spark_hvd.run(_rank_info, args=(3,), kwargs={"scale": 2}, np=2)
    else:
        try:
            spark_hvd.run(_fail_on_rank_1, num_proc=2)
            out = "no error"
        except RunError as e:
            out = {"rank": e.rank, "kind": e.kind, "message": str(e)}
    print("DRIVER " + json.dumps(out), flush=True)


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    c = Checks(int(os.environ.get("SPARK_HVD_RANK", "0")))
    globals()[mode](c, *args)
    c.finish()


if __name__ == "__main__":
    main()
