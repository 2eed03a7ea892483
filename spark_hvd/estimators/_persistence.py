"""Save and load of estimators and models, inside Pipelines too (MLWritable / MLReadable).

A saved stage is a directory that Spark itself writes, so it can live wherever Spark can write
(local disk, HDFS, object stores) and be written from a classic or a Spark Connect session:

    <path>/metadata/   Spark's standard stage metadata (class, uid, the JSON-able Params)
    <path>/payload/    Parquet rows of (chunk, bytes): the cloudpickled rest (model with its
                       weights, optimizer, loss, Store, ...)

The model weights are inside the saved directory, so a saved model does not depend on the
Store it was trained with.
"""

from __future__ import annotations

import json

import cloudpickle
from pyspark.ml.util import (DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader,
                             MLWritable, MLWriter)

from ._params import param_values

FORMAT = "spark_hvd.stage.v1"
_CHUNK = 8 << 20   # bytes per payload row: keeps single rows small for Arrow and Connect


def _is_json_value(value) -> bool:
    if callable(value):
        return False
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def write_blob(spark, path: str, data: bytes, overwrite: bool) -> None:
    rows = [(i, data[start:start + _CHUNK])
            for i, start in enumerate(range(0, max(len(data), 1), _CHUNK))]
    frame = spark.createDataFrame(rows, schema="chunk int, data binary")
    frame.coalesce(1).write.mode("overwrite" if overwrite else "error").parquet(path)


def read_blob(spark, path: str) -> bytes:
    rows = spark.read.parquet(path).orderBy("chunk").collect()
    return b"".join(bytes(row["data"]) for row in rows)


class StageWriter(MLWriter):
    """Writes a spark_hvd estimator or model (see the module docstring for the layout)."""

    def __init__(self, instance):
        super().__init__()
        self.instance = instance

    def save(self, path: str) -> None:
        # MLWriter.save's overwrite goes through the JVM, which a Connect client has not:
        # overwrite is done by the writes themselves instead.
        self.saveImpl(path)

    def saveImpl(self, path: str) -> None:
        spark = self.sparkSession
        values = param_values(self.instance)
        explicit = {p.name for p in self.instance.params if self.instance.isSet(p)}
        json_params = {k: v for k, v in values.items() if k in explicit and _is_json_value(v)}
        objects = {k: v for k, v in values.items() if k in explicit and k not in json_params}
        metadata = DefaultParamsWriter._get_metadata_to_save(
            self.instance, spark, {"spark_hvd_format": FORMAT}, json_params)
        mode = "overwrite" if self.shouldOverwrite else "error"
        spark.createDataFrame([(metadata,)], schema="value string").coalesce(1) \
            .write.mode(mode).text(f"{path}/metadata")
        payload = {"params": self.instance._pack_params(objects),
                   "extra": self.instance._extra_state()}
        write_blob(spark, f"{path}/payload", cloudpickle.dumps(payload), self.shouldOverwrite)


class StageReader(MLReader):
    """Reads what :class:`StageWriter` wrote."""

    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        spark = self.sparkSession
        metadata = DefaultParamsReader.loadMetadata(path, spark)
        if metadata.get("spark_hvd_format") != FORMAT:
            raise ValueError(f"{path} does not hold a spark_hvd stage saved by this version "
                             f"(format {metadata.get('spark_hvd_format')!r}, expected {FORMAT})")
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        payload = cloudpickle.loads(read_blob(spark, f"{path}/payload"))
        instance._set(**instance._unpack_params(payload["params"]))
        instance._restore_extra_state(payload["extra"])
        return instance


class Persistable(MLWritable, MLReadable):
    """MLWritable + MLReadable for spark_hvd stages."""

    def write(self):
        """Returns an MLWriter (``.save(path)``, ``.overwrite().save(path)``)."""
        return StageWriter(self)

    def save(self, path: str) -> None:
        """Saves this stage to ``path`` (fails if it exists; ``write().overwrite().save``)."""
        self.write().save(path)

    @classmethod
    def read(cls):
        """Returns an MLReader for this class."""
        return StageReader(cls)

    @classmethod
    def load(cls, path: str):
        """Loads a stage saved with :meth:`save`."""
        return cls.read().load(path)

    def _pack_params(self, params: dict) -> dict:
        """The Params that go into the payload (not JSON), as they are pickled; a subclass
        replaces values that cloudpickle would not carry faithfully (Keras models)."""
        return params

    def _unpack_params(self, params: dict) -> dict:
        """The inverse of :meth:`_pack_params`, when the stage is loaded."""
        return params

    def _extra_state(self):
        """State that is not a Param, saved with the stage (subclasses override)."""
        return None

    def _restore_extra_state(self, state) -> None:
        pass
