"""Horovod's module path for the Stores: ``from horovod.spark.common.store import Store``
becomes ``from spark_hvd.spark.common.store import Store``. The classes live in
:mod:`spark_hvd.estimators.store`."""

from spark_hvd.estimators.store import (AbstractFilesystemStore, DBFSLocalStore,
                                        FilesystemStore, HDFSStore, LocalStore, Store)

__all__ = ["Store", "AbstractFilesystemStore", "LocalStore", "DBFSLocalStore", "HDFSStore",
           "FilesystemStore"]
