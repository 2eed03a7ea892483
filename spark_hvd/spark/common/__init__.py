"""Horovod's ``horovod.spark.common`` module paths (``store``, ``backend``, ``util``) for
estimator scripts; the classes live in :mod:`spark_hvd.estimators`."""
