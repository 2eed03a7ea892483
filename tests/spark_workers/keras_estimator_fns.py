"""Keras models, layers and metrics the KerasEstimator tests send to the ranks. The tests
register this module with cloudpickle "by value", so the ranks need not import it; the custom
layer is not registered with Keras, so loading a model that uses it needs custom_objects."""

import keras


class Scale(keras.layers.Layer):
    """Multiplies its input by a learned scalar (a custom layer for custom_objects)."""

    def build(self, input_shape):
        self.factor = self.add_weight(shape=(), initializer="ones", name="factor")

    def call(self, x):
        return x * self.factor


def abs_error(y_true, y_pred):
    """A metric that is a plain function (Keras names it after the function)."""
    return keras.ops.mean(keras.ops.abs(y_true - keras.ops.reshape(y_pred, keras.ops.shape(
        y_true))))


def linear_model(inputs=4, seed=0):
    """y = Scale(x·w + b) on a feature vector, one value per row."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((inputs,), name="features")
    y = Scale()(keras.layers.Dense(1)(x))
    return keras.Model(x, keras.layers.Reshape(())(y))


def two_in_two_out(seed=0):
    """A vector and a 2x3 grid in; two scalar outputs."""
    keras.utils.set_random_seed(seed)
    vec = keras.Input((4,), name="vec")
    grid = keras.Input((2, 3), name="grid")
    out1 = keras.layers.Reshape((), name="y1")(keras.layers.Dense(1)(vec))
    flat = keras.layers.Flatten()(grid)
    out2 = keras.layers.Reshape((), name="y2")(keras.layers.Dense(1)(flat))
    return keras.Model([vec, grid], [out1, out2])
