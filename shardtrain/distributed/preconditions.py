"""What must hold before a model is sharded: the traps that cost people days, as errors with the fix.

Checked by ``parallelize`` itself, so every path that shards a model (training, generation, library
use) gets them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from torch import nn

from shardtrain.config.classpath import import_module_class
from shardtrain.errors import ModelError


def check_single_registration(model: nn.Module) -> None:
    """A submodule under two parents is sharded and stored twice (the seed's double-memory trap)."""
    paths: dict[int, list[str]] = defaultdict(list)
    for name, module in model.named_modules(remove_duplicate=False):
        paths[id(module)].append(name or "<root>")
    for names in paths.values():
        if len(names) > 1:
            raise ModelError(
                f"module registered under two parents: {names[0]!r} and {names[1]!r}; FSDP would "
                "shard and gather it twice (double memory). Keep one owner and hold the other "
                "reference without registering it, e.g. object.__setattr__(self, 'name', module)"
            )


def owning_unit(name: str, units: Sequence[str]) -> str:
    """The FSDP unit a module belongs to: the unit with the longest name prefixing it (else root)."""
    best, best_len = "<root>", -1
    for unit in units:
        for part in unit.split("+"):
            inside = name == part or name.startswith(part + ".")
            if part != "<root>" and inside and len(part) > best_len:
                best, best_len = unit, len(part)
    return best


def check_tied_within_units(model: nn.Module, units: Sequence[str]) -> None:
    """Parameters shared by modules that sit in different FSDP units (call before sharding): torch's
    fully_shard refuses them at the first forward, with a ValueError naming neither units nor fix."""
    owners: dict[int, set[str]] = defaultdict(set)
    names: dict[int, list[str]] = defaultdict(list)
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            owners[id(param)].add(owning_unit(module_name, units))
            names[id(param)].append(full)
    for key, unit_set in owners.items():
        if len(unit_set) > 1:
            raise ModelError(
                f"tied parameter {' = '.join(names[key])} spans FSDP units {sorted(unit_set)}: one "
                "parameter can belong to one unit only; put the modules sharing it in one unit (the "
                "model's extra_shard_groups() returning them in one group, e.g. [[embed, head]])")


def module_class_paths(model: nn.Module) -> list[str]:
    return sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()})


def module_class_names(model: nn.Module) -> list[str]:
    """Class names of the modules that hold parameters, the candidates for FSDP units."""
    return sorted({type(m).__name__ for m in model.modules() if any(True for _ in m.parameters())})


def resolve_wrap_classes(model: nn.Module, policy: Sequence[str | type]) -> tuple[type, ...]:
    """Turn the configured wrap policy (``auto``: the model's ``block_classes``; a dotted class path;
    or a bare class name of one of the model's modules) into classes, and insist that it matches.
    A policy's ``source`` (``tasks.task.WrapPolicy``) is what its messages name."""
    source = getattr(policy, "source", "strategy.wrap_policy")
    classes: list[type] = []
    for entry in policy:
        if isinstance(entry, type):
            classes.append(entry)
        elif entry == "auto":
            declared = getattr(model, "block_classes", None)
            if not declared:
                where = ("set strategy.wrap_policy to" if source == "strategy.wrap_policy" else
                         f"return from {source}")
                raise ModelError(
                    f"{type(model).__name__} declares no block_classes, so wrap_policy='auto' has "
                    f"nothing to wrap; {where} its block class, one of: "
                    + ", ".join(module_class_paths(model)))
            classes.extend(declared)
        elif "." not in entry:
            # A bare class name (e.g. "LlamaDecoderLayer"): the model's own class of that name.
            found = {type(m) for m in model.modules() if type(m).__name__ == entry}
            if not found:
                raise ModelError(f"{source}: {type(model).__name__} has no module of class "
                                 f"{entry!r}; its classes: " + ", ".join(module_class_names(model)))
            classes.extend(found)
        else:
            classes.append(import_module_class(entry))
    wrap = tuple(classes)
    if isinstance(model, wrap) and not any(isinstance(m, wrap) for m in model.modules() if m is not model):
        raise ModelError(
            f"wrap policy [{', '.join(c.__qualname__ for c in wrap)}] matches only the model itself "
            f"({type(model).__name__}): the whole model would be one unit, gathered whole on every rank; "
            "name its block class, one of: " + ", ".join(module_class_paths(model)))
    if not any(isinstance(m, wrap) for m in model.modules()):
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in wrap)
        raise ModelError(
            f"{source} [{names}] matched no module of {type(model).__name__}, so nothing would be "
            "sharded per block; use one of the model's classes: " + ", ".join(module_class_paths(model))
        )
    return wrap
