"""Stand-ins for the Horovod internals that Horovod's test files import as helpers.

Each is a few lines of the behaviour the tests rely on (Horovod v0.28.1), not spark_hvd API:
see ``horovod.SHIMS`` in the alias package.
"""
