"""model.plot_history / estimators._history.plot_history: the history drawn to PNG and SVG, and
the error naming matplotlib when it is missing (hidden in a subprocess)."""

import pytest
from hide_package import run_without

from spark_hvd.estimators import _history

HISTORY = {"loss": [0.9, 0.5, 0.31], "accuracy": [0.41, 0.7, 0.83],
           "val_loss": [1.0, 0.6, 0.44], "val_accuracy": [0.38, 0.66, 0.79],
           "rows_per_epoch": [100.0, 100.0, 100.0]}


def test_panels_pair_train_and_validation_loss_first():
    history = {"accuracy": [1.0], "val_accuracy": [1.0], "val_loss": [2.0], "loss": [2.0],
               "val_only": [3.0]}
    assert _history.metric_panels(history) == [
        ("loss", "loss", "val_loss"), ("accuracy", "accuracy", "val_accuracy"),
        ("only", None, "val_only")]
    assert _history.metric_panels(history, "accuracy") == [
        ("accuracy", "accuracy", "val_accuracy")]
    with pytest.raises(ValueError, match=r"no metric\(s\) \['auc'\].*'loss'"):
        _history.metric_panels(history, ["auc"])


def test_png_and_svg_show_every_metric(tmp_path):
    png = _history.plot_history(HISTORY, str(tmp_path / "sub" / "history.png"), title="run 7")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    svg = str(tmp_path / "history.svg")
    _history.plot_history(HISTORY, svg)
    text = open(svg).read()
    # matplotlib writes the text of titles and legends as comments next to the glyph paths.
    for word in ("loss", "accuracy", "rows_per_epoch", "train", "validation", "epoch"):
        assert f"<!-- {word} -->" in text, word
    # Two curves in each paired panel, one in the unpaired one: 5 lines (plus legend samples).
    assert text.count('id="line2d_') >= 5
    only_loss = str(tmp_path / "loss.svg")
    _history.plot_history(HISTORY, only_loss, metrics=["loss"])
    assert "<!-- accuracy -->" not in open(only_loss).read()


def test_model_plot_history_uses_its_history(tmp_path):
    torch = pytest.importorskip("torch")
    from spark_hvd.estimators import TorchModel
    model = TorchModel(model=torch.nn.Linear(2, 1), feature_cols=["x"], label_cols=["y"],
                       history=HISTORY, run_id="torch_run_1")
    path = model.plot_history(str(tmp_path / "h.svg"))
    text = open(path).read()
    assert "<!-- torch_run_1 -->" in text and "<!-- val_accuracy -->" not in text
    with pytest.raises(ValueError, match="history is empty"):
        TorchModel(model=torch.nn.Linear(2, 1)).plot_history(str(tmp_path / "none.png"))


def test_missing_matplotlib_is_named(tmp_path):
    proc = run_without("matplotlib", f"""
        from spark_hvd.estimators import _history
        assert not _history.matplotlib_available()
        try:
            _history.plot_history({{"loss": [1.0]}}, {str(tmp_path / 'x.png')!r})
        except ImportError as error:
            print("ERROR:", error)
        else:
            print("NO ERROR")
    """)
    assert proc.returncode == 0, proc.stderr
    assert "ERROR: plot_history needs matplotlib, which is not installed: pip install " \
           "matplotlib" in proc.stdout, proc.stdout
    assert not (tmp_path / "x.png").exists()
