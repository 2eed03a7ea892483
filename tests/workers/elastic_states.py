"""Elastic states and the sampler in real jobs of a fixed size (each mode calls init itself).

Usage: elastic_states.py MODE
  torch_sync     TorchState.sync gives every rank rank 0's model, optimizer (rank 0 has Adam
                 state, the others a fresh optimizer: the state a new worker has), LR scheduler,
                 sampler progress and plain attributes; restore/commit after; ElasticSampler
                 shards disjoint and complete across the ranks, every epoch and after a sync
  torch_mismatch a model, an optimizer or the sampler's progress that differs on one rank:
                 sync raises ValueError on every rank, nothing hangs, the job goes on
  size1          TorchState / ObjectState commit, restore and sync at size 1 (in-place changes
                 undone, LR scheduler and grad scaler restored in place, handler registry)
  keras_sync     KerasState: a new worker's unbuilt optimizer gets rank 0's slots; TensorFlowState;
                 a mismatched model raises on every rank; the callbacks update epoch and batch
                 with fit(epochs=E - state.epoch) and fit(initial_epoch=state.epoch)
  tf_lost_peer   rank 1 exits while rank 0 runs collectives in a tf.function and in fit: what
                 TensorFlow raises is a HorovodInternalError for hvd.elastic.run
"""

import os
import sys

import numpy as np

from _wutil import Checks


def _torch_model(seed):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                               torch.nn.Linear(3, 2))


def _same_on_every_rank(hvd, c, what, value):
    """Every rank's ``value`` (picklable) equals rank 0's."""
    every = hvd.allgather_object(value)
    c.check(all(_equal(v, every[0]) for v in every), f"{what} differs across ranks: {every}")


def _equal(a, b):
    import torch
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def _step(model, optimizer, rank):
    import torch
    optimizer.zero_grad()
    x = torch.full((5, 4), float(rank + 1))
    model(x).pow(2).sum().backward()
    optimizer.step()


