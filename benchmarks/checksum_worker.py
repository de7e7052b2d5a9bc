"""One rank of the checksum benchmark (started by benchmarks/run.py under torchrun).

Trains one step, saves (the commit hashes each rank's own files), then times on every rank: the
hashing it did at commit (its own files; before, rank 0 hashed them all while the others waited), and
a resume's verification of ``verify_path`` (default: the checkpoint just saved) with the work split
between the ranks and one all-gather. Rank 0 prints one JSON line with every rank's numbers.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from shardtrain.checkpoint import integrity
from shardtrain.config.loader import load_config
from shardtrain.train.loop import Trainer


def main(run_dir: str, verify_path: str, overrides: list[str]) -> None:
    cfg = load_config(["trainer.max_steps=100", "trainer.eval_every=0", "trainer.sample_tokens=0",
                       "trainer.progress_bar=false", "run.trackers=[]", "checkpoint.interval=0",
                       f"run.dir={run_dir}", *overrides])
    trainer = Trainer.create(cfg)
    trainer.run_step()
    ckpt = trainer.checkpointer
    trainer.save_checkpoint(blocking=True)
    saved = ckpt.root / f"step-{trainer.step}"
    rank, world = dist.get_rank(), dist.get_world_size()
    recorded = integrity.read_manifest(saved)

    # The commit's hashing: this rank's own files, as commit() chooses them.
    mine = [n for n in recorded if integrity.owner_rank(n, world) == rank]
    start = time.perf_counter()
    integrity.hash_entries(saved, mine)
    commit_s = time.perf_counter() - start
    commit_bytes = sum(recorded[n]["bytes"] for n in mine)
    # What rank 0 alone did before: every file (timed on rank 0 only, the others idle meanwhile).
    everything_s = None
    if rank == 0:
        start = time.perf_counter()
        integrity.hash_entries(saved, sorted(recorded))
        everything_s = time.perf_counter() - start

    target = Path(verify_path) if verify_path != "-" else saved
    files = integrity.read_manifest(target)
    share = integrity.verification_share(files, rank, world)
    dist.barrier()
    start = time.perf_counter()
    ckpt.verify_agreed(target)
    verify_s = time.perf_counter() - start
    verify_bytes = sum(files[n]["bytes"] for n in share)

    mine_numbers = {"commit_s": commit_s, "commit_bytes": commit_bytes, "verify_s": verify_s,
                    "verify_bytes": verify_bytes}
    every: list = [None] * world
    dist.all_gather_object(every, mine_numbers)
    if rank == 0:
        print(json.dumps({"world_size": world, "saved_bytes": sum(e["bytes"] for e in recorded.values()),
                          "verified": str(target),
                          "verified_bytes": sum(e["bytes"] for e in files.values()),
                          "rank0_all_files_s": everything_s, "ranks": every, "path": str(saved)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
