"""What this rank actually holds: bytes of the sharded parameters, gradients and optimizer state,
the process's resident memory, and the accelerator allocator's statistics where there is one."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardtrain.accelerator import phase_peak_bytes, reset_phase_peak
from shardtrain.config.plan import dtype_name
from shardtrain.config.schema import FinetuneConfig
from shardtrain.models.experts import routed_expert_params
from shardtrain.models.lora import adapter_modules, local_bytes, unadapted_linears


@dataclass
class StateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                averages: Sequence[torch.Tensor] = ()) -> StateBytes:
    """This rank's parameter, gradient and optimizer-state bytes; ``averages`` (trainer.ema_decay's
    weight average) count with the optimizer's, as the planner counts them."""
    params = list(model.parameters())
    grads = sum(local_bytes(p.grad) for p in params if p.grad is not None)
    optim = sum(local_bytes(average) for average in averages)
    if optimizer is not None:
        for state in optimizer.state.values():
            optim += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return StateBytes(sum(local_bytes(p) for p in params), grads, optim)


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class PhaseMemory:
    """Peak memory per phase of a step: forward, backward, optimizer step, end of step.

    On an accelerator: the allocator's peak within each phase. On CPU: the exact bytes of the
    sharded states and the process's resident memory at the end of each phase. Forward and backward
    are marked once per micro-batch: a phase's peak and resident memory are the largest of its
    marks (with the peak reset once a step, the forward's took in every earlier micro-batch's
    backward), its state bytes the last.
    """

    PHASES = ("forward", "backward", "optimizer", "end")

    def __init__(self, model: nn.Module, optimizer, device: torch.device,
                 averages: Sequence[torch.Tensor] = ()) -> None:
        self.model = model
        self.optimizer = optimizer
        self.averages = averages
        self.device = device
        self.record: dict[str, dict[str, float]] = {}
        self.grad_dtypes: set[str] = set()

    def start(self) -> None:
        self.record = {}
        reset_phase_peak(self.device)

    def mark(self, phase: str) -> None:
        entry: dict[str, float] = {"rss_mib": rss_bytes() / 2**20}
        peak = phase_peak_bytes(self.device)
        if peak is not None:
            entry["peak_allocated_mib"] = peak / 2**20
            reset_phase_peak(self.device)
        if phase == "backward":
            self.grad_dtypes |= {dtype_name(p.grad.dtype)
                                 for p in self.model.parameters() if p.grad is not None}
        s = state_bytes(self.model, self.optimizer, self.averages)
        entry.update(params_mib=s.params / 2**20, grads_mib=s.grads / 2**20,
                     optimizer_mib=s.optimizer / 2**20)
        for key in ("rss_mib", "peak_allocated_mib"):
            if key in entry and key in self.record.get(phase, {}):
                entry[key] = max(entry[key], self.record[phase][key])
        self.record[phase] = entry


def adapter_summary(model: nn.Module, cfg: FinetuneConfig) -> str:
    """``finetune=lora``'s start-up line: trainable and frozen parameters, what each costs this rank."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    count = sum(p.numel() for p in trainable)
    total = count + sum(p.numel() for p in frozen)
    mib = 2.0 ** 20
    # A MoE model's routed experts are stacked 3-D weights, no linear layer: said, not left to be
    # found (the default targets' MLP projections matched nothing there, without a word)
    experts = routed_expert_params(model)
    unadapted = (f"; the routed experts' {experts:,} parameters (stacked weights, no linear layers) are "
                 "not adapted" + (" nor quantised" if cfg.method == "qlora" else "") if experts else "")
    if not cfg.targets and (left := unadapted_linears(model)):
        # The defaults know many families' projection names, not every family's: said, not left
        # to be found (Phi-3's fused projections had none, found by a trial)
        named = ", ".join(f"{name} x{count}" for name, count in sorted(left.items()))
        unadapted += (f"; linear layers the default targets leave without adapters: {named} (name them in "
                      "finetune.targets to adapt them)")
    return (f"finetune={cfg.method}: rank {cfg.rank}, alpha {cfg.alpha:g} on {len(adapter_modules(model))} "
            f"modules; {count:,} trainable parameters ({100 * count / max(total, 1):.2f}%), "
            f"{total - count:,} frozen; this rank holds {sum(map(local_bytes, trainable)) / mib:.2f} MiB "
            f"trainable (+ their gradients and 2 Adam moments) and "
            f"{sum(map(local_bytes, frozen)) / mib:.2f} MiB frozen (no gradients, no optimizer state)"
            f"{unadapted}")
