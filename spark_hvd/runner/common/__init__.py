"""Horovod's ``horovod.runner.common`` module paths (see ``util``)."""
