"""A compatibility alias for saved Keras stages: a KerasEstimator or KerasModel saved before the
estimators' files moved into rooms pickled its model, optimizer, loss and metrics as
``spark_hvd.estimators._keras_remote.SavedModel`` / ``._KerasObject`` records, by that class
path. The code is now ``rank/_keras.py``; this module makes the old path that very module, so
such stages still load."""

import sys

from .rank import _keras

sys.modules[__name__] = _keras
