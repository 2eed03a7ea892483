"""The data an estimator trains on: the on-Store format of the prepared shards (``_format``),
preparing them from a DataFrame (``_prepare``, on the driver and in Spark tasks, with the
column functions of ``_columns``), reading them on every rank (``_loader``, public as
``spark_hvd.estimators.loader``), and what happens to a batch on its way to the model
(``_transformation_fn``: the user's ``transformation_fn``; ``_arrays``: Arrow to NumPy, the
model's input shapes).

Framework-free, and imported by both sides: nothing here imports the driver's side or the
ranks' (``rank/``), only the Store.
"""
