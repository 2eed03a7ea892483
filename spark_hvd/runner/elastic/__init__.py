"""Horovod's ``horovod.runner.elastic`` module paths, for code and tests that import them.

Thin: the elastic driver is ``spark_hvd/launch/elastic``; these modules re-export its names
under Horovod's and hold the constants Horovod's tests patch.
"""
