"""Runs inside spawned ranks for tests/test_step.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from equivalence import case_config, small_corpus

from shardtrain.data.batches import IGNORE_INDEX
from shardtrain.errors import TrainingError
from shardtrain.tasks.language_model import LanguageModelTask
from shardtrain.train.loop import Trainer
from shardtrain.train.step import train_step


def agreement_and_empty_steps(out: str) -> None:
    """One rank asks to stop: every rank's step says so. A step without targets fails on all."""
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
    quiet = step(trainer.train_data.next_step())
    empty = [b._replace(targets=torch.full_like(b.targets, IGNORE_INDEX))
             for b in trainer.train_data.next_step()]
    try:
        step(empty)
        error = None
    except TrainingError as exc:
        error = str(exc)
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"signalled": signalled.stop_agreed, "quiet": quiet.stop_agreed, "error": error}))
