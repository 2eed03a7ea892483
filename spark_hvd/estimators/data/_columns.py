"""Column functions for a DataFrame's kind of session. One process can hold a classic and a
Spark Connect session at once (a notebook, our tests), and their Columns and UDFs do not mix:
``pyspark.sql.functions`` follows a process-wide switch, so the right module is picked from the
DataFrame itself."""

from __future__ import annotations

from types import SimpleNamespace


def is_connect_frame(df) -> bool:
    return type(df).__module__.startswith("pyspark.sql.connect")


def for_frame(df) -> SimpleNamespace:
    """``F`` (the functions module), ``vector_to_array``, ``array_to_vector`` and
    ``arrow_iter_udf(fn, return_type)`` (an iterator-of-Arrow-batches scalar UDF) for ``df``."""
    from pyspark.util import PythonEvalType
    if is_connect_frame(df):
        from pyspark.ml.connect.functions import array_to_vector, vector_to_array
        from pyspark.sql.connect import functions as F
        from pyspark.sql.connect.udf import _create_udf

        def arrow_iter_udf(fn, return_type):
            return _create_udf(fn, return_type, PythonEvalType.SQL_SCALAR_ARROW_ITER_UDF)
    else:
        from pyspark.ml.functions import array_to_vector, vector_to_array
        from pyspark.sql import functions as F
        from pyspark.sql.udf import _create_udf

        def arrow_iter_udf(fn, return_type):
            return _create_udf(fn, return_type, PythonEvalType.SQL_SCALAR_ARROW_ITER_UDF)
    return SimpleNamespace(F=F, vector_to_array=vector_to_array,
                           array_to_vector=array_to_vector, arrow_iter_udf=arrow_iter_udf)
