"""Alias of ``spark_hvd.keras.callbacks``."""

from ...keras.callbacks import *  # noqa: F401,F403
from ...keras.callbacks import __all__  # noqa: F401
