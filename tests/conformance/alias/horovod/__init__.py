"""``horovod`` as Horovod's own test files see it under the conformance runner.

Every ``horovod.X.Y`` module *is* ``spark_hvd.X.Y`` (the same module object, so ``mock.patch``
of ``horovod.torch...`` patches what spark_hvd runs). A module spark_hvd does not have fails as
``ModuleNotFoundError`` naming both names, so a test that needs it shows the gap.

A few Horovod internals are not API at all but helpers Horovod's tests import (a thread
starter, an environment reader, a TensorFlow eager check): those come from
``_horovod_test_shims`` (listed in ``SHIMS``), never from spark_hvd. The package directory is put
on ``PYTHONPATH`` by ``tests/conformance/run.py`` only: nothing here is installed.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

# Horovod-internal modules its test helpers import (test/utils/common.py, the process-set and
# TensorFlow test files). They are not part of what a user imports, so they are not gaps.
SHIMS = {
    "horovod.runner.util.threads": "_horovod_test_shims.threads",
    "horovod.runner.common.util.env": "_horovod_test_shims.env",
    "horovod.tensorflow.util": "_horovod_test_shims.tf_util",
}


def __getattr__(name):
    # `horovod.__version__` and other top-level names: spark_hvd's.
    import spark_hvd
    try:
        return getattr(spark_hvd, name)
    except AttributeError:
        raise AttributeError(f"module 'horovod' (spark_hvd under the conformance alias) has no "
                             f"attribute {name!r}") from None


class _AliasLoader(importlib.abc.Loader):
    """Hands out an already imported module under a second name."""

    def __init__(self, module):
        self._module = module
        self._own_spec = getattr(module, "__spec__", None)

    def create_module(self, spec):
        return self._module

    def exec_module(self, module):
        # The import system stamped our alias spec on the module; give it back its own, or
        # spark_hvd's relative imports and pickling would see the `horovod` name.
        if self._own_spec is not None:
            module.__spec__ = self._own_spec


def _shim_parent(name):
    """Whether ``name`` is a package on the way to a shim (``horovod.runner.util``)."""
    return any(shim.startswith(name + ".") for shim in SHIMS)


class HorovodAliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``horovod.*`` to spark_hvd modules, before the path finder can load spark_hvd's
    files a second time under the horovod name."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("horovod."):
            return None
        if fullname in SHIMS:
            module = importlib.import_module(SHIMS[fullname])
        else:
            counterpart = "spark_hvd" + fullname[len("horovod"):]
            try:
                module = importlib.import_module(counterpart)
            except ModuleNotFoundError as e:
                # Only "the counterpart does not exist" is the gap we report; any other missing
                # module (a framework not installed) propagates as it is.
                if e.name is None or not counterpart.startswith(e.name):
                    raise
                if not _shim_parent(fullname):
                    raise ModuleNotFoundError(
                        f"No module named {fullname!r}: spark_hvd has no {counterpart!r} "
                        f"(conformance alias horovod -> spark_hvd)", name=fullname) from None
                module = types.ModuleType(fullname, "package holding a test shim")
                module.__path__ = []
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(module), is_package=hasattr(module, "__path__"))


if not any(isinstance(f, HorovodAliasFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, HorovodAliasFinder())
