"""Horovod's ``horovod.spark.common`` module paths (``store``, ``backend``) for estimator
scripts; the classes live in :mod:`spark_hvd.estimators`."""
