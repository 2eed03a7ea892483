"""The ``spark-hvd-run`` launcher (also ``python -m spark_hvd.runner``).

Kept import-light on purpose: the launcher must start without torch, TensorFlow or the native
core. The entry point is :func:`spark_hvd.runner.launch.main`.
"""
