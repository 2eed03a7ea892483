"""TensorBoard event files of a fit, written by rank 0 for every framework.

One writer for TorchEstimator, KerasEstimator and LightningEstimator: scalars only, through
TensorBoard's own event-file writer (no TensorFlow or ``torch.utils.tensorboard`` needed). The
files go under the Store's ``runs/<run_id>/logs/`` (Horovod's ``get_logs_subdir``), in
``train/`` and ``validation/`` as Keras' TensorBoard callback lays them out, so that
``tensorboard --logdir <store>/runs`` draws a metric's training and validation curves on one
chart:

    train/       epoch_<metric> per epoch (val_ metrics excluded), epoch_rows_per_second,
                 batch_loss per training step (global step across epochs)
    validation/  epoch_<metric> per epoch for every val_<metric>

A Store on a local filesystem gets the files directly (TensorBoard shows them while training
runs: they are flushed every epoch); any other Store gets a copy of the local files after
every epoch and at the end. The loss of every step is written as it comes (Torch: that step's
loss; Keras: the running mean over the epoch that Keras reports, as Keras' own TensorBoard
callback writes it).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time

SPLITS = ("train", "validation")


def split_metric(name: str) -> tuple[str, str]:
    """(split, tag) of a history key: ``val_loss`` -> (``validation``, ``epoch_loss``)."""
    if name.startswith("val_"):
        return "validation", "epoch_" + name[len("val_"):]
    return "train", "epoch_" + name


class ScalarWriter:
    """Scalar summaries of one run into ``<logdir>/train`` and ``<logdir>/validation``, each
    one event file (TFRecord framing of ``Event`` protos) written with plain file I/O.

    TensorBoard's ``EventFileWriter`` opens its file through ``tf.io.gfile``, which imports
    TensorFlow whenever it is installed: seconds on a PyTorch rank, for a local file."""

    _files_opened = 0

    def __init__(self, logdir: str):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter
        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._record_writer = RecordWriter
        self.logdir = logdir
        self._files = {}

    def _writer(self, split: str):
        entry = self._files.get(split)
        if entry is None:
            directory = os.path.join(self.logdir, split)
            os.makedirs(directory, exist_ok=True)
            ScalarWriter._files_opened += 1
            # TensorBoard's naming: it reads every events.out.tfevents.* file of a directory.
            name = (f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}."
                    f"{os.getpid()}.{ScalarWriter._files_opened}")
            file = open(os.path.join(directory, name), "wb")
            writer = self._record_writer(file)
            writer.write(self._event_pb2.Event(wall_time=time.time(),
                                               file_version="brain.Event:2")
                         .SerializeToString())
            entry = self._files[split] = (file, writer)
        return entry[1]

    def scalar(self, split: str, tag: str, value: float, step: int) -> None:
        summary = self._summary_pb2.Summary(
            value=[self._summary_pb2.Summary.Value(tag=tag, simple_value=float(value))])
        self._writer(split).write(self._event_pb2.Event(
            wall_time=time.time(), step=int(step), summary=summary).SerializeToString())

    def flush(self) -> None:
        for file, _ in self._files.values():
            file.flush()

    def close(self) -> None:
        for file, _ in self._files.values():
            file.close()
        self._files = {}


class RunLogs:
    """Rank 0's TensorBoard logs of a run in the Store: ``step`` per training step, ``epoch``
    per epoch, ``close`` at the end. Files land in the Store directly when it is a local
    directory, else in a scratch directory copied to the Store after every epoch."""

    def __init__(self, store, run_id: str):
        self.store = store
        self.target = store.get_logs_path(run_id)
        local = _local_path(store, self.target)
        self._scratch = None if local is not None else tempfile.mkdtemp(prefix="spark_hvd_tb_")
        self.writer = ScalarWriter(local if local is not None else self._scratch)

    def step(self, global_step: int, loss: float) -> None:
        self.writer.scalar("train", "batch_loss", loss, global_step)

    def epoch(self, epoch: int, metrics: dict, rows_per_second: float | None) -> None:
        for name, value in metrics.items():
            split, tag = split_metric(name)
            self.writer.scalar(split, tag, value, epoch)
        if rows_per_second:
            self.writer.scalar("train", "epoch_rows_per_second", rows_per_second, epoch)
        self.writer.flush()
        self._upload()

    def close(self) -> None:
        self.writer.close()
        self._upload()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    def _upload(self) -> None:
        """Copies the scratch directory's event files to the Store (whole files: they are
        small, and a copy that is rewritten stays readable)."""
        if self._scratch is None:
            return
        for split in os.listdir(self._scratch):
            for name in os.listdir(os.path.join(self._scratch, split)):
                with open(os.path.join(self._scratch, split, name), "rb") as f:
                    data = f.read()
                self.store.write_bytes(self.store.join(self.target, split, name), data)


def _local_path(store, path: str) -> str | None:
    """``path`` as a local directory when the Store's filesystem is the local one."""
    try:
        import pyarrow.fs as pafs
        if isinstance(store.filesystem, pafs.LocalFileSystem):
            return store.fs_path(path)
    except (ImportError, AttributeError):
        pass
    return None


def open_run_logs(store, run_id: str):
    """Rank 0's :class:`RunLogs`, or None (with the reason) when TensorBoard's package is not
    installed: the fit then trains without event files."""
    try:
        return RunLogs(store, run_id), None
    except ImportError as error:
        return None, (f"TensorBoard event files are not written: the 'tensorboard' package "
                      f"is not installed ({error}); pip install tensorboard")
