"""Training FLOPs of a task that cannot tell them (``Task.flops``): counted once, before training,
by torch's FLOP counter on a fake copy of the model and the task's example batch. Counting outside
the training step keeps the step as it is (no dispatch mode in it, the same kernels, compiled or
not, in a fresh and a resumed run)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from shardtrain.data.batches import SampleSource
from shardtrain.diagnostics.kept import fake_tensor_errors_unlogged
from shardtrain.errors import first_line
from shardtrain.tasks.samples import batch_size
from shardtrain.tasks.task import Task, checked_model, leading_batch


def counted_flops_per_sample(task: Task, micro_batch_size: int, train: SampleSource | None = None
                             ) -> tuple[float | None, str | None]:
    """The training FLOPs per sample of ``task.loss`` on its example batch, its forward and its
    backward counted, not estimated as 3x the forward (the estimate counted twice what a loss
    computing its gradients in its forward did: the chunked cross-entropy, found by review), or
    None and why, where the task's code cannot run on fake tensors (the caller says so once a step has run: a
    loss the step refuses is the error to see first).
    ``train``: the training samples already made, whose first items are the default example batch
    (made again, a large in-memory dataset was loaded twice at start-up)."""
    if train is not None and type(task).example_batch is Task.example_batch:
        batch = leading_batch(train, micro_batch_size)
    else:
        batch = task.example_batch(micro_batch_size)
    why = (f"FLOPs unknown (MFU not reported): the FLOP counter could not run "
           f"{type(task).__name__}.loss on a fake model")
    try:
        with torch.device("meta"):
            built = task.build_model()
    except Exception as exc:  # the task's own code: any error type
        return None, f"{why} ({type(exc).__name__}: {first_line(exc)}); give the task flops(batch)"
    model = checked_model(task, built)  # its refusal (a model built before) is the error to see
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), fake_tensor_errors_unlogged():
            model.to_empty(device="cpu")
            with FlopCounterMode(display=False) as counter:
                loss = task.loss(model, batch).loss
                if loss.requires_grad:  # (a model frozen whole trains nothing: its forward alone)
                    loss.backward()
    except Exception as exc:  # the task's own code, on fake tensors: any error type
        return None, f"{why} ({type(exc).__name__}: {first_line(exc)}); give the task flops(batch)"
    return counter.get_total_flops() / max(batch_size(batch), 1), None
