"""One optimizer step and one evaluation pass, written once for every strategy.

The loss of every micro-batch is its summed token loss divided by the *global* number of target
tokens of the step (all ranks, all micro-batches), and FSDP sums gradients instead of averaging them.
So any split of the global batch into ranks and micro-batches yields the same gradient as one
process computing the mean loss over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from shardtrain import faults
from shardtrain.data.batches import IGNORE_INDEX
from shardtrain.diagnostics.memory import PhaseMemory
from shardtrain.diagnostics.rails import explain_bypassed_forward
from shardtrain.distributed.parallelize import reshard_all
from shardtrain.errors import TrainingError
from shardtrain.train.grad import clip_grads_, global_grad_norm

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    tokens: int
    skipped: bool


def token_loss_sum(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    try:
        logits = model(inputs)  # always model(x): FSDP's hooks live on __call__
    except RuntimeError as exc:
        explained = explain_bypassed_forward(exc)
        if explained is not None:
            raise explained from exc
        raise
    return F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def global_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def prepare_micro_batch(model: nn.Module, index: int, count: int, sharded_accumulation: bool) -> None:
    """Tell FSDP which reductions micro-batch ``index`` of ``count`` runs.

    Sharded accumulation reduce-scatters after every backward (only sharded gradients are held) and
    all-reduces across the replicas of a hybrid mesh on the last micro-batch only; unsharded
    accumulation keeps full gradients and reduces once, on the last.
    """
    if not isinstance(model, FSDPModule) or count < 2:
        return
    if sharded_accumulation:
        model.set_requires_all_reduce(index == count - 1)
    else:
        model.set_requires_gradient_sync(index == count - 1)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, micro_batches: list[Batch],
               mesh: DeviceMesh, grad_clip_norm: float, device: torch.device,
               step: int = 0, phases: PhaseMemory | None = None,
               sharded_accumulation: bool = True) -> StepStats:
    """One optimizer step (``step`` is its 1-based number; ``phases`` records memory per phase).

    With several micro-batches, ``sharded_accumulation`` reduce-scatters after every backward (only
    sharded gradients are held; replicas of a hybrid mesh all-reduce on the last one only);
    otherwise gradients stay unsharded and are reduced once, on the last micro-batch.
    """
    local_tokens = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro_batches)
    (global_tokens,) = global_sum([local_tokens], device)
    if global_tokens == 0:
        raise TrainingError("a training step had no target tokens on any rank; check the data")

    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    last = len(micro_batches) - 1
    rank = dist.get_rank()
    if phases is not None:
        phases.start()
    for index, (x, y) in enumerate(micro_batches):
        prepare_micro_batch(model, index, len(micro_batches), sharded_accumulation)
        loss = token_loss_sum(model, x.to(device), y.to(device)) / global_tokens
        if index == 0:
            loss = faults.poison_loss(rank, step, loss)
        if phases is not None and index == last:
            phases.mark("forward")
        loss.backward()
        loss_sum += loss.detach()
    if phases is not None:
        phases.mark("backward")

    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = global_grad_norm(params, mesh)
    (loss_value,) = global_sum([loss_sum.item()], device)
    norm_value = grad_norm.item()
    skipped = not (torch.isfinite(grad_norm).item() and torch.isfinite(torch.tensor(loss_value)))
    if not skipped:
        if grad_clip_norm > 0:
            clip_grads_(params, grad_clip_norm, grad_norm)
        optimizer.step()
    if phases is not None:
        phases.mark("optimizer")
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    if phases is not None:
        phases.mark("end")
    return StepStats(loss=loss_value, grad_norm=norm_value, tokens=int(global_tokens),
                     skipped=skipped)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch], device: torch.device) -> float:
    """Mean loss per target token over the validation set (identical on every rank)."""
    was_training = model.training
    model.eval()
    loss = 0.0
    tokens = 0
    for x, y in batches:
        loss += token_loss_sum(model, x.to(device), y.to(device)).item()
        tokens += int((y != IGNORE_INDEX).sum())
    model.train(was_training)
    reshard_all(model)
    loss, tokens = global_sum([loss, tokens], device)
    return loss / max(tokens, 1)