def torch_sync(c):
    import torch

    import spark_hvd.torch as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = _torch_model(rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    dataset = list(range(103))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=5)
    if rank == 0:  # rank 0 trained: optimizer slots, scheduler steps; the others are "new"
        for _ in range(3):
            _step(model, optimizer, rank)
            scheduler.step()
    history = [rank] * 3
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, scheduler=scheduler,
                                   epoch=10 + rank, history=history, meta={"rank": rank})
    c.check(not optimizer.state or rank == 0, "a fresh optimizer has state")
    state.sync()
    _same_on_every_rank(hvd, c, "model", model.state_dict())
    _same_on_every_rank(hvd, c, "optimizer", optimizer.state_dict())
    c.check(len(optimizer.state) == len(list(model.parameters())),
            f"optimizer slots after sync: {len(optimizer.state)}")
    c.check(optimizer.param_groups[0]["lr"] == 0.01 * 0.5, f"lr {optimizer.param_groups[0]}")
    c.check(scheduler.last_epoch == 3 and state.scheduler is scheduler,
            f"scheduler after sync: last_epoch {scheduler.last_epoch}")
    c.check((state.epoch, state.history, state.meta) == (10, [0, 0, 0], {"rank": 0}),
            f"plain attributes after sync: {state.epoch} {state.history} {state.meta}")
    _same_on_every_rank(hvd, c, "sampler", (sampler.epoch, sampler.processed_num, len(sampler)))

    _check_shards(hvd, c, sampler, "after the first sync")
    for batch_idx in range(2):
        _step(model, optimizer, 0)  # the same data on every rank: models stay equal
        sampler.record_batch(batch_idx, 4)
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    state.history.append(99)
    state.epoch = 11
    _step(model, optimizer, 0)
    sampler.record_batch(2, 4)
    state.restore()
    c.check(all(torch.equal(v, committed[k]) for k, v in model.state_dict().items()),
            "restore() did not bring the committed weights back")
    c.check(state.history == [0, 0, 0] and state.epoch == 10,
            f"restore() left history {state.history}, epoch {state.epoch}")
    c.check(sampler.processed_num == 8 * size,
            f"processed_num after restore {sampler.processed_num}")
    # A sync after the restore: rank 0's progress, what is left split again.
    state.sync()
    c.check(sampler.processed_num == 8 * size, f"processed_num {sampler.processed_num}")
    c.check(len(sampler) == -(-(103 - 8 * size) // size),
            f"{len(sampler)} samples per rank for {103 - 8 * size} left on {size} ranks")
    _check_shards(hvd, c, sampler, "after restore and sync")
    sampler.set_epoch(1)
    _check_shards(hvd, c, sampler, "in the next epoch")
    hvd.shutdown()


def _check_shards(hvd, c, sampler, when):
    """The ranks' shards: equal lengths; the samples in their first ``len(remaining)``
    positions (rank r's k-th sample is position k * size + r) are the epoch's remaining ones,
    each once; the padding after them never repeats a sample."""
    shards = hvd.allgather_object(list(sampler))
    remaining = sampler.remaining_indices
    c.check(all(r == remaining for r in hvd.allgather_object(remaining)),
            f"{when}: ranks disagree about the remaining samples")
    c.check(len({len(s) for s in shards}) == 1, f"{when}: shard lengths {map(len, shards)}")
    size = len(shards)
    by_position = [shards[p % size][p // size] for p in range(size * len(shards[0]))]
    real, padding = by_position[:len(remaining)], by_position[len(remaining):]
    c.check(sorted(real) == sorted(remaining) and len(set(real)) == len(real),
            f"{when}: the shards do not hold the remaining samples once each")
    c.check(len(set(padding)) == len(padding), f"{when}: padding repeats a sample: {padding}")


def torch_mismatch(c):
    import torch

    import spark_hvd.torch as hvd
    hvd.init()
    rank = hvd.rank()
    width = 5 if rank == 1 else 4
    model = torch.nn.Linear(width, 2)
    state = hvd.elastic.TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    c.raises("model mismatch", ValueError, state.sync,
             match=["rank 1", "model", "shape (2, 5)", "(2, 4)"])
    model = torch.nn.Linear(4, 2)
    params = list(model.parameters())[: 1 if rank == 1 else 2]
    state = hvd.elastic.TorchState(model, torch.optim.SGD(params, lr=0.1))
    c.raises("optimizer mismatch", ValueError, state.sync,
             match=["rank 1's optimizer has 1 tensors", "rank 0's 2"])
    sampler = hvd.elastic.ElasticSampler(list(range(40)))
    state = hvd.elastic.TorchState(sampler=sampler)
    state.sync()
    sampler.record_batch(0, 2)
    if rank == 1:
        sampler.record_batch(1, 2)  # uneven: rank 1 claims a batch the others never took
    state.commit()
    c.raises("sampler progress mismatch", ValueError, state.sync,
             match=["rank 1 recorded other progress", "record_batch"])
    other = hvd.elastic.ElasticSampler(list(range(40 + rank)))
    c.raises("dataset mismatch", ValueError, hvd.elastic.TorchState(sampler=other).sync,
             match=["dataset of"] if rank else ["rank 1 samples a dataset of 41"])
    # Nothing hangs and the job still runs collectives.
    got = hvd.allreduce(torch.ones(3), op=hvd.Sum)
    c.check(torch.equal(got, torch.full((3,), float(hvd.size()))), f"allreduce after: {got}")
    hvd.shutdown()


def size1(c):
    import torch

    import spark_hvd.torch as hvd
    from spark_hvd.torch.elastic import state as state_module
    hvd.init()
    c.check(hvd.size() == 1, "size1 mode runs on one rank")
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    state = hvd.elastic.TorchState(model, optimizer, scheduler=scheduler, log=[], epoch=0)
    state.sync()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, optimizer, 0)
    scheduler.step()
    state.log.append("step")
    state.epoch = 1
    state.restore()
    c.check(all(torch.equal(v, before[k]) for k, v in model.state_dict().items()),
            "model after restore")
    c.check(not optimizer.state, "optimizer slots after restore to a state without them")
    c.check(scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 1.0,
            f"scheduler/lr after restore {scheduler.last_epoch} {optimizer.param_groups[0]['lr']}")
    c.check(state.scheduler is scheduler, "restore replaced the scheduler object")
    c.check(state.log == [] and state.epoch == 0,
            f"an in-place change survived restore: {state.log} {state.epoch}")
    state.log.append("kept")
    state.commit()
    state.log.append("dropped")
    state.restore()
    c.check(state.log == ["kept"], f"commit/restore of a list: {state.log}")
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(1))  # creates its scale tensor
    s2 = hvd.elastic.TorchState(scaler=scaler)
    scaler.update(4.0)
    s2.restore()
    c.check(scaler.get_scale() == 8.0, f"grad scaler after restore {scaler.get_scale()}")
    obj = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=3, names=["a"])
    obj.step, obj.names = 4, ["b"]
    obj.restore()
    c.check((obj.step, obj.names) == (3, ["a"]), "ObjectState restore")
    obj.step = 5
    obj.commit()
    obj.sync()
    c.check(obj.step == 5, "ObjectState commit then sync")
    c.check([cls for cls, _ in state_module.get_handler_registry()][:3] ==
            [torch.nn.Module, torch.optim.Optimizer, hvd.elastic.ElasticSampler],
            "Horovod's handler registry order")

    class Box:
        value = 1

    class BoxHandler(state_module.StateHandler):  # a handler written for Horovod
        def save(self):
            self._saved = self.value.value

        def restore(self):
            self.value.value = self._saved

        def sync(self):
            pass

    registry = state_module.get_handler_registry()
    state_module.set_handler_registry(registry + [(Box, BoxHandler)])
    try:
        box = Box()
        s3 = hvd.elastic.TorchState(box=box)
        box.value = 7
        s3.restore()
        c.check(box.value == 1, "custom handler restore")
        s3.sync()
    finally:
        state_module.set_handler_registry(registry)
    hvd.shutdown()


