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
import numbers
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shardtrain import faults
from shardtrain.diagnostics.memory import PhaseMemory
from shardtrain.diagnostics.rails import explain_bypassed_forward
from shardtrain.distributed.agreement import agree, attempt, raise_agreed
from shardtrain.distributed.embedding_exchange import ExchangedEmbedding
from shardtrain.distributed.parallelize import reshard_all
from shardtrain.errors import TrainingError
from shardtrain.tasks.samples import batch_size, to_device
from shardtrain.tasks.task import LossOutput, Task
from shardtrain.train.grad import check_gradients_sharded, clip_grads_, clip_scale, global_grad_norm
from shardtrain.train.optim import skips_on_device, step_unless


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    count: float  # the step's global count (target tokens for the language model)
    skipped: bool
    # Some rank asked to stop (a preemption signal), agreed by every rank in this step's all-reduce.
    stop_agreed: bool = False
    # Some rank's async checkpoint save was still being written when this step reduced: no rank
    # finalizes it yet, so every rank reports (or raises) it at the same step.
    save_in_flight_anywhere: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    # Each metric's global sum and divisor (its own count, or the step's count): what the loop adds
    # over a logging interval and divides once, so a step whose count is 0 does not make the
    # interval NaN and steps of unequal counts weigh by their counts.
    metric_sums: dict[str, tuple[float, float]] = field(default_factory=dict)
    flops: float = 0.0  # the step's training FLOPs over all ranks (0: unknown)
    metric_kinds: tuple[tuple[str, bool], ...] = ()
    # The learning rate this step trained at (the first parameter group's): the schedule has moved on
    # to the next step's when the step returns.
    lr: float = float("nan")


def run_loss(task: Task, model: nn.Module, batch: Any, training: bool = False) -> LossOutput:
    """``task.loss``, with FSDP's cryptic error for a bypassed ``__call__`` explained, and its
    result checked: a summed scalar loss (``training``: one backward can reach the weights from),
    one count, and metrics of one number or a (sum, count) pair each, so that a wrong value is one
    line naming the task rather than torch's error from deep in the step."""
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
        what = (f"of shape {list(out.loss.shape)}" if isinstance(out.loss, torch.Tensor)
                else f"of type {type(out.loss).__name__} (a tensor's .item() leaves nothing to backward)"
                if isinstance(out.loss, (int, float)) else f"of type {type(out.loss).__name__}")
        raise TrainingError(f"{type(task).__name__}.loss returned a loss {what}; it must be a scalar "
                            "tensor, the loss summed over the micro-batch")
    if training and not out.loss.requires_grad:
        raise TrainingError(f"{type(task).__name__}.loss returned a loss that does not require grad; "
                            "compute it from the model's output (call model(...); no detach(), no "
                            "torch.no_grad()) so that backward reaches the weights")
    check_scalar(task, "a count", out.count, "the micro-batch's total count (a number or a one-element "
                 "tensor), not one per sample")
    if not isinstance(out.metrics, Mapping):  # (None: an AttributeError from here, found by review)
        raise TrainingError(f"{type(task).__name__}.loss returned metrics as {type(out.metrics).__name__}; "
                            "return a dict of name -> value, or leave metrics out")
    for name, value in out.metrics.items():
        if isinstance(value, tuple) and len(value) == 2:
            for part, what in zip(value, ("sum", "count")):
                check_scalar(task, f"metric {name!r} with a {what}", part,
                             "(sum, count) as a tuple of two numbers or one-element tensors")
        elif isinstance(value, (torch.Tensor, numbers.Real)):
            check_scalar(task, f"metric {name!r}", value, "a number or a one-element tensor summed over "
                         "the micro-batch, or a tuple (sum, count)")
        else:
            raise TrainingError(f"{type(task).__name__}.loss returned metric {name!r} as "
                                f"{type(value).__name__}; return a number or one-element tensor summed "
                                "over the micro-batch, or a tuple (sum, count)")
    return LossOutput(whole(out.loss), whole(out.count),
                      {name: tuple(map(whole, value)) if isinstance(value, tuple) else whole(value)
                       for name, value in out.metrics.items()})


