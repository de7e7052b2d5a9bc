"""Training FLOPs of a task that cannot tell them (``Task.flops``): counted once, before training,
by torch's FLOP counter on a fake copy of the model and the task's example batch. Counting outside
the training step keeps the step as it is (no dispatch mode in it, the same kernels, compiled or
not, in a fresh and a resumed run)."""

from __future__ import annotations

import logging

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from shardtrain.diagnostics.kept import fake_tensor_errors_unlogged
from shardtrain.tasks.samples import batch_size
from shardtrain.tasks.task import Task

log = logging.getLogger("shardtrain")


def counted_flops_per_sample(task: Task, micro_batch_size: int) -> float | None:
    """3x the forward FLOPs per sample of ``task.loss`` on its example batch (backward costs about
    twice the forward); None, with one warning, where the task's code cannot run on fake tensors."""
    batch = task.example_batch(micro_batch_size)
    try:
        with torch.device("meta"):
            model = task.build_model()
        with FakeTensorMode(allow_non_fake_inputs=True), fake_tensor_errors_unlogged():
            model.to_empty(device="cpu")
            with FlopCounterMode(display=False) as counter:
                task.loss(model, batch)
    except Exception as exc:  # the task's own code, on fake tensors: any error type
        log.warning("FLOPs unknown (MFU not reported): the FLOP counter could not run %s.loss on a "
                    "fake model (%s: %s); give the task flops(batch)", type(task).__name__,
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    return 3 * counter.get_total_flops() / max(batch_size(batch), 1)
