"""Code that runs inside spawned ranks for the generation tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from equivalence import case_config, small_corpus
from torch.profiler import ProfilerActivity, profile

from shardtrain.generation.generate import gathered_copy, generate
from shardtrain.train.loop import Trainer


def count_all_gathers(out: str) -> None:
    """FULL_SHARD at 2 ranks: all-gathers for a whole generation, for two output lengths."""
    world = int(os.environ["WORLD_SIZE"])
    trainer = Trainer.create(case_config(world, f"{out}/gen"), corpus=small_corpus())
    counts = {}
    for new_tokens in (4, 24):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            plain = gathered_copy(trainer.model, trainer.model_factory, trainer.env.device,
                                  torch.float32)
            tokens = generate(plain, list(b"def "), new_tokens, vocab_limit=256)
        assert len(tokens) == new_tokens
        counts[new_tokens] = sum(e.count for e in prof.key_averages() if "all_gather" in e.key)
    if trainer.env.is_main:
        torch.save(counts, Path(out, "counts.pt"))
