"""Forwarding the ranks' output to the launcher's terminal, one whole line at a time.

Each rank's stdout and stderr are read by a thread of their own; every line is written with the
rank in front (``[0]<stdout>: ...``) in a single locked write, so lines of different ranks never
mix within a line. Pipes are always drained, even when the launcher's own output is gone, so a
rank never blocks on a full pipe.
"""

from __future__ import annotations

import datetime
import os
import threading
from typing import BinaryIO


class LineSink:
    """One of the launcher's output streams, shared by all forwarding threads."""

    def __init__(self, stream):
        self._binary = getattr(stream, "buffer", None)
        self._text = stream
        self._lock = threading.Lock()
        self._broken = False

    def write_line(self, line: bytes) -> None:
        """Write ``line`` (ending in a newline) atomically with respect to other threads."""
        with self._lock:
            if self._broken:
                return
            try:
                if self._binary is not None:
                    self._binary.write(line)
                    self._binary.flush()
                else:  # a text-only stream (e.g. replaced sys.stdout in tests)
                    self._text.write(line.decode("utf-8", errors="replace"))
                    self._text.flush()
            except (BrokenPipeError, ValueError):
                # Our reader went away (`| head`) or the stream is closed: keep draining the
                # ranks' pipes but stop writing.
                self._broken = True


def line_prefix(rank: int, stream_name: str, timestamp: bool = False) -> bytes:
    """``[rank]<stream>: `` with, optionally, the local time in front."""
    prefix = f"[{rank}]<{stream_name}>: "
    if timestamp:
        now = datetime.datetime.now().isoformat(sep=" ", timespec="milliseconds")
        prefix = f"{now} {prefix}"
    return prefix.encode()


def _pump(pipe: BinaryIO, rank, stream_name: str, sink: LineSink,
          copy_to: BinaryIO | None, timestamp: bool) -> None:
    try:
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"  # the last line of a rank that did not end it
            if copy_to is not None:
                copy_to.write(line)
                copy_to.flush()
            label = rank() if callable(rank) else rank
            if label is not None:
                line = line_prefix(label, stream_name, timestamp) + line
            sink.write_line(line)
    finally:
        pipe.close()
        if copy_to is not None:
            copy_to.close()


def forward(pipe: BinaryIO, rank, stream_name: str, sink: LineSink,
            output_dir: str | None = None, timestamp: bool = False,
            dir_name: str | None = None) -> threading.Thread:
    """Start a daemon thread copying ``pipe`` to ``sink`` line by line until EOF.

    ``rank`` is the rank in the prefix, or a function that returns the current one (an elastic
    worker's rank changes from round to round), or None for no prefix (a Spark slot task: the
    driver, which knows the worker's current rank, adds it). With ``output_dir``, the raw lines also go to
    ``output_dir/<dir_name>/<stream_name>`` (``dir_name`` default: ``rank.N``).
    """
    copy_to = None
    if output_dir is not None:
        rank_dir = os.path.join(output_dir, dir_name or f"rank.{rank}")
        os.makedirs(rank_dir, exist_ok=True)
        copy_to = open(os.path.join(rank_dir, stream_name), "wb")
    thread = threading.Thread(target=_pump, args=(pipe, rank, stream_name, sink, copy_to,
                                                  timestamp),
                              name=f"spark-hvd-output-{dir_name or rank}-{stream_name}",
                              daemon=True)
    thread.start()
    return thread
