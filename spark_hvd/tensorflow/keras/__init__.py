"""``spark_hvd.tensorflow.keras`` is ``spark_hvd.keras`` (Horovod's two Keras namespaces, one
implementation): ``import spark_hvd.tensorflow.keras as hvd`` works as Horovod's did."""

from ...keras import *  # noqa: F401,F403
from ...keras import __all__, callbacks  # noqa: F401
from . import elastic  # noqa: F401
