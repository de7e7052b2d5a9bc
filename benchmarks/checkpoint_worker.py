"""One rank of the checkpoint benchmark (started by benchmarks/run.py under torchrun).

Trains one step (so the optimizer state exists), then times a synchronous save, an asynchronous save
(the part that blocks training, and the whole write), a second asynchronous save (into the staging
buffers the first one allocated), and a load. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import torch.distributed as dist

from shardtrain.config.loader import load_config
from shardtrain.train.loop import Trainer


def main(run_dir: str, overrides: list[str]) -> None:
    cfg = load_config(["trainer.max_steps=100", "trainer.eval_every=0", "trainer.sample_tokens=0",
                       "trainer.progress_bar=false", "run.trackers=[]", "checkpoint.interval=0",
                       "checkpoint.keep_last=5", f"run.dir={run_dir}", *overrides])
    trainer = Trainer.create(cfg)
    trainer.run_step()
    ckpt = trainer.checkpointer

    dist.barrier()
    start = time.perf_counter()
    trainer.save_checkpoint(blocking=True)
    sync_s = time.perf_counter() - start

    trainer.run_step()
    cfg.checkpoint.async_save = True
    dist.barrier()
    start = time.perf_counter()
    trainer.save_checkpoint()
    blocked_s = time.perf_counter() - start
    ckpt.wait()
    async_total_s = time.perf_counter() - start
    dist.barrier()  # rank 0 finalized (renamed) the async checkpoint

    # A later async save copies into the buffers the first one allocated (checkpoint.reuse_staging).
    trainer.run_step()
    dist.barrier()
    start = time.perf_counter()
    trainer.save_checkpoint()
    again_blocked_s = time.perf_counter() - start
    ckpt.wait()
    dist.barrier()

    path = ckpt.root / f"step-{trainer.step}"
    start = time.perf_counter()
    ckpt.load(path)
    load_s = time.perf_counter() - start

    size = sum(f.stat().st_size for f in path.iterdir())
    params = sum(p.numel() for p in trainer.model.parameters())
    if dist.get_rank() == 0:
        print(json.dumps({"params": params, "world_size": dist.get_world_size(), "bytes": size,
                          "sync_s": sync_s, "async_blocked_s": blocked_s,
                          "async_total_s": async_total_s, "async_again_blocked_s": again_blocked_s,
                          "load_s": load_s, "path": str(path)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
