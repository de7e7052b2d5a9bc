"""Activation checkpointing modes against each other (``benchmarks/run.py --only ac``): one process,
the built-in Llama, a training step (forward, backward, fused AdamW), blocks checkpointed the way
``strategy.activation_checkpointing`` does it (``distributed.parallelize``).

``python benchmarks/ac_bench.py memory DIM LAYERS SEQ BATCH MODE``: in a fresh process, a step's
peak resident memory over what stays between steps; one JSON line.
``python benchmarks/ac_bench.py speed DIM LAYERS SEQ BATCH ROUNDS``: tokens/s of every mode,
alternating step by step in one process (the machine's load falls on all alike); one JSON line.
"""

from __future__ import annotations

import copy
import gc
import json
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
from shardtrain.distributed.parallelize import enable_activation_checkpointing
from shardtrain.models.llama import Llama
from shardtrain.tasks.language_model import token_loss_sum

EVERY = 2  # every_k's k


def checkpointed(model: Llama, mode: str) -> Llama:
    plan = ShardingPlan("FULL_SHARD", (1,), ("dp_shard",), True, torch.float32, torch.float32,
                        torch.float32, False, mode, EVERY)
    for index, block in enumerate(model.layers):
        if plan.checkpointed(index):
            enable_activation_checkpointing(block, selective=mode == "selective")
    return model


def setup(dim: int, layers: int, seq: int, batch: int):
    torch.manual_seed(0)
    cfg = ModelConfig(dim=dim, n_layers=layers, n_heads=max(dim // 64, 1), n_kv_heads=max(dim // 128, 1),
                      max_seq_len=seq)
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
    base, data = setup(dim, layers, seq, batch)
    models = {mode: checkpointed(copy.deepcopy(base), mode) for mode in AC_MODES}
    optimizers = {mode: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for mode, m in models.items()}
    seconds: dict[str, list[float]] = {mode: [] for mode in AC_MODES}
    losses: dict[str, list[float]] = {mode: [] for mode in AC_MODES}
    for mode in AC_MODES:  # warm-up: first-call allocations, optimizer state
        losses[mode].append(step(models[mode], optimizers[mode], data))
    for _ in range(rounds):
        for mode in AC_MODES:
            start = time.perf_counter()
            losses[mode].append(step(models[mode], optimizers[mode], data))
            seconds[mode].append(time.perf_counter() - start)
    return {"dim": dim, "layers": layers, "seq": seq, "batch": batch, "rounds": rounds,
            "threads": torch.get_num_threads(), "losses": losses,
            "tokens_per_s": {mode: batch * seq / statistics.median(s) for mode, s in seconds.items()}}


if __name__ == "__main__":
    mode, *numbers, last = sys.argv[1:]
    shape = [int(n) for n in numbers]
    print(json.dumps(memory(*shape, last) if mode == "memory" else speed(*shape, int(last))))
