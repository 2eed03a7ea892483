"""``mock`` (Horovod's test/utils/common.py imports the PyPI backport) is the standard
library's ``unittest.mock``, which the backport mirrors."""

import sys
import unittest.mock

sys.modules[__name__] = unittest.mock
