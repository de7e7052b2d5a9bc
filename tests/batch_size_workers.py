"""trainer.micro_batch_size=auto in spawned ranks: the run chooses under a memory limit set here."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import torch

from shardtrain.accelerator import peak_memory_mib
from shardtrain.config.loader import load_config
from shardtrain.data.corpus import load_corpus
from shardtrain.diagnostics.memory import rss_bytes
from shardtrain.diagnostics.planner import estimate
from shardtrain.errors import TrainingError
from shardtrain.models.registry import build_model
from shardtrain.tasks.language_model import LanguageModelTask
from shardtrain.train.loop import Trainer

GLOBAL_BATCH = 32
# On a CPU the resident set grows more than the planner's tensors (measured here: 196 MiB for a
# planned 108 MiB, and with the leaner blocks 287 MiB for a planned 66 MiB; the allocator's
# per-thread arenas, CPU kernels' temporaries, evaluation): docs/memory-planner.md.
MARGIN = 0.4
# Activations of a few MiB a sequence, so that neighbouring micro-batch sizes are tens of MiB apart
# on the planner's scale: far more than the resident set moves between measuring it here and the
# trainer's choice.
OVERRIDES = ["model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
             "model.max_seq_len=1024", "trainer.seq_len=1024", "trainer.micro_batch_size=auto",
             f"trainer.global_batch_size={GLOBAL_BATCH}", f"trainer.memory_margin={MARGIN}",
             "trainer.max_steps=2", "trainer.eval_every=0", "trainer.eval_samples=4",
             "trainer.sample_tokens=0", "trainer.progress_bar=false", "checkpoint.enabled=false",
             "run.trackers=[]", "data.max_bytes=400000", "data.val_percent=30"]


def planned_peak(cfg, world: int, micro: int, ac: str = "none") -> int:
    """The planner's peak for ``micro`` sequences per micro-batch at this global batch."""
    trial = replace(cfg, trainer=replace(cfg.trainer, micro_batch_size=micro,
                                         grad_accum_steps=GLOBAL_BATCH // world // micro),
                    strategy=replace(cfg.strategy, activation_checkpointing=ac))
    with torch.device("meta"):
        model = build_model(cfg.model)
    return estimate(trial, model, "FULL_SHARD", world, world, accelerated=False).peak


def auto_batch_run(out: str) -> None:
    """Set a limit between what the planner says micro-batches of 4 and 8 need (above what this
    process holds), train two steps and record the choice and the measured peak. The limit lies
    three quarters of the way to 8: the trainer, which builds the model first, holds more than this
    process did (30 MiB more, measured), which leaves its budget for activations that much lower."""
    world = int(os.environ["WORLD_SIZE"])
    base = load_config([*OVERRIDES, f"run.dir={out}/run"])
    corpus = load_corpus(base.data)
    held = rss_bytes()
    four, eight = planned_peak(base, world, 4), planned_peak(base, world, 8)
    between = four + 3 * (eight - four) // 4
    limit_gib = (held + between) / (1 - MARGIN) / 2**30
    cfg = load_config([*OVERRIDES, f"run.dir={out}/run", f"trainer.memory_limit_gib={limit_gib}"])
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("shardtrain").addHandler(handler)
    logging.getLogger("shardtrain").setLevel(logging.INFO)
    trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=corpus))
    result = trainer.fit()
    choice = trainer.batch_choice
    # A CPU cannot run out of memory with an error; the step's handler gets the accelerator's.
    try:
        with trainer.out_of_memory_explained():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    except TrainingError as exc:
        out_of_memory = str(exc)
    try:  # the CPU allocator's refusal of one allocation, for real: a RuntimeError of its own
        with trainer.out_of_memory_explained():
            torch.empty(2**48, dtype=torch.uint8)
    except TrainingError as exc:
        cpu_refusal = str(exc)
    if trainer.env.is_main:
        Path(out, "auto.json").write_text(json.dumps({
            "micro": choice.micro_batch_size, "accum": choice.grad_accum_steps,
            "ac": choice.activation_checkpointing, "limit": choice.limit, "held": choice.held,
            "budget": choice.budget, "planned": choice.estimate.peak, "limit_gib": limit_gib,
            "config_micro": trainer.cfg.trainer.micro_batch_size,
            "caller_micro": cfg.trainer.micro_batch_size, "caller_ac": cfg.strategy.activation_checkpointing,
            "global_batch": trainer.layout.global_batch, "losses": result.losses,
            "peak_bytes": peak_memory_mib(trainer.env.device) * 2**20, "world": world,
            "log": lines, "out_of_memory": out_of_memory, "cpu_refusal": cpu_refusal,
        }))
