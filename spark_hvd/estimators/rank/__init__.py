"""What runs inside an estimator's training ranks (the processes ``spark.run`` starts): each
framework's training loop (``_torch``, ``_keras``, ``_lightning``), what every rank needs
whatever the framework (``_training``: shard readers, epoch bookkeeping, checkpoints), progress
to the driver (``_progress``) and rank 0's TensorBoard files (``_tensorboard``).

The driver imports from here (the training functions, and the framework helpers it shares with
the ranks); nothing here imports the driver's side (the modules at the estimators' top level)
or PySpark, so a rank starts without them. It reads its data through ``data/`` and the Store.
"""
