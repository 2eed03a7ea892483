"""The public path of the shard reader every rank trains from, which lives in ``data/_loader.py``
with the rest of the shard data. A compatibility alias: this module makes
``spark_hvd.estimators.loader`` that very module (one module object, so attributes read or
patched through either name are the same), as it was before the reader moved into ``data/``."""

import sys

from .data import _loader

sys.modules[__name__] = _loader