def whole(value: Any) -> Any:
    """A DTensor value as a plain tensor holding its whole value: under tensor parallelism a task's
    loss or metric computed on vocabulary-split DTensor logits (``loss_parallel``) is one, and the
    step's sums are plain tensors. Differentiable, so backward still runs through ``loss_parallel``."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def count_ahead(task: Task, batch: Any) -> float:
    """``task.count(batch)`` as a number (the batch is still on the CPU: no device read)."""
    count = task.count(batch)
    if count is None:
        raise TrainingError(f"{type(task).__name__}.count(batch) returned None; a task that defines "
                            "count() must give every batch's count (or not define it)")
    if not (isinstance(count, numbers.Real) and not isinstance(count, bool)
            or isinstance(count, torch.Tensor) and count.numel() == 1):
        found = (f"a tensor of shape {list(count.shape)}" if isinstance(count, torch.Tensor)
                 else type(count).__name__)
        raise TrainingError(f"{type(task).__name__}.count(batch) returned {found}; return the "
                            "micro-batch's total count, a number or a one-element tensor")
    if float(count) < 0:
        raise TrainingError(negative_count(task, "count(batch) returned", float(count)))
    return float(count)


def negative_count(task: Task, what: str, count: float) -> str:
    """A count below 0 divides the gradients by it: the step ascends the loss, and the run trained
    on without a word (found by review)."""
    return (f"{type(task).__name__}.{what} {count:g}; a count is what the loss is normalised by "
            "(tokens, samples), at least 0")


def check_scalar(task: Task, what: str, value: Any, expected: str) -> None:
    """``value`` is one number (a Python number or a one-element tensor), else one line naming
    ``task`` and ``expected`` (torch's own error would be a reshape's, far from the task)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return
        found = f"a tensor of shape {list(value.shape)}"
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        return
    else:
        found = type(value).__name__
    raise TrainingError(f"{type(task).__name__}.loss returned {what} as {found}; return {expected}")


def as_scalar(value: Any, device: torch.device) -> torch.Tensor:
    """A count or metric (tensor or number) as a float64 scalar on ``device``; a number becomes a
    fill on the device, not a copy from the host (which would wait for the queued kernels)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64).reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=device)


def metric_kinds(metrics: dict) -> tuple[tuple[str, bool], ...]:
    """(name, has its own count) of each metric, in name order: what must not change."""
    return tuple(sorted((name, isinstance(value, tuple)) for name, value in metrics.items()))


class MetricSums:
    """The task's extra values, summed over micro-batches: a value alone is normalised by the
    loss's count, a ``(sum, count)`` pair by its own. ``kinds``: the names (and kinds) every
    micro-batch of the run must return, fixed by the first step: the step's one all-reduce carries
    them, so a rank with other names would leave the others waiting in it."""

    def __init__(self, device: torch.device, kinds: tuple[tuple[str, bool], ...] | None = None) -> None:
        self.device = device
        self.kinds = kinds
        self.sums: dict[str, list[torch.Tensor]] = {}
        # Other names than ``kinds`` from a loss call on this rank: said after the all-reduce (which
        # carries the flag), so that every rank raises it together rather than this one alone.
        self.changed: str | None = None

    def add(self, metrics: dict) -> None:
        kinds = metric_kinds(metrics)
        if self.kinds is None:
            self.kinds = kinds
        elif kinds != self.kinds:
            self.changed = self.changed or (
                f"the task's metrics changed: {list(self.kinds)} before, {list(kinds)} now (name, has its "
                "own count); return the same names, of the same kind, from every loss call")
            return
        for name, value in metrics.items():
            total, count = value if isinstance(value, tuple) else (value, 0.0)
            pair = [as_scalar(total, self.device), as_scalar(count, self.device)]
            old = self.sums.get(name)
            self.sums[name] = pair if old is None else [a + b for a, b in zip(old, pair)]

    def vector(self) -> list[torch.Tensor]:
        """Each metric's sum and own count, in name order, for the step's one all-reduce (as long on
        every rank that agreed on ``kinds``), then whether this rank's metrics changed."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        sums = [t for name, _ in self.kinds or () for t in self.sums.get(name, (zero, zero))]
        changed = torch.full((), float(self.changed is not None), dtype=torch.float64, device=self.device)
        return [*sums, changed]

    def raise_if_changed(self, reduced: list[float]) -> None:
        """Every rank raises the first changed rank's error once any rank's metrics changed
        (``reduced``: the reduced ``vector``; every rank sees the same flag, so all gather)."""
        if reduced[-1] > 0:
            agree(self.changed, error_type=TrainingError)

    def pairs(self, reduced: list[float], count: float) -> dict[str, tuple[float, float]]:
        """Each metric's global (sum, divisor): its own count, or ``count`` (the loss's)."""
        out = {}
        for index, (name, own_count) in enumerate(self.kinds or ()):
            total, own = reduced[2 * index], reduced[2 * index + 1]
            out[name] = (total, own if own_count else count)
        return out

    def values(self, reduced: list[float], count: float) -> dict[str, float]:
        return {name: ratio(total, divisor)
                for name, (total, divisor) in self.pairs(reduced, count).items()}


