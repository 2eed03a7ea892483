"""``mock``, the PyPI backport of ``unittest.mock`` that Horovod's test/utils/common.py imports:
here the standard library's ``unittest.mock`` itself, re-exported."""

from unittest.mock import *  # noqa: F401,F403
from unittest.mock import __all__  # noqa: F401

# The backport's version, which parameterized (test_tensorflow2_keras.py) reads to work around a
# bug fixed in mock 4; this Python's unittest.mock (3.8+) has that fix too.
version_info = (4, 0, 0)
