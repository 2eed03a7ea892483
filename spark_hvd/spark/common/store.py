"""Horovod's module path for the Stores: ``from horovod.spark.common.store import Store``
becomes ``from spark_hvd.spark.common.store import Store``. The classes live in
:mod:`spark_hvd.estimators.store`."""

from spark_hvd.estimators.store import (DBFSLocalStore, FilesystemStore, HDFSStore, LocalStore,
                                        Store)

__all__ = ["Store", "LocalStore", "DBFSLocalStore", "HDFSStore", "FilesystemStore"]
