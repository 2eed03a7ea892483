"""A picture of a fit's history: ``model.plot_history("history.png")``.

The history is what ``getHistory()`` returns, one list per metric with one value per epoch
(``{"loss": [...], "val_loss": [...], "accuracy": [...], ...}``). Each metric gets one panel
with its training curve and, when there is one, its validation curve (``val_<metric>``), loss
first. matplotlib is optional: it is imported only here, and a missing matplotlib is an
ImportError that names the package. The figure is drawn without pyplot (no GUI backend, no
global state), so it works in notebooks, on servers and on Spark's driver alike.
"""

from __future__ import annotations

import importlib.util
import math
import os

VAL_PREFIX = "val_"


def matplotlib_available() -> bool:
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):    # a finder that hides it, or a broken install
        return False


def metric_panels(history: dict, metrics=None) -> list[tuple[str, str | None, str | None]]:
    """(metric name, training key or None, validation key or None) per panel: every metric of
    ``history`` (or the ``metrics`` named), loss first, then in the history's order."""
    names = []
    for key in history:
        name = key[len(VAL_PREFIX):] if key.startswith(VAL_PREFIX) else key
        if name not in names:
            names.append(name)
    if metrics is not None:
        wanted = [metrics] if isinstance(metrics, str) else list(metrics)
        unknown = [m for m in wanted if m not in names]
        if unknown:
            raise ValueError(f"plot_history: no metric(s) {unknown} in the history (it has "
                             f"{names})")
        names = wanted
    names.sort(key=lambda name: name != "loss")     # stable: loss first, the rest as they came
    return [(name, name if name in history else None,
             VAL_PREFIX + name if VAL_PREFIX + name in history else None) for name in names]


def plot_history(history: dict, path: str, metrics=None, title: str | None = None,
                 dpi: int = 100) -> str:
    """Draws ``history`` (per-epoch metrics, as ``getHistory()`` returns them) into the image
    file ``path``; its extension picks the format (``.png``, ``.svg``, ``.pdf``, ...).
    ``metrics``: the metric names to draw (default: all; ``val_`` curves go with theirs).
    Returns ``path``. Needs matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("plot_history needs matplotlib, which is not installed: pip install "
                          f"matplotlib ({error})") from error
    if not history:
        raise ValueError("plot_history: the history is empty (the model was not trained by "
                         "a fit, or was saved without it)")
    panels = metric_panels(history, metrics)
    columns = min(len(panels), 2)
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(5.5 * columns, 3.6 * rows), layout="constrained")
    FigureCanvasAgg(figure)     # an in-memory canvas: savefig needs one, no display used
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, (name, train, val) in zip(axes, panels):
        for key, label, style in ((train, "train", "-o"), (val, "validation", "--s")):
            if key is None:
                continue
            values = [float(v) for v in history[key]]
            ax.plot(range(1, len(values) + 1), values, style, label=label, markersize=3)
        ax.set_title(name)
        ax.set_xlabel("epoch")
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    if title:
        figure.suptitle(title)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path
