"""One optimizer step and one evaluation pass, written once for every task and strategy.

The gradient is the global mean: the loss summed over every rank and micro-batch of the step,
divided by the count summed over every rank and micro-batch (``LossOutput.count``), with FSDP
summing gradients instead of averaging them. So any split of the global batch into ranks and
micro-batches gives the same gradient as one process computing the mean over the whole batch.

When the task knows a micro-batch's count before the forward (``Task.count``: the language model's
target tokens) the global count is all-reduced first and each micro-batch's loss is divided by it
before backward (what torchtitan does). Otherwise the summed losses are backpropagated and the
accumulated gradients are divided by the global count once, after the last micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.utils.flop_counter import FlopCounterMode

from shardtrain import faults
from shardtrain.diagnostics.memory import PhaseMemory
from shardtrain.diagnostics.rails import explain_bypassed_forward
from shardtrain.distributed.parallelize import reshard_all
from shardtrain.errors import TrainingError
from shardtrain.tasks.samples import batch_size, to_device
from shardtrain.tasks.task import LossOutput, Task
from shardtrain.train.grad import clip_grads_, clip_scale, global_grad_norm


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    count: float  # the step's global count (target tokens for the language model)
    skipped: bool
    # Some rank asked to stop (a preemption signal), agreed by every rank in this step's all-reduce.
    stop_agreed: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    flops: float = 0.0  # the step's training FLOPs over all ranks (0: unknown)


def run_loss(task: Task, model: nn.Module, batch: Any) -> LossOutput:
    """``task.loss``, with FSDP's cryptic error for a bypassed ``__call__`` explained, and its
    result checked: a summed scalar loss and a count."""
    try:
        out = task.loss(model, batch)
    except RuntimeError as exc:
        explained = explain_bypassed_forward(exc)
        if explained is not None:
            raise explained from exc
        raise
    if not isinstance(out, LossOutput):
        raise TrainingError(f"{type(task).__name__}.loss returned {type(out).__name__}; return "
                            "LossOutput(loss=summed loss, count=what it is normalised by)")
    if not (isinstance(out.loss, torch.Tensor) and out.loss.ndim == 0):
        shape = list(out.loss.shape) if isinstance(out.loss, torch.Tensor) else type(out.loss).__name__
        raise TrainingError(f"{type(task).__name__}.loss returned a loss of shape {shape}; it must be "
                            "a scalar tensor, the loss summed over the micro-batch")
    return out


def as_scalar(value: Any, device: torch.device) -> torch.Tensor:
    """A count or metric (tensor or number) as a float64 scalar on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64, device=device)


class MetricSums:
    """The task's extra values, summed over micro-batches: a value alone is normalised by the
    loss's count, a ``(sum, count)`` pair by its own."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, list[torch.Tensor]] = {}

    def add(self, metrics: dict) -> None:
        if self.sums and sorted(metrics) != sorted(self.sums):
            raise TrainingError(f"the task's metrics changed between micro-batches ({sorted(self.sums)} "
                                f"vs {sorted(metrics)}); return the same names every time")
        for name, value in metrics.items():
            total, count = value if isinstance(value, tuple) else (value, None)
            pair = [as_scalar(total, self.device),
                    as_scalar(count, self.device) if count is not None else None]
            if name not in self.sums:
                self.sums[name] = pair
            else:
                self.sums[name] = [a + b if a is not None else None for a, b in zip(self.sums[name], pair)]

    def vector(self) -> list[torch.Tensor]:
        """Sums and own counts, in name order, for the step's one all-reduce."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        return [t if t is not None else zero for name in sorted(self.sums) for t in self.sums[name]]

    def values(self, reduced: list[float], count: float) -> dict[str, float]:
        out = {}
        for index, name in enumerate(sorted(self.sums)):
            total, own = reduced[2 * index], reduced[2 * index + 1]
            divisor = own if self.sums[name][1] is not None else count
            out[name] = total / divisor if divisor else float("nan")
        return out


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


def local_flops(task: Task, micro_batches: list[Any], counted_per_sample: float | None) -> float:
    """This rank's training FLOPs of the step: the task's own count, or the measured FLOPs per
    sample (``count_flops``) times the samples."""
    if counted_per_sample is not None:
        return counted_per_sample * sum(batch_size(batch) for batch in micro_batches)
    total = 0.0
    for batch in micro_batches:
        flops = task.flops(batch)
        if flops is None:
            return 0.0
        total += flops
    return total