def keras_sync(c):
    import keras
    import tensorflow as tf

    import spark_hvd.keras as hvd
    import spark_hvd.tensorflow as tfhvd
    hvd.init()
    rank = hvd.rank()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([np.full((3, 2), rank + 1.0, np.float32), np.zeros(2, np.float32)])
    optimizer = keras.optimizers.Adam(0.01)
    if rank == 0:  # rank 0 trained: Adam has slots; rank 1's optimizer is unbuilt (new worker)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.ones((2, 3))))
        optimizer.apply(tape.gradient(loss, model.trainable_variables),
                        model.trainable_variables)
    state = hvd.elastic.KerasState(model, optimizer, epoch=rank, batch=0)
    state.sync()
    values = [v.numpy() for v in optimizer.variables]
    every = hvd.allgather_object(values)
    c.check(all(len(v) == len(every[0]) and all(np.array_equal(a, b) for a, b in zip(v, every[0]))
                for v in every), "optimizer variables differ after sync")
    c.check(len(values) == 6, f"{len(values)} optimizer variables after sync (Adam: 6)")
    c.check(int(optimizer.iterations.numpy()) == 1, "iterations after sync")
    weights = hvd.allgather_object(model.get_weights())
    c.check(all(np.array_equal(a, b) for w in weights for a, b in zip(w, weights[0])),
            "weights differ after sync")
    c.check(state.epoch == 0, "epoch after sync")

    variables = [tf.Variable(float(rank + 5)), tf.Variable([rank] * 2, dtype=tf.int64)]
    tf_state = tfhvd.elastic.TensorFlowState(variables, step=rank)
    tf_state.sync()
    c.check(float(variables[0].numpy()) == 5.0 and list(variables[1].numpy()) == [0, 0]
            and tf_state.step == 0, "TensorFlowState sync")

    wide = keras.Sequential([keras.Input((4 if rank else 3,)), keras.layers.Dense(2)])
    c.raises("keras model mismatch", ValueError, hvd.elastic.KerasState(wide).sync,
             match=["rank 1's model tensor 0", "(4, 2)", "(3, 2)"])

    # The callbacks: epoch 0..1 in a first fit, a "reset" after epoch 1 (state committed at
    # epoch 2), then the rest in a second fit, both ways of resuming.
    x, y = np.ones((8, 3), np.float32), np.ones((8, 2), np.float32)
    for style in ("epochs_left", "initial_epoch"):
        fit_model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        fit_model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                          loss="mse")
        fit_state = hvd.elastic.KerasState(fit_model, batch=0, epoch=0)
        commits = []

        class Recording(hvd.elastic.CommitStateCallback):
            def commit(self):  # Horovod's overridable hook
                commits.append((fit_state.epoch, fit_state.batch))
                super().commit()

        def callbacks():
            return [hvd.elastic.UpdateEpochStateCallback(fit_state),
                    hvd.elastic.UpdateBatchStateCallback(fit_state),
                    Recording(fit_state, batches_per_commit=2)]

        epochs = 5
        fit_model.fit(x, y, batch_size=2, epochs=2, verbose=0, callbacks=callbacks())
        c.check((fit_state.epoch, fit_state.batch) == (2, 0),
                f"{style}: first fit left epoch {fit_state.epoch}, batch {fit_state.batch}")
        c.check(commits[:3] == [(0, 1), (0, 3), (1, 0)],
                f"{style}: commits seen by CommitStateCallback.commit: {commits[:3]}")
        if style == "epochs_left":
            fit_model.fit(x, y, batch_size=2, epochs=epochs - fit_state.epoch, verbose=0,
                          callbacks=callbacks())
        else:
            fit_model.fit(x, y, batch_size=2, initial_epoch=fit_state.epoch, epochs=epochs,
                          verbose=0, callbacks=callbacks())
        c.check(fit_state.epoch == epochs,
                f"{style}: after resuming, epoch {fit_state.epoch} (want {epochs})")
    hvd.shutdown()


