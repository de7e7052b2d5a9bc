"""Runs inside spawned ranks for tests/test_accelerator.py."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import torch.distributed as dist
from equivalence import case_config, small_corpus

from shardtrain.tasks.language_model import LanguageModelTask
from shardtrain.train.loop import Trainer


def offload_on_device_mapped_group(out: str) -> None:
    """CPU offload on a group whose backend is chosen per device ("cpu:gloo"), the form an
    accelerator run with offload uses ("cpu:gloo,cuda:nccl"): training, sampling (gathers the
    CPU-resident shards), full weights and save_full all run their CPU collectives through it."""
    dist.init_process_group(backend="cpu:gloo")
    world = dist.get_world_size()
    cfg = case_config(world, f"{out}/run", cpu_offload=True)
    cfg.trainer = dataclasses.replace(cfg.trainer, sample_tokens=8)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, enabled=True, interval=0, save_full=True)
    trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=small_corpus()))
    result = trainer.fit()
    weights = trainer.full_weights()
    if int(os.environ["RANK"]) == 0:
        torch.save({"sample": result.sample, "losses": result.losses, "grad_norms": result.grad_norms,
                    "weights": weights},
                   Path(out, "offload.pt"))
