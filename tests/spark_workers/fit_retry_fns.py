"""Callbacks that kill a rank's own Spark executor once, mid-fit (tests/test_fit_retry.py).
The tests register this module with cloudpickle by value, so the ranks need not import it."""

import os
import signal
import time


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def kill_own_executor(marker: str) -> None:
    """SIGKILL the executor JVM this process runs under (once: ``marker`` records it), then
    wait to go down with it."""
    if os.path.exists(marker):
        return
    pid = os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"CoarseGrainedExecutorBackend" in f.read():
                with open(marker, "w") as out:
                    out.write(f"{pid} {time.time()}")
                os.kill(pid, signal.SIGKILL)
                time.sleep(120)   # the task and this process go with the executor
                return
        pid = _parent_of(pid)
    raise RuntimeError("this process runs under no Spark executor JVM")


class KillExecutorTorch:
    """A TorchEstimator callback: at the start of ``epoch`` on ``rank``."""

    def __init__(self, marker, epoch=1, rank=1):
        self.marker, self.epoch, self.rank = marker, epoch, rank

    def on_epoch_begin(self, epoch):
        import spark_hvd.torch as hvd
        if epoch == self.epoch and hvd.rank() == self.rank:
            kill_own_executor(self.marker)


def wait_for_a_checkpoint(store, run_id, timeout=60.0):
    """Until rank 0 has written run ``run_id``'s first checkpoint: rank 1 may begin the next
    epoch while rank 0 still writes it, and a kill then would abort the write (the fit then
    rightly starts over, which is not the case under test)."""
    deadline = time.monotonic() + timeout
    while not store.list_checkpoints(run_id) and time.monotonic() < deadline:
        time.sleep(0.1)


def keras_killer(marker, store, run_id, epoch=1, rank=1):
    import keras

    class KillExecutorKeras(keras.callbacks.Callback):
        def on_epoch_begin(self, e, logs=None):
            import spark_hvd.keras as hvd
            if e == epoch and hvd.rank() == rank and not os.path.exists(marker):
                wait_for_a_checkpoint(store, run_id)
                kill_own_executor(marker)

    return KillExecutorKeras()


def lightning_killer(marker, store, run_id, epoch=1, rank=1):
    import lightning as L

    class KillExecutorLightning(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            if (trainer.current_epoch == epoch and trainer.global_rank == rank
                    and not os.path.exists(marker)):
                wait_for_a_checkpoint(store, run_id)
                kill_own_executor(marker)

    return KillExecutorLightning()