def ratio(total: float, divisor: float) -> float:
    """A mean, or NaN where nothing was counted."""
    return total / divisor if divisor else float("nan")


# The evaluation record's own fields, which a validation metric's val_<name> must not take.
EVALUATION_FIELDS = frozenset({"val_loss", "ema_val_loss"})


def check_metric_names(task: Task, kinds: tuple[tuple[str, bool], ...], reserved: frozenset[str]) -> None:
    """A metric is logged beside the record's own fields (and as ``val_<name>``, and with a weight
    average ``ema_val_<name>``): a name that is one of them, or whose other forms are another
    metric's, would overwrite it without a word."""
    names = {name for name, _ in kinds}

    def forms(name: str) -> tuple[str, str, str]:
        return name, f"val_{name}", f"ema_val_{name}"

    clashes = sorted(name for name in names
                     if any(form in reserved for form in forms(name))
                     or any(name in forms(other)[1:] for other in names))
    if clashes:
        raise TrainingError(f"{type(task).__name__}.loss returned metrics {clashes} named like fields of "
                            "the metrics record (loss, lr, grad_norm, <unit>_seen, <unit>_per_s, ..., "
                            "or val_<metric>, ema_val_<metric>), which they would overwrite; rename them")


def global_sum_tensor(value: torch.Tensor, copies: int = 1) -> torch.Tensor:
    """``value`` summed over all ranks, left on its device: no host synchronisation. ``copies``:
    how many ranks hold each data-parallel rank's values (the tensor-parallel degree, whose group
    shares one micro-batch and one loss), divided out: a sum over data-parallel ranks."""
    if dist.get_world_size() > 1:
        dist.all_reduce(value)
    return value / copies if copies > 1 else value


def tensor_parallel_degree(mesh: DeviceMesh | None) -> int:
    """The size of the mesh's ``tp`` dimension (1 without one)."""
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    return mesh.size(names.index("tp")) if "tp" in names else 1


def loss_context(copies: int) -> AbstractContextManager:
    """Under tensor parallelism the logits are split along the vocabulary: ``loss_parallel`` takes
    the cross-entropy on them without gathering them (its backward must run inside it too)."""
    return loss_parallel() if copies > 1 else nullcontext()