def train_step(model: nn.Module, task: Task, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, micro_batches: list[Any],
               mesh: DeviceMesh, grad_clip_norm: float, device: torch.device,
               step: int = 0, phases: PhaseMemory | None = None,
               sharded_accumulation: bool = True,
               stop_requested: Callable[[], bool] | None = None,
               flops_per_sample: float | None = None,
               flop_counter: FlopCounterMode | None = None) -> StepStats:
    """One optimizer step (``step`` is its 1-based number; ``phases`` records memory per phase).

    With several micro-batches, ``sharded_accumulation`` reduce-scatters after every backward (only
    sharded gradients are held; replicas of a hybrid mesh all-reduce on the last one only);
    otherwise gradients stay unsharded and are reduced once, on the last micro-batch.
    ``stop_requested()`` (this rank was signalled), asked after backward, rides on the loss
    all-reduce, so that every rank learns of any rank's request without a collective or host
    synchronisation of its own. ``flop_counter`` counts the first micro-batch's forward.
    """
    ahead = [task.count(batch) for batch in micro_batches]
    divisor = None
    if all(count is not None for count in ahead):
        # The global count stays on the device (an asynchronous all-reduce): reading it back here
        # would stall the host until the previous step's optimizer kernels finished.
        global_count = global_sum_tensor(torch.full((), sum(ahead), dtype=torch.float64, device=device))
        divisor = global_count.float()
    flops = local_flops(task, micro_batches, flops_per_sample)

    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    returned_count = torch.zeros((), dtype=torch.float64, device=device)
    metrics = MetricSums(device)
    last = len(micro_batches) - 1
    rank = dist.get_rank()
    if phases is not None:
        phases.start()
    for index, batch in enumerate(micro_batches):
        prepare_micro_batch(model, index, len(micro_batches), sharded_accumulation)
        on_device = to_device(batch, device, non_blocking=True)
        if flop_counter is not None and index == 0:
            with flop_counter:
                out = run_loss(task, model, on_device)
        else:
            out = run_loss(task, model, on_device)
        loss = out.loss / divisor if divisor is not None else out.loss
        if index == 0:
            loss = faults.poison_loss(rank, step, loss)
        if phases is not None and index == last:
            phases.mark("forward")
        loss.backward()
        loss_sum += loss.detach()
        returned_count += as_scalar(out.count, device)
        metrics.add(out.metrics)
    if phases is not None:
        phases.mark("backward")

    params = [p for p in model.parameters() if p.grad is not None]
    if divisor is None:
        global_count = global_sum_tensor(returned_count.clone())
        clip_grads_(params, (1.0 / global_count).float())
    grad_norm = global_grad_norm(params, mesh)
    scale = clip_scale(grad_clip_norm, grad_norm) if grad_clip_norm > 0 else torch.ones((), device=device)
    # The step's one host synchronisation: what the skip decision and the log need, in one transfer.
    stop = float(stop_requested()) if stop_requested is not None else 0.0
    summed = global_sum_tensor(torch.stack(
        [loss_sum.double(), torch.full((), stop, dtype=torch.float64, device=device), returned_count,
         torch.full((), flops, dtype=torch.float64, device=device), *metrics.vector()]))
    loss_value, stops, returned, flops_value, *metric_values = summed.tolist()
    norm_value, scale_value, count = torch.stack(
        [grad_norm.double(), scale.double(), global_count]).tolist()
    if count == 0:
        raise TrainingError("a training step had a count of 0 on every rank (no target tokens, no "
                            "valid positions): nothing to learn from; check the data")
    if divisor is None:
        loss_value /= count
    elif returned != count:
        raise TrainingError(f"{type(task).__name__}.count(batch) gave {count:g} for this step but "
                            f"loss(...) returned a count of {returned:g}; they must agree")
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
    return StepStats(loss=loss_value, grad_norm=norm_value, count=count, skipped=skipped,
                     stop_agreed=stops > 0, metrics=metrics.values(metric_values, count),
                     flops=flops_value)


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, batches: list[tuple[Any, float]],
             device: torch.device) -> tuple[float, dict[str, float]]:
    """The loss over the validation set, normalised by its global count, and the task's metrics
    (identical on every rank). A batch of weight 0 (padding) runs its forward and counts nothing."""
    was_training = model.training
    model.eval()
    loss = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    metrics = MetricSums(device)
    for batch, weight in batches:
        out = run_loss(task, model, to_device(batch, device))
        loss += out.loss.double() * weight
        count += as_scalar(out.count, device) * weight
        metrics.add({name: tuple(as_scalar(v, device) * weight for v in value)
                     if isinstance(value, tuple) else as_scalar(value, device) * weight
                     for name, value in out.metrics.items()})
    model.train(was_training)
    reshard_all(model)
    loss_value, count_value, *metric_values = global_sum_tensor(
        torch.stack([loss, count, *metrics.vector()])).tolist()
    return loss_value / max(count_value, 1), metrics.values(metric_values, count_value)
