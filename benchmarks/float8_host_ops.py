"""strategy.float8's host work per training step, countable on a CPU: the operators the host
dispatches in one steady step of a Llama with llama_1b's 22 blocks (tiny widths: the count does not
depend on them), bf16-mixed, FULL_SHARD over the launch's ranks, each block compiled with
``--compile`` (as strategy.compile does): without float8; with float8 gathered in float8 (the scale
computed by each gather, then precomputed after each optimizer step: shardtrain where the weights
are sharded); and with float8 gathered in bf16, each linear casting its own weight (shardtrain with
one rank a shard group, ShardingPlan.gathers_float8). On a GPU each operator is at least one kernel
launch, and the H200 run of docs/benchmarks.md was bound by the host issuing them.

``python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/float8_host_ops.py``
``python -m torch.distributed.run --standalone --nproc-per-node=1 benchmarks/float8_host_ops.py --compile``
(a CPU refuses strategy.float8 itself, so the pieces parallelize calls are called directly; torch's
CPU float8 matmul is emulated, so the seconds are not a float8 speed). Operators are counted as the
profiler sees them at the top of the host's calls: an operator called by another is not counted
again, and a compiled block's fused kernels are not operators."""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.autograd.profiler_util import FunctionEvent
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from shardtrain.config.loader import load_config
from shardtrain.distributed.float8 import convert_linears
from shardtrain.distributed.parallelize import precompute_float8_scales_after_steps
from shardtrain.models.llama import Llama

SHAPE = ["model.dim=64", "model.n_layers=22", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_hidden_dim=128", "model.vocab_size=256"]
# mode: (float8, gathered in float8, scales precomputed)
MODES = {"no float8": (False, False, False),
         "float8 gathered in float8": (True, True, False),
         "float8 gathered in float8, scales precomputed": (True, True, True),
         "float8 gathered in bf16": (True, False, False)}


def top_level_operators(events: list[FunctionEvent]) -> int:
    """aten operators the host called itself (not from inside another operator)."""
    def under_operator(event: FunctionEvent) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return True
            parent = parent.cpu_parent
        return False

    return sum(1 for e in events if e.name.startswith("aten::") and not under_operator(e))


def step_counts(mode: str, mesh, tokens: torch.Tensor, compile_blocks: bool) -> dict:
    float8, gathered_in_float8, precomputed = MODES[mode]
    torch.manual_seed(0)
    model = Llama(load_config(SHAPE).model)
    if float8:
        convert_linears(model, [f"layers.{i}" for i in range(len(model.layers))],
                        gather_in_float8=gathered_in_float8)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
        if compile_blocks:
            block.compile()
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if precomputed:
        precompute_float8_scales_after_steps(optimizer, model)

    def step() -> float:
        logits = model(tokens[:, :-1]).flatten(0, 1).float()
        loss = torch.nn.functional.cross_entropy(logits, tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    for _ in range(3):  # the first step computes scales itself, and compiles; count a steady one
        step()
    start = time.perf_counter()
    for _ in range(5):
        step()
    seconds = (time.perf_counter() - start) / 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        step()
    return {"operators": top_level_operators(profiled.events()), "cpu_ms": seconds * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", action="store_true", help="compile each block (strategy.compile)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    results = {mode: step_counts(mode, mesh, tokens, args.compile) for mode in MODES}
    if dist.get_rank() == 0:
        print(json.dumps({"world_size": dist.get_world_size(), "compile": args.compile, "results": results}))
        for mode, r in results.items():
            print(f"{mode:46s} {r['operators']:6,d} operators a step  {r['cpu_ms']:7.1f} ms on this CPU")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