def prepare_micro_batch(model: nn.Module, index: int, count: int, sharded_accumulation: bool) -> None:
    """Tell FSDP (and the exchanged embeddings) which reductions micro-batch ``index`` of ``count`` runs.

    Sharded accumulation reduce-scatters after every backward (only sharded gradients are held) and
    all-reduces across the replicas of a hybrid mesh on the last micro-batch only; unsharded
    accumulation keeps full gradients and reduces once, on the last.
    """
    if not isinstance(model, FSDPModule) or count < 2:
        return
    for module in model.modules():
        if isinstance(module, ExchangedEmbedding):
            module.sum_replicas = index == count - 1
    if sharded_accumulation:
        model.set_requires_all_reduce(index == count - 1)
    else:
        model.set_requires_gradient_sync(index == count - 1)


def counts_ahead(task: Task) -> bool:
    """The task knows a batch's count before the forward (it defines ``count``): decided by the
    task's class, the same on every rank and step, so every rank takes the same collectives."""
    return type(task).count is not Task.count


def check_same_on_every_rank(what: str, value: Any) -> None:
    """Every rank holds the same ``value``, or every rank raises the same error (one collective;
    for what is decided once, such as the first step's metric names)."""
    if dist.get_world_size() < 2:
        return
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if any(v != values[0] for v in values):
        differing = next(rank for rank, v in enumerate(values) if v != values[0])
        raise TrainingError(f"ranks disagree on {what}: rank 0 has {values[0]}, rank {differing} has "
                            f"{values[differing]}; return the same from every rank")


@contextmanager
def held_failure_first(held: Exception | None) -> Iterator[None]:
    """The task's count() or flops() failure this rank holds (``attempt``), raised in place of an
    error the loss then meets on the same batches, which it names: the first failure is the cause
    (found by review: the loss's own error came first, the held one lost)."""
    try:
        yield
    except Exception as exc:
        if held is None:
            raise
        held.add_note(f"the loss on the same batches then failed too: {type(exc).__name__}: {exc}")
        raise held from None


def local_flops(task: Task, micro_batches: list[Any], counted_per_sample: float | None) -> float:
    """This rank's training FLOPs of the step: the task's own count, or the measured FLOPs per
    sample (``count_flops``) times the samples."""
    if counted_per_sample is not None:
        return counted_per_sample * sum(batch_size(batch) for batch in micro_batches)
    if type(task).flops is Task.flops:  # the counter could not run the task: unknown, said once
        return 0.0
    total = 0.0
    for batch in micro_batches:
        flops = task.flops(batch)
        if isinstance(flops, torch.Tensor) and flops.numel() == 1:  # a count's forms are taken here too
            flops = float(flops)
        if flops is None or isinstance(flops, bool) or not isinstance(flops, numbers.Real) or not (
                0 <= flops < math.inf):
            # None: this rank's step counted as none, an MFU understated without a word; text: a
            # TypeError from the sum; NaN: "nan GFLOP/s" logged (found by reviews)
            raise TrainingError(f"{type(task).__name__}.flops returned {flops!r}: a task's flops(batch) "
                                "returns the micro-batch's training FLOPs, a finite number of at least "
                                "0; leave flops undefined to have torch's FLOP counter count them")
        total += flops
    return total


def failing_part(exc: BaseException) -> str:
    """Which part of a training step raised ``exc``, read from its traceback: "the optimizer step"
    (inside torch.optim, its hooks included), "the gradient norm and clipping" (train/grad.py),
    "backward" (autograd's engine, a checkpoint's recomputation included) or "forward" (the model
    and the loss)."""
    codes = [frame.f_code for frame, _ in traceback.walk_tb(exc.__traceback__)]
    if any(Path(code.co_filename).parts[-3:-1] == ("torch", "optim") for code in codes):
        return "the optimizer step"
    if any(code.co_filename == global_grad_norm.__code__.co_filename for code in codes):
        return "the gradient norm and clipping"
    # Tensor.backward and torch.autograd.backward (forward passes through torch.autograd too: every
    # autograd Function's apply, checkpoint's forward).
    if any(code.co_name == "backward" and "torch" in Path(code.co_filename).parts[-3:-1] for code in codes):
        return "backward"
    return "forward"


