"""AdamW on the sharded parameters, and the learning-rate schedule: linear warmup, a stable phase
(``trainer.decay_fraction`` < 1), a cosine, linear or square-root decay."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from shardtrain.config.schema import TrainerConfig
from shardtrain.errors import ConfigError
from shardtrain.models.param_groups import no_decay_names

log = logging.getLogger("shardtrain")


# Device types torch's fused AdamW has kernels for (torch 2.11 to 2.13: CPU, CUDA, XPU, MPS). torch
# checks only at the first step(), not when the optimizer is built: asked here, before building it.
FUSED_ADAMW_DEVICES = ("cpu", "cuda", "xpu", "mps")


def fused_adamw_refusal(params: list[torch.Tensor]) -> str | None:
    """Why torch's fused AdamW cannot step these parameters (their dtype or device); None if it can."""
    for param in params:
        if not torch.is_floating_point(param) or param.device.type not in FUSED_ADAMW_DEVICES:
            return (f"{param.dtype} parameters on {param.device.type}: torch's fused AdamW steps "
                    f"floating-point parameters on {', '.join(FUSED_ADAMW_DEVICES)}")
    return None


def build_optimizer(model: nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    """Must be called after sharding so the optimizer holds the DTensor parameters."""
    skip = no_decay_names(model)
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if name in skip else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    settings = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.adam_eps}
    groups = [g for g in groups if g["params"]]
    if cfg.optimizer_kernel != "foreach":
        refusal = fused_adamw_refusal(decay + no_decay)
        if refusal is None:
            return torch.optim.AdamW(groups, fused=True, **settings)
        if cfg.optimizer_kernel == "fused":
            raise ConfigError(f"trainer.optimizer_kernel=fused: {refusal}; use "
                              "trainer.optimizer_kernel=foreach")
        log.info("optimizer: foreach AdamW (%s)", refusal)
    return torch.optim.AdamW(groups, foreach=True, **settings)


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class and, where it says, its kernels (the start-up report)."""
    defaults = getattr(optimizer, "defaults", {})  # an optimizer_factory may return any optimizer
    kernels = next((k for k in ("fused", "foreach") if defaults.get(k)), None)
    return type(optimizer).__name__ + (f" ({kernels})" if kernels else "")


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` takes the skip decision as a device tensor (``found_inf``, the
    protocol torch's GradScaler uses with fused optimizers) instead of from the host."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_unless(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """``optimizer.step()``, which leaves parameters, moments and step counts untouched where
    ``nonfinite`` (a 0-dim device tensor) is true: no host read needed before the update."""
    # With CPU offload, the host; the first group holding a parameter (a factory's groups may be
    # empty, as PyTorch allows: one for the norms of a model without any)
    device = next(params[0].device for params in (g["params"] for g in optimizer.param_groups) if params)
    optimizer.found_inf = nonfinite.float().to(device)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


# The trainer keys that shape ``lr_factor`` (a resume follows their new values: Trainer.schedule_changes).
SCHEDULE_SHAPE = ("warmup_steps", "max_steps", "min_lr_ratio", "lr_decay", "decay_fraction")


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_ratio: float,
              decay: str = "cosine", decay_fraction: float = 1.0) -> float:
    """Linear warmup to 1, 1 until the last ``decay_fraction`` of the steps after warmup, then
    ``decay`` (cosine, linear or sqrt) to ``min_ratio`` at ``max_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    decay_steps = max(1, round(span * decay_fraction))  # round: 1000 * 0.07 is 70.00000000000001
    decay_start = warmup_steps + span - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_steps)
    if decay == "linear":
        return min_ratio + (1 - min_ratio) * (1 - progress)
    if decay == "sqrt":
        return min_ratio + (1 - min_ratio) * (1 - math.sqrt(progress))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def schedule_cautions(cfg: TrainerConfig) -> list[str]:
    """What a run's schedule does that its settings do not say: a warmup longer than the run (the
    default 30 steps kept a 3-step run at 13% of trainer.lr), and a decay too short to lower any
    step's rate (step N trains at the schedule's value for N - 1, so a one-step decay ends after the
    run: ``decay_fraction=0.01`` of 100 steps)."""
    cautions = []
    if cfg.warmup_steps > cfg.max_steps:
        reached = cfg.max_steps / cfg.warmup_steps
        cautions.append(f"trainer.warmup_steps={cfg.warmup_steps} > trainer.max_steps={cfg.max_steps}: the "
                        f"learning rate rises for the whole run and peaks at {cfg.lr * reached:.3g}, "
                        f"{reached:.0%} of trainer.lr={cfg.lr:g}; lower trainer.warmup_steps")
    span = cfg.max_steps - cfg.warmup_steps
    one_step = round(span * cfg.decay_fraction) <= 1
    if 0 < span and cfg.decay_fraction < 1.0 and cfg.min_lr_ratio < 1.0 and one_step:
        cautions.append(f"trainer.decay_fraction={cfg.decay_fraction:g} of the {span} steps after warmup "
                        "is a decay of at most one step, which lowers no step's rate (step N trains at "
                        "the schedule's value for N - 1); raise trainer.decay_fraction")
    return cautions


def build_scheduler(optimizer: torch.optim.Optimizer,
                    cfg: TrainerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio, cfg.lr_decay,
                               cfg.decay_fraction),
    )


def follow_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set each parameter group's learning rate to what this run's schedule gives at the scheduler's
    step. A resumed optimizer holds the rate the checkpoint's schedule computed for the next step:
    with changed warmup, max_steps or decay, the new schedule would start one step late."""
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs,
                                   scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
