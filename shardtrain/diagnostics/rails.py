"""Safety rails while training: the FSDP traps that cost people days, as errors with the fix in them.

The rails that must hold before sharding (wrap policy, single registration, tied weights) live with
the sharding code in ``distributed/preconditions.py``.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardtrain.config.schema import TrainerConfig
from shardtrain.errors import DataError, ModelError

log = logging.getLogger("shardtrain")


def check_optimizer_factory(factory: object) -> None:
    """``optimizer_factory`` is a function of the sharded model, not an optimizer (found by a user
    trial: an AdamW passed in its place was a bare "'AdamW' object is not callable" traceback)."""
    if factory is None or callable(factory):
        return
    what = ("an optimizer, built before the model was sharded" if isinstance(factory, torch.optim.Optimizer)
            else f"a {type(factory).__name__}, not a function")
    raise ModelError(f"optimizer_factory is {what}: pass a function that builds the optimizer from "
                     "the sharded model, optimizer_factory=lambda model: "
                     "torch.optim.AdamW(model.parameters(), ...)")


# What the built-in AdamW takes from trainer.*, and an optimizer_factory's optimizer does not.
BUILT_IN_OPTIMIZER_KEYS = ("lr", "weight_decay", "beta1", "beta2", "adam_eps", "optimizer_kernel")


def settings_a_factory_ignores(trainer: TrainerConfig) -> str | None:
    """One line naming the ``trainer.*`` settings given away from their defaults that a run with an
    ``optimizer_factory`` does not use (its optimizer's own are used; the schedule multiplies its
    groups' rates), or None (found by review: accepted without a word)."""
    defaults = TrainerConfig()
    given = [f"trainer.{key}={getattr(trainer, key)}" for key in BUILT_IN_OPTIMIZER_KEYS
             if getattr(trainer, key) != getattr(defaults, key)]
    if not given:
        return None
    return (f"{', '.join(given)}: the optimizer_factory's optimizer is used, with its own settings (the "
            "learning-rate schedule multiplies its groups' rates; clipping and skipped steps apply), not "
            "these")


def check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """The optimizer must hold only the model's trainable sharded DTensor parameters (a trainable one
    it leaves out is said: it does not train)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ModelError(f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim."
                         "Optimizer: it must return the optimizer it builds on the sharded model (a "
                         "missing return gives None)")
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
    frozen = [current[id(p)] for p in held if not p.requires_grad]
    if frozen:
        raise ModelError(f"the optimizer holds {len(frozen)} frozen parameters (requires_grad=False, e.g. "
                         f"{frozen[0]}): give it only the trainable ones, "
                         "[p for p in model.parameters() if p.requires_grad]")
    if not held:
        raise ModelError("the optimizer holds no parameters (its groups are empty): give it the model's "
                         "trainable ones, [p for p in model.parameters() if p.requires_grad]")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    missing = trainable - {id(p) for p in held}
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
            "FSDP's hooks. Call modules as module(x); a method called in place of the model "
            "(model.encode_image(x)) is named in the task's forward_methods. Original error: "
            + str(exc).splitlines()[0]
        )
    return None


def check_same_counts(counts: dict[str, tuple[int, str]], device: torch.device) -> None:
    """Every rank must have the same of each count (name: (this rank's, what a difference means and
    its fix)): one all-reduce of the counts and their negatives, for the smallest and largest."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    mine = torch.tensor([count for count, _ in counts.values()], dtype=torch.int64, device=device)
    extremes = torch.cat([mine, -mine])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    high, low = extremes.tolist()[:len(counts)], [-value for value in extremes.tolist()[len(counts):]]
    for (key, (_, meaning)), lo, hi in zip(counts.items(), low, high, strict=True):
        if lo != hi:
            raise DataError(f"ranks disagree on {key} ({lo} vs {hi}): {meaning}")
