"""Activation checkpointing modes against each other (``benchmarks/run.py --only ac``): one process,
the built-in Llama, a training step (forward, backward, fused AdamW), blocks checkpointed the way
``strategy.activation_checkpointing`` does it (``distributed.parallelize``).

``python benchmarks/ac_bench.py memory DIM LAYERS SEQ BATCH MODE``: in a fresh process, a step's
peak resident memory over what stays between steps; one JSON line.
``python benchmarks/ac_bench.py speed DIM LAYERS SEQ BATCH ROUNDS``: tokens/s of every mode,
alternating step by step in one process (the machine's load falls on all alike); one JSON line.
``LEAN_LAYERS=0`` in the environment: the model with plain autograd's norms and SwiGLU.
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from loss_bench import status_mib

from shardtrain.config.plan import ShardingPlan
from shardtrain.config.schema import ModelConfig
from shardtrain.config.strategy import AC_MODES
from shardtrain.data.batches import Batch
from shardtrain.distributed.parallelize import (
    block_selective_contexts,
    enable_activation_checkpointing,
    selective_contexts,
)
from shardtrain.models.llama import Llama
from shardtrain.tasks.language_model import token_loss_sum

EVERY = 2  # every_k's k
# The other selective policies measured beside shardtrain's: torchtitan's, which keeps the odd
# matmuls (wq, wv, w1 and w2; with plain linears w2's output is never read; shardtrain's selective
# on 2026-11-27, and still its choice for blocks with an adapter on the last projection or float8
# linears), and every
# matmul's output kept (shardtrain's selective until 2026-11-27; with the lean layers it kept more
# than no checkpointing).
OTHER_POLICIES = {
    "odd matmuls kept (torchtitan)": functools.partial(selective_contexts, lambda matmul: matmul % 2 == 1),
    "every matmul kept": functools.partial(selective_contexts, lambda matmul: True),
}
MODES = (*AC_MODES, *OTHER_POLICIES)


def checkpointed(model: Llama, mode: str) -> Llama:
    if mode in OTHER_POLICIES:
        for block in model.layers:
            enable_activation_checkpointing(block, OTHER_POLICIES[mode])
        return model
    plan = ShardingPlan("FULL_SHARD", (1,), ("dp_shard",), True, torch.float32, torch.float32,
                        torch.float32, False, mode, EVERY)
    for index, block in enumerate(model.layers):
        if plan.checkpointed(index):
            enable_activation_checkpointing(block, block_selective_contexts(block, float8=False)
                                            if mode == "selective" else None)
    return model


def setup(dim: int, layers: int, seq: int, batch: int):
    torch.manual_seed(0)
    # LEAN_LAYERS=0: plain autograd's norms and SwiGLU (model.lean_layers=false), as Hugging Face
    # models have them.
    cfg = ModelConfig(dim=dim, n_layers=layers, n_heads=max(dim // 64, 1), n_kv_heads=max(dim // 128, 1),
                      max_seq_len=seq, lean_layers=os.environ.get("LEAN_LAYERS", "1") == "1")
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    return Llama(cfg), Batch(tokens[:, :-1], tokens[:, 1:])


def step(model: Llama, optimizer: torch.optim.Optimizer, batch: Batch) -> float:
    loss = token_loss_sum(model, batch, 0)
    (loss / batch.targets.numel()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def memory(dim: int, layers: int, seq: int, batch: int, mode: str) -> dict:
    """As loss_bench.memory: Linux's peak resident size over a step, reset just before it."""
    model, data = setup(dim, layers, seq, batch)
    model = checkpointed(model, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step(model, optimizer, Batch(data.inputs[:1, :8], data.targets[:1, :8]))
    gc.collect()
    before = status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    loss = step(model, optimizer, data)
    return {"mode": mode, "step_peak_mib": status_mib("VmHWM") - before, "loss": loss}


def speed(dim: int, layers: int, seq: int, batch: int, rounds: int) -> dict:
    # One thread: its CPU time is the work a mode does. With two, the threads' spin-waits in
    # parallel regions count as CPU time too, and under other load those dominate (measured
    # 2026-11-25 at load 6: every_k at 0.94x none's CPU seconds).
    torch.set_num_threads(1)
    base, data = setup(dim, layers, seq, batch)
    models = {mode: checkpointed(copy.deepcopy(base), mode) for mode in MODES}
    optimizers = {mode: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for mode, m in models.items()}
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    losses: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in MODES:  # warm-up: first-call allocations, optimizer state
        losses[mode].append(step(models[mode], optimizers[mode], data))
    # CPU seconds as well as wall seconds: on a shared machine the wall clock counts other
    # processes' time, the process's CPU time only the work the mode does (recomputation included).
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            start, start_cpu = time.perf_counter(), time.process_time()
            losses[mode].append(step(models[mode], optimizers[mode], data))
            seconds[mode].append(time.perf_counter() - start)
            cpu[mode].append(time.process_time() - start_cpu)
    return {"dim": dim, "layers": layers, "seq": seq, "batch": batch, "rounds": rounds,
            "threads": torch.get_num_threads(), "losses": losses,
            "tokens_per_s": {mode: batch * seq / statistics.median(s) for mode, s in seconds.items()},
            "cpu_s_per_step": {mode: statistics.median(s) for mode, s in cpu.items()}}


if __name__ == "__main__":
    mode, *numbers, last = sys.argv[1:]
    shape = [int(n) for n in numbers]
    if mode == "memory":  # the command line spells the modes' spaces as underscores
        print(json.dumps(memory(*shape, {m.replace(" ", "_"): m for m in MODES}[last])))
    else:
        print(json.dumps(speed(*shape, int(last))))
