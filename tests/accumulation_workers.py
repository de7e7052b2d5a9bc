"""Runs inside spawned ranks for tests/test_accumulation.py."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from equivalence import case_config, small_corpus
from torch.profiler import ProfilerActivity, profile

from shardtrain.tasks.language_model import LanguageModelTask
from shardtrain.train.loop import Trainer

ACCUM = 2


def count_collectives(out: str) -> None:
    """Per step, for FULL_SHARD (4 ranks) and HYBRID_SHARD (2 x 2), in both accumulation modes:
    the reduce-scatters and all-reduces the profiler sees, and the FSDP units that cause them."""
    world = int(os.environ["WORLD_SIZE"])
    counts = {}
    for strategy, group in (("FULL_SHARD", 0), ("HYBRID_SHARD", 2)):
        for mode in ("sharded", "unsharded"):
            cfg = case_config(world, f"{out}/{strategy}-{mode}", strategy=strategy, accum=ACCUM,
                              shard_group_size=group, grad_accumulation=mode)
            cfg.diagnostics.enabled = False
            trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=small_corpus()))
            assert trainer.built.plan.grad_accumulation == mode
            trainer.run_step()  # warm-up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                trainer.run_step()
            events = prof.key_averages()
            # The c10d dispatcher ops, not the backend's own events (gloo runs a reduce-scatter as
            # all-reduces internally, which would count twice).
            counts[strategy, mode] = {
                "reduce_scatter": sum(e.count for e in events if e.key.startswith("c10d::")
                                      and "reduce_scatter" in e.key),
                "all_reduce": sum(e.count for e in events if e.key.startswith("c10d::allreduce")),
                "units": len(trainer.built.report.units),
            }
    if int(os.environ["RANK"]) == 0:
        torch.save(counts, Path(out, "collectives.pt"))
