"""Experiment tracking of a fit (MLflow), on the driver.

``track_fit`` wraps one ``fit``: it sees the progress events rank 0 sends (through the fit's
``ProgressSink``) and the trained model. This first version tracks nothing; MLflow logging
is built on these two hooks.
"""

from __future__ import annotations

import contextlib


class _NoTracking:
    def log_model(self, model) -> None:
        """Logs the trained model (a Transformer of this package)."""


@contextlib.contextmanager
def track_fit(estimator, run_id: str, sink):
    """Tracks one fit of ``estimator`` (run ``run_id``, progress through ``sink``)."""
    yield _NoTracking()
