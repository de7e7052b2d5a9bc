"""The hand-written, single-process loop every example task is checked against (tests/test_tasks.py).

Plain PyTorch, no FSDP: the same model and initial weights, the same samples in the same global
order with the same per-sample draws, the mean loss over the whole global batch (summed loss over
its count), ``torch.nn.utils.clip_grad_norm_`` and AdamW with the framework's parameter groups and
schedule. What differs from a sharded run is only what the framework must get right: sharding,
accumulation, the global normalisation, clipping across shards, mixed precision casts.
"""

from __future__ import annotations

import numpy as np
import torch

from shardtrain.config.schema import Config
from shardtrain.data.batches import GlobalOrder
from shardtrain.distributed.sharded_model import init_full_parameter
from shardtrain.tasks.samples import draw_seed
from shardtrain.tasks.task import Task
from shardtrain.train.optim import build_optimizer, build_scheduler


def reference_model(task: Task, seed: int) -> torch.nn.Module:
    """The model with the framework's initial weights: the task's initialiser on every full
    parameter, or the module's own initialisation seeded as the framework seeds a CPU build."""
    torch.manual_seed(seed)
    model = task.build_model()
    if getattr(task, "init_parameter", None) is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                init_full_parameter(task, name, param, seed)
    return model


def global_batch(task: Task, dataset, order: GlobalOrder, start: int, size: int, seed: int):
    ids = order.take(start, size)
    draw = task.draw_hook()
    items = []
    for index, key in zip(ids.tolist(), np.arange(start, start + size).tolist()):
        item = dataset[index]
        if draw is not None:
            item = draw(item, torch.Generator().manual_seed(draw_seed(seed, 0, key)))
        items.append(item)
    return task.collate(items)


def reference_run(task: Task, cfg: Config, steps: int, model: torch.nn.Module | None = None) -> dict:
    """``steps`` steps on the whole global batch; losses, gradient norms and final weights (of
    ``model``, default the task's ``reference_model``)."""
    task.bind(cfg)
    t = cfg.trainer
    seed = t.seed
    size = t.micro_batch_size * t.grad_accum_steps  # the caller sets a one-process global batch
    model = reference_model(task, seed) if model is None else model
    optimizer, dataset = build_optimizer(model, t), task.train_dataset()
    scheduler = build_scheduler(optimizer, t)
    order = GlobalOrder(len(dataset), seed)
    losses, norms = [], []
    for step in range(steps):
        out = task.loss(model, global_batch(task, dataset, order, step * size, size, seed))
        loss = out.loss / out.count
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "weights": weights}
