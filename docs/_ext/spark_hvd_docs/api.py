"""The public API as the reference documents it, and the check that every public function and
class in it has a docstring.

A module's public names are its ``__all__`` (else its names without a leading underscore that
are functions or classes defined in spark_hvd); for a class defined in spark_hvd, its public
methods and properties too. A method that overrides a documented method of a base class
(Keras' ``on_epoch_end``, Lightning's ``setup``) inherits that docstring and passes.
"""

from __future__ import annotations

import importlib
import inspect

# The public modules (API.md) and the public submodules the reference gives pages of their own.
PUBLIC_MODULES = (
    "spark_hvd",
    "spark_hvd.common",
    "spark_hvd.numpy",
    "spark_hvd.torch",
    "spark_hvd.torch.elastic",
    "spark_hvd.tensorflow",
    "spark_hvd.tensorflow.elastic",
    "spark_hvd.keras",
    "spark_hvd.keras.callbacks",
    "spark_hvd.keras.elastic",
    "spark_hvd.spark",
    "spark_hvd.estimators",
    "spark_hvd.estimators.store",
    "spark_hvd.estimators.loader",
    "spark_hvd.estimators.torch",
    "spark_hvd.estimators.keras",
    "spark_hvd.estimators.lightning",
    "spark_hvd.lightning",
    "spark_hvd.runner",
)


def _ours(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").startswith("spark_hvd")


def public_names(module) -> list[str]:
    """``__all__``; else the functions and classes the module defines itself, and the shared
    API's names it imports (``spark_hvd.numpy`` does ``from .common import *``)."""
    if module.__name__ == "spark_hvd":
        return ["run"]  # the package itself exports only Horovod's horovod.run
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    common = importlib.import_module("spark_hvd.common")
    return [name for name, obj in vars(module).items() if not name.startswith("_") and (
        (name in common.__all__ and obj is getattr(common, name))
        or ((inspect.isclass(obj) or inspect.isfunction(obj))
            and obj.__module__ == module.__name__))]


def _documented(obj) -> bool:
    return bool((inspect.getdoc(obj) or "").strip())


def undocumented(modules=PUBLIC_MODULES) -> list[str]:
    """``module.name`` (or ``module.Class.member``) of every public function, class, method
    and property without a docstring, and every public module without one."""
    missing = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        if not _documented(module):
            missing.append(f"{module_name} (module)")
        for name in public_names(module):
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not callable(obj):
                continue  # constants (Average, global_process_set) and submodules
            if not _documented(obj):
                missing.append(f"{module_name}.{name}")
            if inspect.isclass(obj) and _ours(obj):
                missing += [f"{module_name}.{name}.{member}"
                            for member in undocumented_members(obj)]
    return missing


def undocumented_members(cls) -> list[str]:
    """The public methods and properties ``cls`` defines itself without a docstring (one
    inherited from an overridden base method counts)."""
    missing = []
    for member, raw in vars(cls).items():
        if member.startswith("_"):
            continue
        if isinstance(raw, property):
            documented = bool((raw.__doc__ or "").strip()) or any(
                isinstance(getattr(base, member, None), property)
                and (getattr(base, member).__doc__ or "").strip() for base in cls.__mro__[1:])
        elif inspect.isfunction(raw) or isinstance(raw, (staticmethod, classmethod)):
            documented = _documented(getattr(cls, member))
        else:
            continue
        if not documented:
            missing.append(member)
    return missing
