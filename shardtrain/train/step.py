"""One optimizer step and one evaluation pass, written once for every strategy.

The loss of every micro-batch is its summed token loss divided by the *global* number of target
tokens of the step (all ranks, all micro-batches), and FSDP sums gradients instead of averaging them.
So any split of the global batch into ranks and micro-batches yields the same gradient as one
process computing the mean loss over the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from shardtrain import faults
from shardtrain.data.batches import IGNORE_INDEX, Batch
from shardtrain.diagnostics.memory import PhaseMemory
from shardtrain.diagnostics.rails import explain_bypassed_forward
from shardtrain.distributed.parallelize import reshard_all
from shardtrain.errors import TrainingError
from shardtrain.train.grad import clip_grads_, clip_scale, global_grad_norm


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    tokens: int
    skipped: bool
    # Some rank asked to stop (a preemption signal), agreed by every rank in this step's all-reduce.
    stop_agreed: bool = False


def token_loss_sum(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
    """Summed cross-entropy over the target tokens; ``positions`` (document masking) go to the model."""
    try:
        # Always model(x): FSDP's hooks live on __call__.
        logits = model(inputs) if positions is None else model(inputs, positions=positions)
    except RuntimeError as exc:
        explained = explain_bypassed_forward(exc)
        if explained is not None:
            raise explained from exc
        raise
    return F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def global_sum_tensor(value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over all ranks, left on its device: no host synchronisation."""
    if dist.get_world_size() > 1:
        dist.all_reduce(value)
    return value


def global_sum(values: list[float], device: torch.device) -> list[float]:
    """``values`` summed over all ranks, read back to the host (float64)."""
    return global_sum_tensor(torch.tensor(values, dtype=torch.float64, device=device)).tolist()


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
               sharded_accumulation: bool = True,
               stop_requested: Callable[[], bool] | None = None) -> StepStats:
    """One optimizer step (``step`` is its 1-based number; ``phases`` records memory per phase).

    With several micro-batches, ``sharded_accumulation`` reduce-scatters after every backward (only
    sharded gradients are held; replicas of a hybrid mesh all-reduce on the last one only);
    otherwise gradients stay unsharded and are reduced once, on the last micro-batch.
    ``stop_requested()`` (this rank was signalled), asked after backward, rides on the loss
    all-reduce, so that every rank learns of any rank's request without a collective or host
    synchronisation of its own.
    """
    # The global token count stays on the device (an asynchronous all-reduce): reading it back here
    # would stall the host until the previous step's optimizer kernels finished.
    local_tokens = sum(int((batch.targets != IGNORE_INDEX).sum()) for batch in micro_batches)
    global_tokens = global_sum_tensor(torch.full((), local_tokens, dtype=torch.float64, device=device))
    divisor = global_tokens.float()

    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    last = len(micro_batches) - 1
    rank = dist.get_rank()
    if phases is not None:
        phases.start()
    for index, batch in enumerate(micro_batches):
        prepare_micro_batch(model, index, len(micro_batches), sharded_accumulation)
        loss = token_loss_sum(model, *batch.to(device, non_blocking=True)) / divisor
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
    scale = clip_scale(grad_clip_norm, grad_norm) if grad_clip_norm > 0 else torch.ones((), device=device)
    # The step's one host synchronisation: what the skip decision and the log need, in one transfer.
    stop = float(stop_requested()) if stop_requested is not None else 0.0
    loss_and_stop = global_sum_tensor(torch.stack(
        [loss_sum.double(), torch.full((), stop, dtype=torch.float64, device=device)]))
    loss_value, stops, norm_value, scale_value, tokens = torch.cat(
        [loss_and_stop, torch.stack([grad_norm.double(), scale.double(), global_tokens])]).tolist()
    if tokens == 0:
        raise TrainingError("a training step had no target tokens on any rank; check the data")
    skipped = not (math.isfinite(norm_value) and math.isfinite(loss_value))
    if not skipped:
        if scale_value < 1.0:
            clip_grads_(params, scale)
        optimizer.step()
    if phases is not None:
        phases.mark("optimizer")
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    if phases is not None:
        phases.mark("end")
    return StepStats(loss=loss_value, grad_norm=norm_value, tokens=int(tokens), skipped=skipped,
                     stop_agreed=stops > 0)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch], device: torch.device) -> float:
    """Mean loss per target token over the validation set (identical on every rank)."""
    was_training = model.training
    model.eval()
    loss = 0.0
    tokens = 0
    for batch in batches:
        loss += token_loss_sum(model, *batch.to(device)).item()
        tokens += int((batch.targets != IGNORE_INDEX).sum())
    model.train(was_training)
    reshard_all(model)
    loss, tokens = global_sum([loss, tokens], device)
    return loss / max(tokens, 1)
