"""Training progress, from rank 0 to the driver: the rank's end. One marked JSON line per
event on stdout, which ``spark.run`` forwards to the driver, where ``ProgressSink``
(``estimators/_progress.py``) reads the lines that carry :data:`MARKER`."""

from __future__ import annotations

import json
import sys

MARKER = "@@spark_hvd.progress@@ "  # no control characters: str.splitlines splits on them


def report(event: str, **fields) -> None:
    """Called on rank 0: send one progress event to the driver."""
    sys.stdout.write(MARKER + json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()
