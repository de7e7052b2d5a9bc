"""One rank of the task step-time benchmark (started by benchmarks/run.py --only task under torchrun).

Times shardtrain's loop iteration (``Trainer.iteration``) on a task, the vision transformer of
examples/tasks/vit.py, against a hand-written FSDP2 loop for the same model and loss: ``fully_shard``
per block and root, the mean cross-entropy, ``clip_grad_norm_``, AdamW, on the same initial weights
and batches, in the same processes, alternating rounds so that machine noise hits both alike. Rank 0
prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtrain.train.loop import Trainer
from shardtrain.train.optim import build_optimizer, build_scheduler

sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "tasks"))
from step_time import alternating_medians, benchmark_config, sharded_by_hand  # noqa: E402
from vit import Block, ImageClassification  # noqa: E402

SHAPE = dict(image_size=32, patch=4, classes=10, dim=192, depth=6, heads=3, train_samples=4096)


def handwritten(cfg, trainer: Trainer, task: ImageClassification):
    with torch.device("meta"):
        model = task.build_model()
    model = sharded_by_hand(model, Block, task, trainer)
    optimizer = build_optimizer(model, cfg.trainer)
    scheduler = build_scheduler(optimizer, cfg.trainer)
    device = trainer.env.device

    def step() -> float:
        (batch,) = trainer.train_data.next_step()
        images = batch["image"].to(device, non_blocking=True)
        labels = batch["label"].to(device, non_blocking=True)
        loss = F.cross_entropy(model(images).float(), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # like any real loop that logs its loss

    return step


def main(overrides: list[str]) -> None:
    cfg = benchmark_config(overrides)
    task = ImageClassification(**SHAPE)
    trainer = Trainer.create(cfg, task=task)
    trainer.log_setup()
    # Twice the training benchmark's rounds: two processes on two cores vary by +-2% between runs.
    medians, timed = alternating_medians(trainer, handwritten(cfg, trainer, task), rounds=12)
    samples = trainer.layout.global_batch
    if dist.get_rank() == 0:
        print(json.dumps({
            "world_size": dist.get_world_size(), "samples_per_step": samples,
            "params": sum(p.numel() for p in trainer.model.parameters()), "step_s": medians,
            "samples_per_s": {k: samples / v for k, v in medians.items()},
            "ratio": medians["shardtrain"] / medians["handwritten"],
            "steps_timed": timed,
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
