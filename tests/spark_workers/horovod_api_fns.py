"""Functions tests/test_estimator_horovod_api.py sends to the ranks (registered with cloudpickle
by value, so the ranks need not import this module)."""

import multiprocessing
import os

import numpy as np


def horovod_style_transform(pdf):
    """A transformation_fn as Horovod users write it: Petastorm's TransformSpec hands it a pandas
    DataFrame. Doubles the label (so the model must learn 2·w) and touches the array column
    with Series.map, which a dict of NumPy arrays does not have."""
    pdf["x"] = pdf["x"].map(lambda v: np.asarray(v, dtype=np.float32))
    pdf["label"] = pdf["label"] * 2.0
    return pdf


class StartMethodRecorder:
    """A Torch estimator callback writing each rank's multiprocessing start method."""

    def __init__(self, directory):
        self.directory = directory

    def on_train_begin(self, model, optimizer):
        import spark_hvd.torch as hvd
        with open(os.path.join(self.directory, f"rank{hvd.rank()}.txt"), "w") as f:
            f.write(multiprocessing.get_start_method())
