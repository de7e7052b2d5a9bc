"""Where a step's time goes: shardtrain's iteration against the hand-written loop, op by op.

Started by ``benchmarks/run.py --only profile`` under torchrun. In one process, both loops (the
ones benchmarks/step_time.py times) run under ``torch.profiler`` for the same number of steps after
a warm-up; rank 0 prints one JSON line: wall seconds per step, the self CPU time per step of every
operator, and the time outside any operator (Python and framework glue).
"""

from __future__ import annotations

import json
import sys
import time

import torch.distributed as dist
from step_time import handwritten, shared_run_dir
from torch.profiler import ProfilerActivity, profile

from shardtrain.checkpoint.preemption import PreemptionFlag
from shardtrain.config.loader import load_config
from shardtrain.train.loop import Trainer

STEPS, WARMUP = 10, 3


def profiled(fn) -> dict:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(STEPS):
            fn()
        wall = (time.perf_counter() - start) / STEPS
    # Top-level operators only (a nested op's time is inside its parent's total), so the ops'
    # total time subtracted from the wall time leaves what ran outside any operator.
    # On the thread that runs the step (gloo's and other helper threads run beside it).
    events = [e for e in prof.events() if e.cpu_parent is None and e.device_type.name == "CPU"]
    per_thread: dict[int, float] = {}
    for e in events:
        per_thread[e.thread] = per_thread.get(e.thread, 0.0) + e.cpu_time_total
    in_ops = max(per_thread.values()) / 1e6 / STEPS
    per_op: dict[str, float] = {}
    for e in prof.key_averages():
        per_op[e.key] = per_op.get(e.key, 0.0) + e.self_cpu_time_total / 1e6 / STEPS
    return {"wall_s": wall, "in_top_level_ops_s": in_ops, "outside_ops_s": wall - in_ops,
            "self_s": per_op, "ops_per_step": len(prof.events()) / STEPS}


def main(overrides: list[str]) -> None:
    cfg = load_config(["trainer.max_steps=10000", "trainer.eval_every=0", "trainer.log_every=1000000",
                       "trainer.sample_tokens=0", "trainer.progress_bar=false", "run.trackers=[]",
                       "checkpoint.enabled=false", f"run.dir={shared_run_dir()}", *overrides])
    trainer = Trainer.create(cfg)
    trainer.preemption = PreemptionFlag(cfg.checkpoint.preemption_signals)
    reference = handwritten(cfg, trainer)
    for _ in range(WARMUP):
        trainer.iteration()
        reference()
    dist.barrier()
    results = {"shardtrain": profiled(trainer.iteration)}
    dist.barrier()
    results["handwritten"] = profiled(reference)
    if dist.get_rank() == 0:
        print(json.dumps({"world_size": dist.get_world_size(), "overrides": overrides, **results}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
