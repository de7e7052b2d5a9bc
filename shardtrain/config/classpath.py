"""Dotted class paths in configs (``strategy.wrap_policy``): import them, or say why not."""

from __future__ import annotations

import importlib

from torch import nn

from shardtrain.errors import ModelError


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
