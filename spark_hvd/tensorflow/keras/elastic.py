"""``spark_hvd.tensorflow.keras.elastic`` is ``spark_hvd.keras.elastic`` (Horovod's two Keras
namespaces, one implementation)."""

from ...keras.elastic import *  # noqa: F401,F403
from ...keras.elastic import __all__  # noqa: F401