def compile_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is torch.compile's own failure (dynamo's or inductor's, all of them
    ``TorchDynamoException``s), told by its class name: importing dynamo here would cost every
    command its import time. Not ``TorchRuntimeError``: the model's own error met while tracing
    (a wrong shape), which it raises eagerly too."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return "TorchDynamoException" in names and "TorchRuntimeError" not in names


def graph_break_counts() -> dict[str, int]:
    """dynamo's graph breaks in this process so far, by reason (process-wide and cumulative: an
    earlier compile's, a library user's earlier Trainer's, count too); empty where nothing compiled."""
    utils = sys.modules.get("torch._dynamo.utils")
    return dict(getattr(utils, "counters", {}).get("graph_break", {})) if utils is not None else {}


def graph_breaks_note(before: dict[str, int] | None = None) -> str | None:
    """torch.compile's graph breaks since ``before`` (``graph_break_counts`` when the run started),
    as one line naming the commonest reasons (their first
    lines); None where there were none, or nothing was compiled. A break in a checkpointed block makes
    dynamo run that block eagerly for the rest of the run: compile=true trained at eager speed
    without a word. Read from dynamo's counters where compiling imported them (importing dynamo
    here would cost every command its import time)."""
    now = graph_break_counts()
    before = before or {}
    breaks = {reason: count - before.get(reason, 0) for reason, count in now.items()
              if count > before.get(reason, 0)}
    if not breaks:
        return None
    reasons = sorted(breaks.items(), key=lambda item: -item[1])
    named = "; ".join(f"{count} x {reason.strip().splitlines()[0][:160]}" for reason, count in reasons[:3])
    return (f"strategy.compile=true: {sum(breaks.values())} graph break(s) in the compiled blocks ({named}"
            f"{'; ...' if len(reasons) > 3 else ''}): those parts run eagerly, a checkpointed block "
            "all of it; TORCH_LOGS=graph_breaks names where")


