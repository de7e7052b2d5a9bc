"""The example tasks (examples/tasks/) trained inside spawned ranks, and their references.

``run_task_cases`` runs inside every rank: each case trains one task with shardtrain and rank 0
saves losses, gradient norms, validation loss, the gathered full weights and the global sample ids
of every step. ``reference`` is the hand-written one-process loop (examples/tasks/reference.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from shardtrain.checkpoint import run_lock
from shardtrain.config.schema import Config
from shardtrain.errors import ConfigError, DataError

EXAMPLES = Path(__file__).parent.parent / "examples" / "tasks"
sys.path.insert(0, str(EXAMPLES))

TASKS = {"vit": "vit:ImageClassification", "musicgen": "musicgen:CodebookLM",
         "mdlm": "mdlm:MaskedDiffusionLM", "dit": "dit:LatentDiffusion"}
GLOBAL_BATCH = 8
N = 2  # steps before a checkpoint is resumed; runs are 2N steps


# Test-only tasks (tests/broken_tasks.py) that train like the examples.
MORE_TASKS = {"sometimes": "broken_tasks:SometimesImages", "skips": "broken_tasks:SkipsImages",
              "too_few": "broken_tasks:RankDataTooFew", "method": "broken_tasks:CallsAMethod",
              "own_bind": "broken_tasks:OwnBind"}


def make_task(name: str):
    module, _, cls = {**TASKS, **MORE_TASKS}[name].partition(":")
    return getattr(importlib.import_module(module), cls)()


def task_config(world: int, run_dir: str, strategy: str = "FULL_SHARD", accum: int = 2,
                precision: str = "fp32", ac: str = "none", checkpoint_every: int = 0,
                resume: str = "auto", **strategy_extra) -> Config:
    """AdamW's eps is 1e-6, as in the Hugging Face equivalence tests: attention's key biases get a
    gradient that is zero but for rounding (softmax ignores a shift shared by all keys), and with
    eps 1e-8 Adam turns that noise into steps of full size, which differ between any two
    summation orders (measured: 3e-4 to 7e-3 relative on qkv biases, everything else below 1e-6)."""
    cfg = Config()
    cfg.strategy = dataclasses.replace(cfg.strategy, sharding_strategy=strategy, mixed_precision=precision,
                                       activation_checkpointing=ac, **strategy_extra)
    cfg.trainer = dataclasses.replace(
        cfg.trainer, max_steps=2 * N, micro_batch_size=GLOBAL_BATCH // (world * accum),
        grad_accum_steps=accum, lr=3e-3, warmup_steps=1, grad_clip_norm=1.0, eval_every=0, adam_eps=1e-6,
        eval_samples=12, sample_tokens=0, progress_bar=False, log_every=100)
    cfg.run = dataclasses.replace(cfg.run, dir=run_dir, trackers=[])
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, enabled=checkpoint_every > 0 or resume != "auto",
                                         interval=checkpoint_every, resume=resume, keep_last=3)
    return cfg


def run_task_cases(cases: dict[str, dict], out: str) -> None:
    """Inside each rank: train every case (``task`` plus ``task_config`` keywords)."""
    from shardtrain.train.loop import Trainer

    world = int(os.environ["WORLD_SIZE"])
    for name, case in cases.items():
        case = dict(case)
        task = make_task(case.pop("task"))
        trainer = Trainer.create(task_config(world, f"{out}/{name}", **case), task=task)
        data, take, ids = trainer.train_data, trainer.train_data.next_step, []

        def recording_next_step(data=data, take=take, ids=ids):
            ids.append(data.step_ids().tolist())
            return take()

        data.next_step = recording_next_step
        dtypes = set()  # what the model's forward receives, after FSDP's mixed-precision casts

        def record_dtypes(module, args, kwargs, dtypes=dtypes):
            dtypes.update(str(a.dtype) for a in args if torch.is_tensor(a))

        trainer.model.register_forward_pre_hook(record_dtypes, with_kwargs=True)
        graphs_before = counters["stats"]["unique_graphs"]
        result = trainer.fit()
        weights = trainer.full_weights()
        if trainer.env.is_main:
            torch.save({"losses": result.losses, "grad_norms": result.grad_norms, "weights": weights,
                        "val": result.val_losses[-1][1] if result.val_losses else None, "ids": ids,
                        "resumed_from": result.resumed_from, "metrics": result.metrics,
                        "val_metrics": result.val_metrics,
                        "input_dtypes": sorted(dtypes),
                        # That strategy.compile compiled: blocks wrapped, and dynamo traced.
                        "compiled": (sum(getattr(m, "_compiled_call_impl", None) is not None
                                         for m in trainer.model.modules()),
                                     counters["stats"]["unique_graphs"] - graphs_before)},
                       Path(out, f"{name}.pt"))
    # A task object given a setting only the built-in language-model task acts on: refused when the
    # trainer learns the task, before its data or model are built.
    cfg = task_config(world, f"{out}/refused")
    cfg.trainer = dataclasses.replace(cfg.trainer, loss_chunk_tokens=16)
    try:
        Trainer.create(cfg, task=make_task("vit"))
        refusal = "not refused"
    except ConfigError as exc:
        refusal = str(exc)
    # One rank's data too small for a step: every rank stops with its error (none waits).
    try:
        Trainer.create(task_config(world, f"{out}/too_few", checkpoint_every=N), task=make_task("too_few"))
        too_few = "not refused"
    except DataError as exc:
        too_few = f"{exc} (failed_rank {getattr(exc, 'failed_rank', None)})"
    held_after_refusal = len(run_lock.HELD)  # the failed start let go of its run directory
    # A task whose bind() skips super().bind(): its seed is still the run's.
    cfg = task_config(world, f"{out}/own_bind")
    cfg.trainer = dataclasses.replace(cfg.trainer, seed=17)
    own_bind = Trainer.create(cfg, task=make_task("own_bind")).task
    if int(os.environ["RANK"]) == 0:
        Path(out, "refused.txt").write_text(refusal)
        Path(out, "too_few.txt").write_text(too_few)
        Path(out, "held_after_refusal.txt").write_text(str(held_after_refusal))
        Path(out, "own_bind.txt").write_text(f"{own_bind.bound} {own_bind.seed} {own_bind.datasets_made}")


def reference(name: str, steps: int = 2 * N) -> dict:
    from reference import reference_run

    return reference_run(make_task(name), task_config(1, "unused", accum=1), steps)