def tf_lost_peer(c):
    import time

    import keras
    import tensorflow as tf

    import spark_hvd.keras as hvd
    import spark_hvd.tensorflow as tfhvd
    from spark_hvd.tensorflow.elastic import internal_error, raising_internal_errors
    hvd.init()
    rank = hvd.rank()

    @tf.function
    def allreduce_step(x):
        return hvd.allreduce(x, name="step")  # the op library's kernel

    @tf.function
    def broadcast_step(x):
        return tfhvd.broadcast(x, 0, name="bcast")  # a tf.numpy_function kernel

    x = tf.ones([64])
    allreduce_step(x)
    broadcast_step(x)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2, epochs=1, verbose=0)
    hvd.barrier()
    if rank == 1:
        time.sleep(0.3)
        os._exit(0)  # lost: no shutdown, no goodbye

    def loop(step):
        while True:
            step(x)

    for what, step in (("allreduce", allreduce_step), ("broadcast", broadcast_step)):
        try:
            raising_internal_errors(loop)(step)
        except hvd.HorovodInternalError as e:
            c.check("rank 1" in str(e), f"{what}: the error does not name the lost rank: {e}")
            c.check(isinstance(e.__cause__, tf.errors.OpError),
                    f"{what}: cause {type(e.__cause__)}")
        except Exception as e:  # noqa: BLE001
            c.fail(f"{what}: {type(e).__name__} instead of HorovodInternalError: {e}")

    def fit():
        model.fit(np.ones((400, 3)), np.ones((400, 1)), batch_size=2, epochs=1, verbose=0)
    c.raises("fit after a lost peer", hvd.HorovodInternalError, raising_internal_errors(fit))
    c.check(internal_error(tf.errors.UnknownError(None, None, "something else")) is None,
            "an unrelated UnknownError taken for a lost peer")
    qualified = internal_error(tf.errors.UnknownError(
        None, None, "x\nspark_hvd.common.exceptions.HorovodInternalError: why\nTraceback"))
    c.check(str(qualified) == "why", f"the qualified class name's line gave {qualified!r}")
    c.raises("an unrelated error propagates", tf.errors.UnknownError,
             raising_internal_errors(lambda: (_ for _ in ()).throw(
                 tf.errors.UnknownError(None, None, "other"))))
    c.finish(lost="yes")
    sys.stdout.flush()
    os._exit(0)


def main():
    mode = sys.argv[1]
    c = Checks(int(os.environ.get("SPARK_HVD_RANK", "0")))
    globals()[mode](c)
    c.finish()


if __name__ == "__main__":
    main()