def train_step(model: nn.Module, task: Task, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, micro_batches: list[Any],
               mesh: DeviceMesh, grad_clip_norm: float, device: torch.device,
               step: int = 0, phases: PhaseMemory | None = None,
               sharded_accumulation: bool = True,
               stop_requested: Callable[[], bool] | None = None,
               save_in_flight: Callable[[], bool] | None = None,
               flops_per_sample: float | None = None,
               metric_kinds: tuple[tuple[str, bool], ...] | None = None,
               reserved_names: frozenset[str] = frozenset()) -> StepStats:
    """One optimizer step (``step`` is its 1-based number; ``phases`` records memory per phase).

    With several micro-batches, ``sharded_accumulation`` reduce-scatters after every backward (only
    sharded gradients are held; replicas of a hybrid mesh all-reduce on the last one only);
    otherwise gradients stay unsharded and are reduced once, on the last micro-batch.
    ``stop_requested()`` (this rank was signalled), asked after backward, rides on the loss
    all-reduce, so that every rank learns of any rank's request without a collective or host
    synchronisation of its own; ``save_in_flight()`` (this rank's async save is still being
    written) rides along the same way. ``metric_kinds``: the task's metrics as the first step returned
    them (None on the first step, whose names every rank then compares once, and refuses those
    in ``reserved_names``: the metrics record's own fields).
    """
    copies = tensor_parallel_degree(mesh)
    divisor = None
    # The task's count() and flops() run on this rank's batches alone: one that raises on one rank
    # (None from count(), a KeyError) is held, carried as a flag on the step's all-reduce and raised
    # on every rank after it; raised here, it left the other ranks in the next collective until the
    # launcher's or the process group's timeout. The step is skipped, so its held values do no harm.
    held = None
    if counts_ahead(task):
        ahead, held = attempt(lambda: sum(count_ahead(task, batch) for batch in micro_batches))
        # The global count stays on the device (an asynchronous all-reduce): reading it back here
        # would stall the host until the previous step's optimizer kernels finished.
        global_count = global_sum_tensor(torch.full((), ahead or 0.0, dtype=torch.float64, device=device),
                                         copies)
        divisor = global_count.float()
    flops, flops_failure = attempt(lambda: local_flops(task, micro_batches, flops_per_sample))
    held = held or flops_failure

    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    returned_count = torch.zeros((), dtype=torch.float64, device=device)
    # micro-batches whose own count is below 0: hidden in a positive total, they divided the step
    # by a wrong count without a word (found by review); summed with the rest, no read of its own
    negative_counts = torch.zeros((), dtype=torch.float64, device=device)
    metrics = MetricSums(device, metric_kinds)
    rank = dist.get_rank()
    if phases is not None:
        phases.start()
    for index, batch in enumerate(micro_batches):
        prepare_micro_batch(model, index, len(micro_batches), sharded_accumulation)
        with loss_context(copies), held_failure_first(held):
            out = run_loss(task, model, to_device(batch, device, non_blocking=True), training=True)
            loss = out.loss / divisor if divisor is not None else out.loss
            if index == 0:
                loss = faults.poison_loss(rank, step, loss)
            if phases is not None:  # each micro-batch's: the phase's peak is the largest of them
                phases.mark("forward")
            loss.backward()
        if phases is not None:
            phases.mark("backward")
        loss_sum += loss.detach()
        batch_count = as_scalar(out.count, device)
        returned_count += batch_count
        negative_counts += batch_count < 0
        metrics.add(out.metrics)
    if metric_kinds is None:
        check_same_on_every_rank("the task's metrics (name, has its own count)", metrics.kinds)
        check_metric_names(task, metrics.kinds or (), reserved_names)

    params = [p for p in model.parameters() if p.grad is not None]
    check_gradients_sharded(model, params)
    if divisor is None:
        global_count = global_sum_tensor(returned_count.clone(), copies)
        clip_grads_(params, (1.0 / global_count).float())
    grad_norm = global_grad_norm(params, mesh)
    scale = clip_scale(grad_clip_norm, grad_norm) if grad_clip_norm > 0 else torch.ones((), device=device)
    flags = [float(asked()) if asked is not None else 0.0 for asked in (stop_requested, save_in_flight)]
    host_values = [torch.full((), value, dtype=torch.float64, device=device)
                   for value in (*flags, flops or 0.0, float(held is not None))]
    summed = global_sum_tensor(torch.stack(
        [loss_sum.double(), *host_values[:2], returned_count, host_values[2], negative_counts,
         host_values[3], *metrics.vector()]), copies)
    on_device = skips_on_device(optimizer)
    if on_device:
        # The skip decision stays on the device (the same on every rank: both are global), so the
        # update is queued before the host waits for anything.
        if grad_clip_norm > 0:
            clip_grads_(params, scale)  # a factor of exactly 1 changes nothing
        # (a negative count too, which would step up the loss: refused below, after no update)
        step_unless(optimizer, ~(torch.isfinite(grad_norm) & torch.isfinite(summed[0]) & (global_count >= 0)
                                 & (summed[5] == 0) & (summed[6] == 0)))
    # The step's one host synchronisation: what the skip decision and the log need, in one transfer
    # (after the update where the optimizer skips on the device, else before it).
    values = torch.cat([torch.stack([grad_norm.double(), scale.double(), global_count]), summed]).tolist()
    (norm_value, scale_value, count, loss_value, stops, saving, returned, flops_value, negatives,
     held_anywhere, *metric_values) = values
    if held_anywhere:
        raise_agreed(held)
    metrics.raise_if_changed(metric_values)
    if count < 0:
        raise TrainingError(negative_count(task, "loss returned counts summing over the step to", count))
    if negatives:
        what = f"loss returned a count below 0 in {negatives:g} micro-batch(es) of the step, their total"
        raise TrainingError(negative_count(task, what, count))
    if count == 0:
        # Nothing to learn from on any rank (a global batch of prompts alone: records longer than
        # the windows). Skipped as a non-finite step is, its data consumed: it raised, and a resume
        # replayed the same batch, so the run could never finish. The loop says why.
        loss_value = float("nan")
    elif divisor is None:
        loss_value /= count
    # Within float32's rounding: a fractional count (a weighted sum) summed on the device and on
    # the CPU in another order differs by some 1e-7 (a mismatch of the contract is far larger).
    elif not math.isclose(returned, count, rel_tol=1e-6):
        raise TrainingError(f"{type(task).__name__}.count(batch) gave {count:g} for this step but "
                            f"loss(...) returned a count of {returned:g}; they must agree")
    skipped = not (math.isfinite(norm_value) and math.isfinite(loss_value))
    if not skipped and not on_device:
        if scale_value < 1.0:
            clip_grads_(params, scale)
        optimizer.step()
    if phases is not None:
        phases.mark("optimizer")
    optimizer.zero_grad(set_to_none=True)
    lr = optimizer.param_groups[0]["lr"]
    if not skipped:  # a skipped step leaves the schedule where it was, as it leaves the optimizer
        scheduler.step()
    if phases is not None:
        phases.mark("end")
    return StepStats(loss=loss_value, grad_norm=norm_value, count=count, skipped=skipped,
                     stop_agreed=stops > 0, save_in_flight_anywhere=saving > 0,
                     metrics=metrics.values(metric_values, count),
                     metric_sums=metrics.pairs(metric_values, count),
                     flops=flops_value, metric_kinds=metrics.kinds or (), lr=float(lr))


