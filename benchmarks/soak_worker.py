"""One rank of the soak benchmark (started by ``benchmarks/run.py --only soak`` under torchrun).

Trains ``trainer.max_steps`` steps of the quick model with an asynchronous checkpoint every 10 steps
and ``keep_last=2``, through ``Trainer.iteration`` (the body of ``fit``), sampling this process's
resident memory, OS threads and open files, and (rank 0) the checkpoint directory's size and
entries. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardtrain.config.loader import load_config
from shardtrain.diagnostics.memory import rss_bytes
from shardtrain.train.loop import Trainer


def snapshot(step: int, root: Path) -> dict:
    files = [p for p in root.rglob("*") if p.is_file()] if root.exists() else []
    return {"step": step, "rss_mib": rss_bytes() / 2**20, "threads": len(os.listdir("/proc/self/task")),
            "open_files": len(os.listdir("/proc/self/fd")),
            "ckpt_entries": sorted(p.name for p in root.iterdir()) if root.exists() else [],
            "ckpt_mib": sum(p.stat().st_size for p in files) / 2**20}


def main(run_dir: str, steps: int) -> None:
    cfg = load_config(["experiment=quick", f"trainer.max_steps={steps}", "trainer.eval_every=0",
                       "trainer.log_every=100", "trainer.sample_tokens=0", "trainer.progress_bar=false",
                       "checkpoint.interval=10", "checkpoint.keep_last=2", "checkpoint.async=true",
                       f"run.dir={run_dir}"])
    trainer = Trainer.create(cfg)
    root = Path(run_dir) / "checkpoints"
    marks = {200, steps // 2, steps}
    samples = []
    while trainer.step < steps:
        trainer.iteration()
        if trainer.step in marks:
            trainer.checkpointer.wait()  # compare at rest: no save in flight
            dist.barrier()
            samples.append(snapshot(trainer.step, root))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, samples)
    if dist.get_rank() == 0:
        print(json.dumps({"steps": steps, "ranks": every, "torch": torch.__version__}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
