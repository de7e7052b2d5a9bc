"""An exponential moving average of the trained weights (``trainer.ema_decay``), as diffusion and
image models are evaluated and shipped with: after every optimizer step that was not skipped,
``average = decay * average + (1 - decay) * weights``, starting from the weights training starts
from (the random initialisation, ``model.init_from``'s or the resumed run's).

The average is held like the parameters themselves, as sharded DTensors on their mesh, in fp32
whatever the storage dtype (a bf16 average loses the small updates a decay near 1 adds). Each rank
updates its own shard: no communication. Checkpoints carry it beside the model (``ema.<name>``), so
it resumes at any world size, and ``shardtrain consolidate CKPT OUT --key ema`` writes it as the
model's weights.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class WeightAverage:
    """The average of ``model``'s parameters (every one trains: LoRA runs are refused at the config)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.parameters = [param for _, param in model.named_parameters()]
        with torch.no_grad():
            self.average: dict[str, torch.Tensor] = {
                name: param.detach().to(torch.float32, copy=True) for name, param in model.named_parameters()}

    @torch.no_grad()
    def update(self) -> None:
        """One step of the average, on this rank's shards."""
        averages = [local(average) for average in self.average.values()]
        weights = [local(param).to(torch.float32) for param in self.parameters]
        torch._foreach_lerp_(averages, weights, 1.0 - self.decay)

    @torch.no_grad()
    def restart_from_weights(self) -> None:
        """The average set to the current weights (a resume from a checkpoint saved without one)."""
        for average, param in zip(self.average.values(), self.parameters, strict=True):
            local(average).copy_(local(param))
