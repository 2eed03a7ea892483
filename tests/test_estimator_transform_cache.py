"""Model.transform's fixed costs: the model is loaded once per Spark Python worker (not once
per task, nor again for a later transform of the same model), and the driver's own threading
setting is left alone."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip("pyspark")
torch = pytest.importorskip("torch")

import cloudpickle  # noqa: E402

from spark_hvd.estimators import TorchModel  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(300)


class CountedLinear(torch.nn.Linear):
    """A Linear that appends "<pid> <in a task>" to a file whenever it is unpickled."""

    def __setstate__(self, state):
        super().__setstate__(state)
        from pyspark import TaskContext
        with open(self.loads_file, "a") as f:
            f.write(f"{os.getpid()} {TaskContext.get() is not None}\n")


def test_model_loaded_once_per_worker_and_driver_threads_kept(spark, tmp_path):
    torch.manual_seed(0)
    net = CountedLinear(3, 2)
    net.loads_file = str(tmp_path / "loads.txt")
    model = TorchModel(model=net.eval(), feature_cols=["x"], label_cols=["y"],
                       training_metadata={"columns": {
                           "x": {"dtype": "float32", "shape": [3], "kind": "array"},
                           "y": {"dtype": "float32", "shape": [2], "kind": "array"}}})
    rows = [([float(i), 1.0, -float(i)], i) for i in range(64)]
    df = spark.createDataFrame(rows, ["x", "id"]).repartition(8)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        first = model.transform(df).orderBy("id").collect()
        second = model.transform(df.where("id < 40")).orderBy("id").collect()
        assert torch.get_num_threads() == 2       # the driver's setting is not the workers'
    finally:
        torch.set_num_threads(threads)
    expected = net(torch.tensor([r[0] for r in rows])).detach().numpy()
    np.testing.assert_allclose([r["y__output"] for r in first], expected, rtol=1e-6)
    assert [r["y__output"] for r in second] == [r["y__output"] for r in first[:40]]
    loads = [line.split() for line in open(tmp_path / "loads.txt").read().splitlines()]
    in_tasks = [pid for pid, task in loads if task == "True"]
    on_driver = [pid for pid, task in loads if task == "False"]
    # 8 + 1 tasks ran; the model was loaded once in each Python worker that ran them.
    assert len(in_tasks) == len(set(in_tasks)) and 1 <= len(in_tasks) <= 4, loads
    assert on_driver == [str(os.getpid())], loads     # the output shapes: once on the driver
