# What the Keras snippet of the documentation leaves out: a model and a data set.
import keras
import numpy as np
import tensorflow as tf


def build_model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(2)])


_x = np.random.default_rng(0).normal(size=(128, 8)).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices((_x, (_x[:, 0] > 0).astype("int64"))).batch(32)
