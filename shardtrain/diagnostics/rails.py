"""Safety rails: the FSDP traps that cost people days, turned into errors with the fix in them."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardtrain.errors import ModelError

log = logging.getLogger("shardtrain")


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


def warn_tied_across_units(model: nn.Module, units: Sequence[str]) -> list[str]:
    """Parameters shared by modules that sit in different FSDP units (call before sharding)."""
    owners: dict[int, set[str]] = defaultdict(set)
    names: dict[int, list[str]] = defaultdict(list)
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            owners[id(param)].add(owning_unit(module_name, units))
            names[id(param)].append(full)
    warnings = []
    for key, unit_set in owners.items():
        if len(unit_set) > 1:
            warnings.append(
                f"tied parameter {' = '.join(names[key])} spans FSDP units {sorted(unit_set)}: it is "
                "gathered by one unit and used by another. Put the modules sharing it in one unit "
                "(e.g. extra_shard_groups() returning them together) to avoid extra all-gathers"
            )
    for message in warnings:
        log.warning(message)
    return warnings


def check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """The optimizer must hold exactly the model's sharded DTensor parameters."""
    current = {id(p): n for n, p in model.named_parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    stale = [p for p in held if id(p) not in current]
    if stale:
        raise ModelError(
            f"the optimizer holds {len(stale)} tensors that are not the model's parameters (for "
            f"example one of shape {list(stale[0].shape)}): it was built before sharding, from the "
            "unsharded module. Build it after sharding; with the library API pass "
            "optimizer_factory=lambda model: torch.optim.AdamW(model.parameters(), ...)"
        )
    plain = [current[id(p)] for p in held if not isinstance(p, DTensor)]
    if plain:
        raise ModelError(f"the optimizer holds parameters that are not sharded DTensors: {plain[:3]}")
    missing = set(current) - {id(p) for p in held}
    if missing:
        log.warning("the optimizer does not update %d parameters: %s", len(missing),
                    [current[i] for i in list(missing)[:3]])


BYPASS_MESSAGE = "mixed torch.Tensor and DTensor"


def explain_bypassed_forward(exc: BaseException) -> ModelError | None:
    """The error FSDP2 raises when a sharded module's forward ran outside its ``__call__``."""
    if BYPASS_MESSAGE in str(exc):
        return ModelError(
            "a sharded module's parameters were used without FSDP gathering them: some forward ran "
            "as module.forward(x) (or a submodule's forward was called directly), which skips "
            "FSDP's hooks. Call modules as module(x). Original error: " + str(exc).splitlines()[0]
        )
    return None


def check_uniform_batches(counts: dict[str, int], device: torch.device) -> None:
    """Every rank must run the same number of micro-batches per step and evaluation batches."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    mine = torch.tensor(list(counts.values()), dtype=torch.int64, device=device)
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    for key, lo, hi in zip(counts, low.tolist(), high.tolist(), strict=True):
        if lo != hi:
            raise ModelError(f"ranks disagree on {key} ({lo} vs {hi}): the ranks with fewer would "
                             "leave the others waiting in a collective forever")
