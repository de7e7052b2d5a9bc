"""Dotted class paths in configs (``strategy.wrap_policy``, ``task``): import them, or say why not."""

from __future__ import annotations

import functools
import importlib

from torch import nn

from shardtrain.config.suggest import closest
from shardtrain.errors import ConfigError, ModelError


def import_module_class(path: str) -> type[nn.Module]:
    """The ``nn.Module`` subclass named by ``pkg.mod.Class``; a ModelError naming the problem."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ModelError(f"wrap policy entry {path!r} is not a dotted class path like 'pkg.mod.Block'")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ModelError(f"wrap policy class {path!r} does not import: {exc}") from exc
    if not isinstance(obj, type) or not issubclass(obj, nn.Module):
        raise ModelError(f"wrap policy entry {path!r} is not an nn.Module class")
    return obj


def qualified_name(obj: object) -> str:
    """``module:qualname`` of a class or function, the form ``import_object`` reads (of a partial,
    its function's; of another callable, its class's)."""
    target = obj.func if isinstance(obj, functools.partial) else obj
    if not hasattr(target, "__qualname__"):
        target = type(target)
    return f"{getattr(target, '__module__', '?')}:{target.__qualname__}"


def import_object(path: str, what: str) -> object:
    """The object ``pkg.module:Name`` (or ``pkg.module.Name``) names; a ConfigError saying why not.
    ``what`` names the setting in the message ("task")."""
    module_name, colon, attr = path.partition(":")
    if not colon:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{what}={path!r} is not an import path like 'my_pkg.tasks:MyTask'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = missing_dependency(exc, module_name)
        if missing:
            raise ConfigError(f"{what}={path!r}: module {module_name!r} imports {missing!r}, which is "
                              "not installed; install it") from exc
        raise ConfigError(f"{what}={path!r}: module {module_name!r} does not import ({exc}); is it "
                          "installed, or on PYTHONPATH?") from exc
    except SyntaxError as exc:  # the user's own module: where, not a traceback through importlib
        where = f"{exc.filename or module_name}, line {exc.lineno}"
        raise ConfigError(f"{what}={path!r}: {where}: {exc.msg}; fix the module") from exc
    if not hasattr(module, attr):
        names = [name for name in dir(module) if not name.startswith("_")]
        raise ConfigError(f"{what}={path!r}: module {module_name!r} has no {attr!r}{closest(attr, names)}")
    return getattr(module, attr)


def missing_dependency(exc: ImportError, module_name: str) -> str | None:
    """The package that ``module_name``'s own code imports and that is missing, or None when the
    module itself (or a package above it) is what is missing: the two need different fixes."""
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if not missing or missing == module_name or module_name.startswith(f"{missing}."):
        return None
    return missing
