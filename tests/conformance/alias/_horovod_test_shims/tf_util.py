"""``horovod.tensorflow.util._executing_eagerly``: TensorFlow test files branch on it."""

from tensorflow.python.eager import context


def _executing_eagerly():
    """Whether TensorFlow runs eagerly here."""
    return context.executing_eagerly()
