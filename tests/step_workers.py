"""Runs inside spawned ranks for tests/test_step.py."""

from __future__ import annotations

import dataclasses
import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from equivalence import case_config, small_corpus
from torch.utils._python_dispatch import TorchDispatchMode

from shardtrain.data.batches import IGNORE_INDEX
from shardtrain.errors import TrainingError
from shardtrain.tasks.language_model import LanguageModelTask
from shardtrain.tasks.task import LossOutput, Task
from shardtrain.train.loop import Trainer
from shardtrain.train.step import train_step


class HostReads(TorchDispatchMode):
    """Counts the reads of tensor values by the host that synchronise with an accelerator:
    ``item()``, ``bool()``, ``float()`` dispatch ``aten._local_scalar_dense``; ``tolist()`` and
    ``numpy()`` do not dispatch, so they are wrapped while the mode is active.

    On this CPU every tensor is a host tensor, so the reads of tensors that stay on the host on an
    accelerator too are told apart by where they happen: AdamW's step counters (CPU tensors unless
    capturable or fused) and ``Task.count`` on a micro-batch before it is moved to the device."""

    HOST_RESIDENT = {("_get_value", "optimizer.py"), ("count", "language_model.py")}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.host_resident = 0
        self.originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def __enter__(self):
        for name, original in self.originals.items():
            def counted(tensor, *args, _name=name, _original=original, **kwargs):
                self.reads.append(_name)
                return _original(tensor, *args, **kwargs)
            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            frames = {(f.name, Path(f.filename).name) for f in traceback.extract_stack()}
            if frames & self.HOST_RESIDENT:
                self.host_resident += 1
            else:
                self.reads.append(" <- ".join(f.name for f in traceback.extract_stack()[-5:-1]))
        return func(*args, **(kwargs or {}))


class NegativeOnFirstRank(Task):
    """The language model's loss, its first micro-batch's count below 0 on rank 0 only (no count()
    ahead: the counts the loss returns are the step's divisor)."""

    def __init__(self, task: Task) -> None:
        super().__init__()
        self.task = task

    def loss(self, model, batch) -> LossOutput:
        out = self.task.loss(model, batch)
        first = self.__dict__.setdefault("calls", 0) == 0
        self.calls += 1
        return dataclasses.replace(out, count=-1) if first and dist.get_rank() == 0 else out


class Delegating(Task):
    """The language model's task, one of its methods failing on one rank only (below)."""

    def __init__(self, task: Task) -> None:
        super().__init__()
        self.task = task

    def loss(self, model, batch) -> LossOutput:
        return self.task.loss(model, batch)


class CountNoneOnLastRank(Delegating):
    def count(self, batch):
        return None if dist.get_rank() == dist.get_world_size() - 1 else self.task.count(batch)


class CountAndLossFail(Delegating):
    """count() and the loss both fail on every rank's batches (the loss before the model's forward):
    the count's failure, first, is raised, naming the loss's."""

    def count(self, batch):
        return None

    def loss(self, model, batch) -> LossOutput:
        raise KeyError("labels")


class FlopsFailOnFirstRank(Delegating):
    def flops(self, batch):
        if dist.get_rank() == 0:
            raise KeyError("tokens")
        return 1.0


def agreement_and_empty_steps(out: str) -> None:
    """One rank asks to stop: every rank's step says so. A step without targets is skipped on all."""
    world = int(os.environ["WORLD_SIZE"])
    cfg = case_config(world, f"{out}/run")
    cfg.diagnostics.enabled = False
    trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=small_corpus()))
    rank = dist.get_rank()
    b, device = trainer.built, trainer.env.device

    def step(batches, stop=None):
        return train_step(b.model, trainer.task, b.optimizer, b.scheduler, batches, b.mesh, 1.0, device,
                          stop_requested=stop)

    signalled = step(trainer.train_data.next_step(), stop=lambda: dist.get_rank() == world - 1)
    batches = trainer.train_data.next_step()
    counter = HostReads()
    update = b.optimizer.step

    def recorded_update(*args, **kwargs):  # where the update comes among the host reads
        counter.reads.append("optimizer.step")
        return update(*args, **kwargs)

    b.optimizer.step = recorded_update
    with counter:  # a later step, as the trainer runs it (metric names known)
        quiet = train_step(b.model, trainer.task, b.optimizer, b.scheduler, batches, b.mesh, 1.0, device,
                           metric_kinds=signalled.metric_kinds)
    b.optimizer.step = update
    empty = [b._replace(targets=torch.full_like(b.targets, IGNORE_INDEX))
             for b in trainer.train_data.next_step()]
    before = [p.detach().to_local().clone() for p in b.model.parameters()]
    skipped = step(empty)
    unchanged = all(torch.equal(p.detach().to_local(), was) for p, was in zip(b.model.parameters(), before))
    # one micro-batch's count below 0, hidden in a positive total: refused on every rank, no update
    try:
        train_step(b.model, NegativeOnFirstRank(trainer.task), b.optimizer, b.scheduler,
                   trainer.train_data.next_step(), b.mesh, 1.0, device, metric_kinds=signalled.metric_kinds)
        negative = "trained"
    except TrainingError as exc:
        negative = str(exc)
    negative_unchanged = all(torch.equal(p.detach().to_local(), was)
                             for p, was in zip(b.model.parameters(), before))
    # count() or flops() failing on one rank, before the step's first collective: raised on every
    # rank after the step's all-reduce (raised at once, the other rank waited in it until the
    # timeout), the failing rank its own exception, the step not applied
    one_rank = {}
    for wrapper in (CountNoneOnLastRank, FlopsFailOnFirstRank, CountAndLossFail):
        try:
            train_step(b.model, wrapper(trainer.task), b.optimizer, b.scheduler,
                       trainer.train_data.next_step(), b.mesh, 1.0, device,
                       metric_kinds=signalled.metric_kinds)
            one_rank[wrapper.__name__] = "trained"
        except Exception as exc:
            one_rank[wrapper.__name__] = f"{type(exc).__name__}: {exc}"
            one_rank[f"{wrapper.__name__} notes"] = getattr(exc, "__notes__", [])
    one_rank["unchanged"] = all(torch.equal(p.detach().to_local(), was)
                                for p, was in zip(b.model.parameters(), before))
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"signalled": signalled.stop_agreed, "quiet": quiet.stop_agreed,
         "empty": {"skipped": skipped.skipped, "count": skipped.count, "unchanged": unchanged},
         "host_reads": counter.reads, "host_resident_reads": counter.host_resident,
         "negative": negative, "negative_unchanged": negative_unchanged, "one_rank": one_rank}))
