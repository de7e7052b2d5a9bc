"""An exponential moving average of the trained weights (``trainer.ema_decay``), as diffusion and
image models are evaluated and shipped with: after every optimizer step that was not skipped,
``average = decay * average + (1 - decay) * weights``, starting from the weights training starts
from (the random initialisation, ``model.init_from``'s or the resumed run's); with
``trainer.ema_warmup`` the decay of step s is ``min(decay, s / (9 + s))`` (diffusers' ramp: 0.1 at
the first step).

The average is held like the parameters themselves, as sharded DTensors on their mesh, in fp32
whatever the storage dtype (a bf16 average loses the small updates a decay near 1 adds). Each rank
updates its own shard: no communication. Checkpoints carry it beside the model (``ema.<name>``), so
it resumes at any world size, and ``shardtrain consolidate CKPT OUT --key ema`` writes it as the
model's weights. Each evaluation during training evaluates the average too (``ema_val_loss``), with
the average copied into the weights for its length (``swapped_in``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from shardtrain.distributed.qlora import local_tensor


class WeightAverage:
    """The average of ``model``'s trained parameters (frozen ones and buffers stay as they are:
    consolidate takes them from the weights)."""

    def __init__(self, model: nn.Module, decay: float, warmup: bool = False) -> None:
        self.decay = decay
        self.warmup = warmup
        # A weight shared under two names (tied embeddings) has one average under both, as the
        # model's state dict has the weight: consolidate --key ema then writes what --key model does.
        self.parameters: list[torch.Tensor] = []
        self.averages: list[torch.Tensor] = []
        self.average: dict[str, torch.Tensor] = {}
        by_parameter: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for name, param in model.named_parameters(remove_duplicate=False):
                if not param.requires_grad:
                    continue
                if id(param) not in by_parameter:
                    by_parameter[id(param)] = param.detach().to(torch.float32, copy=True)
                    self.parameters.append(param)
                    self.averages.append(by_parameter[id(param)])
                self.average[name] = by_parameter[id(param)]

    def decay_at(self, step: int) -> float:
        """The decay of ``step``'s update (the first step is 1): ``decay``, or with ``warmup`` the ramp
        up to it, diffusers' ``(1 + t) / (10 + t)`` of the updates before this one, t = step - 1."""
        return min(self.decay, step / (9 + step)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, step: int) -> None:
        """``step``'s update of the average, on this rank's shards. In two in-place passes rather
        than a lerp, which needs the weights in fp32: a bf16 model's fp32 copy of every shard at once
        would be a peak no phase of the step has."""
        decay = self.decay_at(step)
        averages = [local_tensor(average) for average in self.averages]
        torch._foreach_mul_(averages, decay)
        torch._foreach_add_(averages, [local_tensor(param) for param in self.parameters], alpha=1.0 - decay)

    @torch.no_grad()
    def restart_from_weights(self) -> None:
        """The average set to the current weights (a resume from a checkpoint saved without one)."""
        for average, param in zip(self.averages, self.parameters, strict=True):
            local_tensor(average).copy_(local_tensor(param))

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model runs on the average (rounded to the weights' storage dtype, as a consolidated
        average loads) until the block ends; then the weights are back bit for bit, on every exit.

        Each rank swaps its own shards in place (FSDP2's shards are views into its padded storage,
        so the tensors themselves stay). The weights wait in a copy meanwhile: as large as this
        rank's parameter shards, while gradients (freed after every step) would need as much."""
        weights = [local_tensor(param) for param in self.parameters]
        with torch.no_grad():
            kept = [weight.clone() for weight in weights]
            torch._foreach_copy_(weights, [local_tensor(average) for average in self.averages])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(weights, kept)