class Evaluation(NamedTuple):
    """An evaluation's outcome, the same on every rank."""
    loss: float  # the summed loss over the global count
    metrics: dict[str, float]
    count: float  # the task's global count (target tokens for a language model)


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, batches: Sequence[tuple[Any, float]],
             device: torch.device, mesh: DeviceMesh | None = None,
             progress: Callable[[], None] | None = None) -> Evaluation:
    """The loss over the validation set, normalised by its global count, and the task's metrics.
    A batch of weight 0 (padding) runs its forward and counts nothing. ``mesh``: the model's
    (needed with tensor parallelism). ``progress``: called before each batch (the watchdog's beat:
    each forward is bounded, not the whole pass)."""
    was_training = model.training
    model.eval()
    loss = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    metrics = MetricSums(device)
    copies = tensor_parallel_degree(mesh)
    try:
        for batch, weight in batches:
            if progress is not None:
                progress()
            with loss_context(copies):
                out = run_loss(task, model, to_device(batch, device))
            loss += out.loss.double() * weight
            count += as_scalar(out.count, device) * weight
            metrics.add({name: tuple(as_scalar(v, device) * weight for v in value)
                         if isinstance(value, tuple) else as_scalar(value, device) * weight
                         for name, value in out.metrics.items()})
    finally:  # a library caller that catches a task's error gets its model back as it gave it
        model.train(was_training)
    reshard_all(model)
    # Evaluation may return other metrics than training does, but the same on every rank: each
    # rank's names decide the length of the all-reduce below.
    check_same_on_every_rank("the task's validation metrics (name, has its own count)", metrics.kinds)
    # Logged as val_<name>: one named "loss" would replace val_loss, which keep_best and early
    # stopping judge (training's names are checked at the first step, these may differ).
    check_metric_names(task, metrics.kinds or (), EVALUATION_FIELDS)
    loss_value, count_value, *metric_values = global_sum_tensor(
        torch.stack([loss, count, *metrics.vector()]), copies).tolist()
    metrics.raise_if_changed(metric_values)
    mean = loss_value / count_value if count_value else float("nan")
    return Evaluation(mean, metrics.values(metric_values, count_value), count_value)
