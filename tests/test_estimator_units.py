"""Estimator pieces that need no Spark job: progress rendering, Param accessors, batch
reshaping and Arrow conversion."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")

from spark_hvd.estimators import _progress  # noqa: E402
from spark_hvd.estimators.data._arrays import arrow_to_numpy, reshape_batch  # noqa: E402


def _event(kind, **fields):
    return f"[0]<stdout>: {_progress.MARKER}{json.dumps({'event': kind, **fields})}\n"


def test_progress_sink_prints_one_line_per_epoch_and_passes_other_output():
    out = io.StringIO()
    sink = _progress.ProgressSink(out, verbose=1)
    sink.write("[1]<stdout>: a user print\n")
    sink.write(_event("epoch_start", epoch=0, epochs=2, steps=3))
    sink.write(_event("step", steps=1, loss=0.5))
    sink.write(_event("epoch_end", epoch=0, epochs=2, metrics={"loss": 0.25, "val_loss": 0.5},
                      rows_per_second=1234.0))
    lines = out.getvalue().splitlines()
    assert lines == ["[1]<stdout>: a user print",
                     "Epoch 1/2 - loss: 0.2500 - val_loss: 0.5000 - 1,234 rows/s"]
    assert sink.epochs_seen[0]["metrics"]["loss"] == 0.25


def test_progress_sink_verbose_levels():
    quiet = io.StringIO()
    sink = _progress.ProgressSink(quiet, verbose=0)
    sink.write("[0]<stdout>: hidden\n[0]<stderr>: a warning\n")
    sink.write(_event("epoch_end", epoch=0, epochs=1, metrics={"loss": 1.0}))
    assert quiet.getvalue() == "[0]<stderr>: a warning\n"

    bar = io.StringIO()
    sink = _progress.ProgressSink(bar, verbose=2)
    sink.write(_event("epoch_start", epoch=0, epochs=1, steps=4))
    for _ in range(4):
        sink.write(_event("step", steps=1, loss=0.75))
    sink.write(_event("epoch_end", epoch=0, epochs=1, metrics={"loss": 0.75}))
    sink.close()
    text = bar.getvalue()
    assert "4/4" in text and "loss=0.7500" in text          # the tqdm bar
    assert "Epoch 1/1 - loss: 0.7500" in text


def test_param_accessors_and_unknown_keywords():
    torch = pytest.importorskip("torch")
    from spark_hvd.estimators import TorchEstimator
    est = TorchEstimator(batch_size=7, feature_cols="x")
    assert est.getBatchSize() == 7 and est.getFeatureCols() == ["x"]
    assert est.setEpochs(3) is est and est.getEpochs() == 3
    assert est.getScaleLearningRate() is False and est.getReader() == "arrow"
    with pytest.raises(TypeError, match="unknown parameter.*'batchsize'"):
        TorchEstimator(batchsize=7)
    # Horovod's spellings of some accessors
    assert est.setShufflingBufferSize(100) is est and est.getShuffleBufferSize() == 100
    assert est.setTrainReaderNumWorker(3).getTrainReaderNumWorkers() == 3
    assert est.setValReaderNumWorker(4).getValReaderNumWorker() == 4
    assert est.setInMemoryCacheAll(True).getInmemoryCacheAll() is True
    assert est.getFeatureColumns() == ["x"]
    from spark_hvd.estimators import TorchModel
    model = TorchModel(feature_cols=["a"])
    assert model.setLabelColoumns(["y"]).getLabelColumns() == ["y"] == model.getLabelCols()
    assert torch is not None


def test_spark_backend_arguments():
    from spark_hvd.estimators import SparkBackend
    backend = SparkBackend(num_proc=3, prefix_output_with_timestamp=True)
    assert backend.num_processes() == 3
    assert backend.run_kwargs == {"prefix_output_with_timestamp": True}
    with pytest.raises(TypeError, match="unknown argument.*'num_procs'"):
        SparkBackend(num_procs=2)


def test_reshape_batch():
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    assert reshape_batch(x, [-1, 2, 3]).shape == (2, 2, 3)
    assert reshape_batch(x, [3, 2]).shape == (2, 3, 2)
    assert reshape_batch(x, None) is x


def test_arrow_to_numpy():
    nested = pa.array([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]])
    out = arrow_to_numpy(nested, [2, 2], "float32", "grid")
    assert out.dtype == np.float32 and out.shape == (2, 2, 2) and out[1, 1, 0] == 7.0
    with pytest.raises(ValueError, match="'grid'.*null"):
        arrow_to_numpy(pa.array([[1.0, 2.0], None]), [2], "float32", "grid")
    with pytest.raises(ValueError, match="expected \\[3\\] values per row"):
        arrow_to_numpy(pa.array([[1.0, 2.0], [3.0, 4.0]]), [3], "float32", "v")
    with pytest.raises(ValueError, match="'v' has null values inside"):
        arrow_to_numpy(pa.array([[1.0, None], [3.0, 4.0]]), [2], "float32", "v")


def test_torch_loss_is_horovods():
    """Several labels: weighted by loss_weights, by default their mean; sample weights: the
    batch mean of each row's loss times its weight (Horovod's formulas)."""
    torch = pytest.importorskip("torch")
    from spark_hvd.estimators.rank._torch import _make_loss
    mse = torch.nn.functional.mse_loss
    out = [torch.tensor([[1.0], [2.0]]), torch.tensor([[0.0], [4.0]])]
    lab = [torch.tensor([[0.0], [0.0]]), torch.tensor([[1.0], [1.0]])]
    first, second = (1 + 4) / 2, (1 + 9) / 2
    assert float(_make_loss([mse, mse], None)(out, lab)) == pytest.approx((first + second) / 2)
    assert float(_make_loss([mse, mse], [1.0, 0.5])(out, lab)) == \
        pytest.approx(first + 0.5 * second)
    w = torch.tensor([1.0, 3.0])
    got = float(_make_loss([mse], None)(out[:1], lab[:1], w))
    assert got == pytest.approx((1 * 1.0 + 4 * 3.0) / 2)


# -- transformation_fn in spark_hvd's and Horovod's styles ------------------------------------

def _batch():
    return {"x": np.arange(12, dtype=np.float32).reshape(3, 4),
            "y": np.array([1.0, 2.0, 3.0]), "w": np.ones(3)}


def test_transformation_numpy_style_is_kept():
    from spark_hvd.estimators.data._transformation_fn import make_batch_transform
    calls = []

    def double(batch):
        calls.append(type(batch).__name__)
        batch["x"] = batch["x"] * 2
        return batch
    transform = make_batch_transform(double)
    for _ in range(2):
        out = transform(_batch())
        np.testing.assert_array_equal(out["x"], _batch()["x"] * 2)
    assert transform.style == "numpy" and calls == ["dict", "dict"]


def test_transformation_horovod_pandas_style_is_detected():
    from spark_hvd.estimators.data._transformation_fn import make_batch_transform
    seen = []

    def horovod_fn(pdf):            # Petastorm's TransformSpec with make_batch_reader
        seen.append(type(pdf).__name__)
        pdf["x"] = pdf["x"].map(lambda v: v + 1)      # .map: a pandas Series only
        pdf["y"] = pdf["y"] * 10
        return pdf
    transform = make_batch_transform(horovod_fn)
    out = transform(_batch())
    # Offered as a dict first (it failed there), then as a DataFrame.
    assert transform.style == "pandas" and seen == ["dict", "DataFrame"]
    np.testing.assert_array_equal(out["x"], _batch()["x"] + 1)
    assert out["x"].shape == (3, 4) and out["x"].dtype == np.float32
    np.testing.assert_array_equal(out["y"], [10.0, 20.0, 30.0])
    transform(_batch())
    assert seen == ["dict", "DataFrame", "DataFrame"]       # decided once


def test_transformation_horovod_row_style_is_detected():
    from spark_hvd.estimators.data._transformation_fn import make_batch_transform

    def row_fn(row):                # Petastorm's TransformSpec with make_reader: one row
        return {"x": row["x"].reshape(2, 2), "y": float(row["y"]) + 1, "w": row["w"]}
    transform = make_batch_transform(row_fn)
    out = transform(_batch())
    assert transform.style == "rows"
    assert out["x"].shape == (3, 2, 2)
    np.testing.assert_array_equal(out["y"], [2.0, 3.0, 4.0])


def test_transformation_edit_and_removed_fields():
    from spark_hvd.estimators.data._transformation_fn import make_batch_transform

    def add_column(pdf):
        pdf["z"] = pdf["x"].map(lambda v: v[:2])
        return pdf
    transform = make_batch_transform(add_column, edit_fields=[("z", np.float64, (2, 1), False)],
                                     removed_fields=["w"])
    out = transform(_batch())
    assert transform.style == "pandas"     # edit fields: a TransformSpec function
    assert set(out) == {"x", "y", "z"}
    assert out["z"].dtype == np.float64 and out["z"].shape == (3, 2, 1)
    with pytest.raises(ValueError, match="not a .name, numpy_dtype, shape"):
        make_batch_transform(add_column, edit_fields=["z"])
    with pytest.raises(ValueError, match="transformation_fn is not"):
        make_batch_transform(None, removed_fields=["w"])


def test_transformation_errors_name_every_style():
    from spark_hvd.estimators.data._transformation_fn import make_batch_transform

    def broken(batch):
        raise KeyError("no_such_column")
    with pytest.raises(ValueError, match="as a dict of NumPy arrays.*as a pandas DataFrame.*"
                                         "one row at a time"):
        make_batch_transform(broken)(_batch())
    with pytest.raises(ValueError, match="without one value per batch row"):
        make_batch_transform(lambda b: {"x": b["x"][:1]}, style="numpy")(_batch())


def test_horovod_params_accessors_and_keywords():
    pytest.importorskip("torch")
    from spark_hvd.estimators import TorchEstimator, TorchModel
    est = TorchEstimator(reader_pool_type="process", compress_sparse_cols=True,
                         continuous_cols=["a"], categorical_cols="b", mp_start_method="spawn",
                         tensorflow_dataset_prefetch_buffer_size=0,
                         transformation_edit_fields=[("x", np.float32, (4,), False)],
                         transformation_removed_fields=["w"])
    assert (est.getReaderPoolType(), est.getCompressSparseCols(), est.getContinuousCols(),
            est.getCategoricalCols(), est.getMpStartMethod(),
            est.getTensorflowDatasetPrefetchBufferSize()) == \
        ("process", True, ["a"], ["b"], "spawn", 0)
    model = TorchModel(feature_columns=["f"], label_columns=["y"], _metadata={"k": 1},
                       loss="l", loss_constructors=None)
    assert model.getFeatureColumns() == model.getFeatureCols() == ["f"]
    assert model.getLabelColumns() == ["y"] and model._get_metadata() == {"k": 1}
    assert model.getLoss() == "l" and model.getLossConstructors() is None
    assert model.getOptimizer() is None
    with pytest.raises(TypeError, match="not both"):
        TorchModel(feature_cols=["f"], feature_columns=["f"])
