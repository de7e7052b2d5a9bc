"""Dotted class paths in configs (``strategy.wrap_policy``, ``task``): import them, or say why not."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import PurePath

from torch import nn

from shardtrain.config.suggest import closest
from shardtrain.errors import ConfigError, ModelError


def not_a_module_name(module_name: str, attr: str, setting: str) -> str | None:
    """Why ``module_name`` is no module to import, with the fix, where it is written as a file path
    (``./tasks.py``, ``dir/tasks``) or a relative one (``.tasks``); else None. importlib raised a
    TypeError for them, which reached the user as a traceback (found by a new-user trial)."""
    if not (module_name.startswith(".") or "/" in module_name or "\\" in module_name
            or module_name.endswith(".py")):
        return None
    file = PurePath(module_name.replace("\\", "/"))
    if module_name.startswith(".") and file.name == module_name:  # .tasks, ..pkg.tasks
        stem, directory = module_name.lstrip(".") or "MODULE", "its package's directory"
    else:
        stem, directory = file.stem or "MODULE", str(file.parent)
    return (f"{setting}={module_name}:{attr} is a file's path or a relative import, and {setting}= takes an "
            f"import path: put {directory} on PYTHONPATH and name the module, {setting}={stem}:{attr}")


def import_module_class(path: str) -> type[nn.Module]:
    """The ``nn.Module`` subclass named by ``pkg.mod.Class``; a ModelError naming the problem."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ModelError(f"wrap policy entry {path!r} is not a dotted class path like 'pkg.mod.Block'")
    if module_name.startswith("."):
        raise ModelError(f"wrap policy entry {path!r} is a relative import path; name the class from a "
                         "module on PYTHONPATH, like 'pkg.mod.Block' (or the bare class name, which is "
                         "looked up in the model)")
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
    if (as_file := not_a_module_name(module_name, attr, what)) is not None:
        raise ConfigError(as_file)
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
        if not colon and is_module(path):  # the module itself, no class named
            inner = importlib.import_module(path)
            raise ConfigError(f"{what}={path!r} is a module: name a class of it, "
                              f"{path}:NAME{own_names_hint(inner)}")
        # What the module defines, not what it imports (found by a review: 'Task' was offered for
        # vit:VitTask, the base class the module imports, not its own ImageClassification)
        raise ConfigError(f"{what}={path!r}: module {module_name!r} has no {attr!r}"
                          f"{closest(attr, own_names(module)) or own_names_hint(module)}")
    return getattr(module, attr)


def is_module(path: str) -> bool:
    """Whether ``path`` names an importable module (found without importing it)."""
    try:
        return importlib.util.find_spec(path) is not None
    except (ImportError, ValueError):  # its parent is a module, not a package
        return False


def own_names(module: object) -> list[str]:
    """The public classes and functions ``module`` defines (not those it imports)."""
    name = getattr(module, "__name__", "")
    return [attr for attr, value in vars(module).items()
            if not attr.startswith("_") and getattr(value, "__module__", None) == name
            and (isinstance(value, type) or callable(value))]


def own_names_hint(module: object) -> str:
    defined = [attr for attr in own_names(module) if isinstance(getattr(module, attr), type)]
    return f" (it defines {', '.join(defined[:8])}{', ...' if len(defined) > 8 else ''})" if defined else ""


def missing_dependency(exc: ImportError, module_name: str) -> str | None:
    """The package that ``module_name``'s own code imports and that is missing, or None when the
    module itself (or a package above it) is what is missing: the two need different fixes."""
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if not missing or missing == module_name or module_name.startswith(f"{missing}."):
        return None
    return missing
