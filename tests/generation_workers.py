"""Code that runs inside spawned ranks for the generation tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from equivalence import case_config, small_corpus
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from shardtrain.generation import generate as generate_module
from shardtrain.generation.generate import gathered_copy, generate, generation_mode, sharded_inference
from shardtrain.tasks.language_model import LanguageModelTask
from shardtrain.train.loop import Trainer


def count_all_gathers(out: str) -> None:
    """FULL_SHARD at 2 ranks: all-gathers and tokens of whole generations, for two output lengths,
    gathered once and unit by unit; then a training-time sample that would not fit."""
    world = int(os.environ["WORLD_SIZE"])
    trainer = Trainer.create(case_config(world, f"{out}/gen"), task=LanguageModelTask(corpus=small_corpus()))
    counts, tokens = {}, {}
    for mode in ("gathered", "sharded"):
        choice = generation_mode(trainer.model, torch.float32, trainer.env.device, mode)
        assert choice.mode == mode and choice.gathered_bytes == 4 * sum(
            p.numel() for p in trainer.model.parameters())
        for new_tokens in (4, 24):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                if mode == "gathered":
                    plain = gathered_copy(trainer.model, trainer.task.build_model, trainer.env.device,
                                          torch.float32)
                    tokens[mode, new_tokens] = generate(plain, list(b"def "), new_tokens, vocab_limit=256)
                else:
                    with sharded_inference(trainer.model) as model:
                        tokens[mode, new_tokens] = generate(model, list(b"def "), new_tokens,
                                                            vocab_limit=256)
                        # none left gathered between tokens (the head and last block were:
                        # every unit under SHARD_GRAD_OP, about the whole model; found by review)
                        assert all(isinstance(p, DTensor) for p in model.parameters())
            assert len(tokens[mode, new_tokens]) == new_tokens
            events = prof.key_averages()
            counts[mode, new_tokens] = sum(e.count for e in events if "all_gather" in e.key)
            # The dispatcher's collective ops (one per all-gather; the profiler also records FSDP's
            # and the backend's own events around each).
            counts[mode, new_tokens, "c10d"] = sum(e.count for e in events if e.key.startswith("c10d::")
                                                   and "allgather" in e.key)
    # Unit by unit, every rank takes rank 0's tokens: here each rank samples with its own seed (as
    # logits that differ in the last bit at a near-tie would pick differently), yet all generate
    # rank 0's text, and none stops or goes on alone.
    rank = trainer.env.rank
    with sharded_inference(trainer.model) as model:
        sampled = generate(model, list(b"def "), 12, temperature=1.0, seed=rank, vocab_limit=256,
                           stop_tokens={int(b"\n"[0])}, rank0_tokens=True)
        alone = generate(model, list(b"def "), 12, temperature=1.0, seed=rank, vocab_limit=256)
    every: list = [None] * world
    torch.distributed.all_gather_object(every, (sampled, alone))
    assert all(pair[0] == every[0][0] for pair in every), every
    assert every[0][1] != every[1][1], every  # without it, the seeds do give other tokens
    # A checkpoint link is resolved once, by rank 0, for every rank (found by review: each rank
    # resolved it, and a link a training moved in between gave the ranks two checkpoints): here each
    # rank names its own, and both take rank 0's
    from shardtrain.checkpoint.weights import resolved_once

    link = Path(out, f"link-{rank}")
    link.unlink(missing_ok=True)
    link.symlink_to(Path(out, f"step-{rank}"))
    agreed: list = [None] * world
    torch.distributed.all_gather_object(agreed, str(resolved_once(link)))
    assert agreed == [str(Path(out, "step-0").resolve())] * world, agreed
    # The sharded model is left as training needs it: sharded, in training mode.
    assert trainer.model.training and all(isinstance(p, DTensor) for p in trainer.model.parameters())
    trainer.run_step()
    # Sampling during training when the gathered copy would not fit: skipped, with one line.
    generate_module.free_memory_bytes = lambda device: 1024
    skipped = trainer.sample()
    if trainer.env.is_main:
        torch.save({"counts": counts, "tokens": tokens, "skipped": skipped,
                    "units": len(trainer.built.report.units),
                    "layers": trainer.cfg.model.n_layers}, Path(out, "counts.pt"))
