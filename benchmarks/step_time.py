"""One rank of the step-time benchmark (started by benchmarks/run.py under torchrun).

Times shardtrain's training loop iteration (``Trainer.run_step``: data, step, bookkeeping) against a
minimal hand-written FSDP2 loop on the same model, initial weights and batches, in the same
processes, alternating rounds so that machine noise hits both alike. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from shardtrain.checkpoint.preemption import PreemptionFlag
from shardtrain.config.loader import load_config
from shardtrain.distributed.sharded_model import init_full_parameter, shard_like
from shardtrain.models.llama import Llama, TransformerBlock
from shardtrain.train.loop import Trainer
from shardtrain.train.optim import build_optimizer, build_scheduler


def sharded_by_hand(model: torch.nn.Module, block: type, initializer, trainer: Trainer) -> torch.nn.Module:
    """The FSDP2 tutorial's sharding of ``model`` (built on meta): ``fully_shard`` per ``block``, then
    the root, with shardtrain's precision policy; then the initial weights of shardtrain's run."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = trainer.built.plan  # the same precision as shardtrain's run
    mp = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
    for module in model.modules():
        if isinstance(module, block):
            fully_shard(module, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = torch.empty(p.shape)
            init_full_parameter(initializer, name, full, trainer.cfg.trainer.seed)
            p.copy_(shard_like(full, p))
    return model


def handwritten(cfg, trainer: Trainer):
    """The FSDP2 tutorial loop: shard blocks then root (with shardtrain's precision policy), AdamW,
    clip_grad_norm_, step."""
    with torch.device("meta"):
        model = Llama(cfg.model)
    model = sharded_by_hand(model, TransformerBlock, model, trainer)
    with torch.no_grad():
        model.init_buffers()
    optimizer = build_optimizer(model, cfg.trainer)
    scheduler = build_scheduler(optimizer, cfg.trainer)

    return tutorial_step(model, optimizer, scheduler, trainer, cfg.trainer.grad_clip_norm)


def tutorial_step(model, optimizer, scheduler, trainer: Trainer, clip: float):
    """One step of the FSDP2 tutorial's loop on shardtrain's batches (same pipeline, same order)."""
    device = trainer.env.device

    def step() -> float:
        (batch,) = trainer.train_data.next_step()
        x, y = batch.inputs.to(device, non_blocking=True), batch.targets.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # like any real loop that logs its loss

    return step


def shared_run_dir(name: str = "run") -> str:
    """One run directory for every rank of this torchrun launch (shardtrain refuses a run.dir that
    the ranks do not share), fresh for each launch: torchrun gives every launch its own run id."""
    launch = os.environ.get("TORCHELASTIC_RUN_ID")
    if launch is None:
        return tempfile.mkdtemp(prefix=f"shardtrain-bench-{name}-")
    return str(Path(tempfile.gettempdir()) / f"shardtrain-bench-{launch}-{name}")


def benchmark_config(overrides: list[str]):
    return load_config(["trainer.max_steps=10000", "trainer.eval_every=0", "trainer.log_every=1000000",
                        "trainer.sample_tokens=0", "trainer.progress_bar=false", "run.trackers=[]",
                        "checkpoint.enabled=false", f"run.dir={shared_run_dir()}", *overrides])


def alternating_medians(trainer: Trainer, reference_step, rounds: int = 6, steps_per_round: int = 5,
                        warmup: int = 3) -> tuple[dict[str, float], int]:
    """Median step seconds of the loop's whole iteration (as fit() runs it, the preemption check
    included) and of ``reference_step``, in alternating rounds after a warm-up of each; and how many
    steps of each were timed."""
    trainer.preemption = PreemptionFlag(trainer.cfg.checkpoint.preemption_signals)
    for _ in range(warmup):
        trainer.iteration()
        reference_step()
    times = {"shardtrain": [], "handwritten": []}
    for _ in range(rounds):
        for name, fn in (("shardtrain", trainer.iteration), ("handwritten", reference_step)):
            dist.barrier()
            for _ in range(steps_per_round):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}, len(times["shardtrain"])


def main(overrides: list[str]) -> None:
    cfg = benchmark_config(overrides)
    trainer = Trainer.create(cfg)
    trainer.log_setup()
    medians, timed = alternating_medians(trainer, handwritten(cfg, trainer))
    tokens = trainer.layout.global_batch * cfg.trainer.seq_len
    if dist.get_rank() == 0:
        print(json.dumps({
            "world_size": dist.get_world_size(),
            "tokens_per_step": tokens,
            "step_s": medians,
            "tokens_per_s": {k: tokens / v for k, v in medians.items()},
            "ratio": medians["shardtrain"] / medians["handwritten"],
            "steps_timed": timed,
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
