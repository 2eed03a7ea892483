"""Models, metrics and training steps the estimator tests send to the ranks. The tests register
this module with cloudpickle "by value", so the ranks need not import it."""

import os
import signal

import torch


class Linear(torch.nn.Module):
    """y = x·w + b on a feature vector."""

    def __init__(self, inputs=4):
        super().__init__()
        self.fc = torch.nn.Linear(inputs, 1)

    def forward(self, x):
        return self.fc(x).squeeze(-1)


class TwoInputs(torch.nn.Module):
    """Two feature columns (a vector and a 2-D array), two outputs."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 1)
        self.b = torch.nn.Linear(6, 1)

    def forward(self, vec, grid):
        return self.a(vec).squeeze(-1), self.b(grid.reshape(len(grid), -1)).squeeze(-1)


def mae(output, label):
    return (output - label).abs().mean()


def killing_minibatch(marker_dir, kill_epoch):
    """A train_minibatch_fn that SIGKILLs rank 1 at the first step of ``kill_epoch`` once (a
    marker file says it happened), and otherwise trains normally."""
    state = {"step": 0}

    def minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights):
        import spark_hvd.torch as hvd
        state["step"] += 1
        outputs = model(*inputs)
        outputs, labels = transform_outputs(outputs, labels)
        loss = loss_fn(outputs, labels, sample_weights)
        loss.backward()
        optimizer.step()
        done = os.path.join(marker_dir, "killed")
        steps_per_epoch = int(os.environ.get("TEST_STEPS_PER_EPOCH", "1"))
        epoch = (state["step"] - 1) // steps_per_epoch
        if hvd.rank() == 1 and epoch == kill_epoch and not os.path.exists(done):
            open(done, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return outputs, loss
    return minibatch


class RecordingCallback:
    """Writes what it saw on each rank to ``<directory>/rank<r>.log``."""

    def __init__(self, directory):
        self.directory = directory

    def _log(self, text):
        import spark_hvd.torch as hvd
        with open(os.path.join(self.directory, f"rank{hvd.rank()}.log"), "a") as f:
            f.write(text + "\n")

    def on_train_begin(self, model, optimizer):
        self._log(f"train_begin {type(model).__name__} {type(optimizer).__name__}")

    def on_epoch_begin(self, epoch):
        self._log(f"epoch_begin {epoch}")

    def on_epoch_end(self, epoch, metrics):
        self._log(f"epoch_end {epoch} {sorted(metrics)}")

    def on_train_end(self):
        self._log("train_end")
