"""Horovod's ``horovod.runner.common.util`` module paths (``config_parser``)."""
