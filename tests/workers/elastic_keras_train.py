"""An elastic Keras training script (run by spark-hvd-run --min-np ...): KerasState and the
state callbacks under hvd.elastic.run, resuming with fit(initial_epoch=state.epoch) (the form
Horovod counted twice, #2844). Each rank prints ``EPOCH rank=R size=S epoch=E`` at the end of
every epoch (from state.epoch) and at the end ``DONE rank=R size=S epoch=E fits=F
weights_equal=True|False backend=B`` (KERAS_BACKEND picks the backend).

Environment: KILL_HOST / KILL_EPOCH (the worker on that host SIGKILLs itself in that epoch),
GROW_MARKER / GROW_EPOCH (rank 0 creates that file at the start of that epoch).
"""

import os
import signal
import time

import keras
import numpy as np

import spark_hvd.keras as hvd

EPOCHS, STEPS = 6, 8
HOST = os.environ.get("HOROVOD_HOSTNAME", "")

hvd.init()
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
state = hvd.elastic.KerasState(model, batch=0, epoch=0)
x, y = np.ones((STEPS * 2, 3), np.float32), np.ones((STEPS * 2, 1), np.float32)
fits = [0]


class Events(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if hvd.rank() == 0 and int(os.environ.get("GROW_EPOCH", -1)) == state.epoch:
            open(os.environ["GROW_MARKER"], "w").close()

    def on_train_batch_end(self, batch, logs=None):
        if HOST == os.environ.get("KILL_HOST") and int(os.environ.get("KILL_EPOCH", -1)) == \
                state.epoch and batch == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.1)

    def on_epoch_end(self, epoch, logs=None):
        print(f"EPOCH rank={hvd.rank()} size={hvd.size()} epoch={state.epoch}", flush=True)


@hvd.elastic.run
def train(state):
    fits[0] += 1
    model.fit(x, y, batch_size=2, initial_epoch=state.epoch, epochs=EPOCHS, verbose=0,
              callbacks=[Events(), hvd.elastic.UpdateEpochStateCallback(state),
                         hvd.elastic.UpdateBatchStateCallback(state),
                         hvd.elastic.CommitStateCallback(state, batches_per_commit=2)])


train(state)
weights = hvd.allgather_object(model.get_weights())
equal = all(np.array_equal(a, b) for w in weights for a, b in zip(w, weights[0]))
print(f"DONE rank={hvd.rank()} size={hvd.size()} epoch={state.epoch} fits={fits[0]} "
      f"weights_equal={equal} backend={keras.backend.backend()}", flush=True)
