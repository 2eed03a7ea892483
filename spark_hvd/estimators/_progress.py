"""Training progress, from rank 0 to the driver: the driver's end.

Rank 0 prints one marked JSON line per event on its stdout (``rank/_progress.report``);
``spark.run`` forwards every line of the ranks to the driver, where :class:`ProgressSink` (the
stream given to ``run``) turns the marked lines into one line per epoch (``verbose=1``) or a
tqdm bar (``verbose=2``) and passes everything else through. No extra connection or port is
needed for progress.

Listeners (``ProgressSink.add_listener``) see every event as it arrives, whatever the
verbosity: experiment tracking logs each epoch's metrics from there while training runs.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from .rank._progress import MARKER


def format_metrics(metrics: dict) -> str:
    return " - ".join(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}"
                      for k, v in metrics.items())


class ProgressSink:
    """A text stream for ``spark.run(stdout=...)`` that renders progress events."""

    def __init__(self, out=None, verbose: int = 1):
        self.out = out if out is not None else sys.stdout
        self.verbose = verbose
        self.epochs_seen = []          # every epoch event, in order (used by tests and fit)
        self._bar = None
        self._lock = threading.Lock()
        self._epoch_started = time.monotonic()
        self._listeners = []

    def add_listener(self, listener) -> None:
        """Calls ``listener(kind, fields)`` for every progress event from now on (on the thread
        that forwards the ranks' output). An exception in a listener is printed once and the
        listener dropped: tracking must not break the training it watches."""
        self._listeners.append(listener)

    def _notify(self, kind: str, event: dict) -> None:
        for listener in list(self._listeners):
            try:
                listener(kind, dict(event))
            except Exception as error:  # noqa: BLE001 - see add_listener
                self._listeners.remove(listener)
                sys.stderr.write(f"spark_hvd: progress listener {listener!r} failed and was "
                                 f"removed: {type(error).__name__}: {error}\n")

    def write(self, text: str) -> int:
        with self._lock:
            for line in text.splitlines(keepends=True):
                self._line(line)
        return len(text)

    def flush(self) -> None:
        try:
            self.out.flush()
        except (ValueError, OSError):
            pass

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def _line(self, line: str) -> None:
        at = line.find(MARKER)
        if at < 0:
            if self.verbose >= 1 or "<stderr>" in line[:24]:
                self.out.write(line)
            return
        try:
            event = json.loads(line[at + len(MARKER):])
        except ValueError:
            self.out.write(line)
            return
        kind = event.pop("event", "")
        self._notify(kind, event)
        if kind == "epoch_start":
            self._epoch_started = time.monotonic()
            if self.verbose >= 2:
                self._open_bar(event)
        elif kind == "step" and self._bar is not None:
            self._bar.update(event.get("steps", 1))
            if "loss" in event:
                self._bar.set_postfix(loss=f"{event['loss']:.4f}")
        elif kind == "epoch_end":
            self.epochs_seen.append(event)
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            if self.verbose >= 1:
                self.out.write(self.epoch_line(event) + "\n")
                self.flush()
        elif kind == "message" and self.verbose >= 1:
            self.out.write(f"spark_hvd: {event.get('text', '')}\n")

    @staticmethod
    def epoch_line(event: dict) -> str:
        head = f"Epoch {event['epoch'] + 1}/{event['epochs']}"
        rate = event.get("rows_per_second")
        tail = f" - {rate:,.0f} rows/s" if rate else ""
        return f"{head} - {format_metrics(event.get('metrics', {}))}{tail}"

    def _open_bar(self, event):
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=event.get("steps"), file=self.out, leave=False,
                         desc=f"Epoch {event['epoch'] + 1}/{event['epochs']}")
