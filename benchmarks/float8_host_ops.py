"""strategy.float8's host work per training step, countable on a CPU: the operators dispatched in
one step of a Llama with llama_1b's 22 blocks (tiny widths: the count does not depend on them),
FULL_SHARD over the launch's ranks, without float8, with float8, and with float8 and the scales
precomputed after each optimizer step (what shardtrain does). On a GPU each operator is at least
one kernel launch, and the H200 run of docs/benchmarks.md was bound by the host issuing them.

``python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/float8_host_ops.py``
(a CPU refuses strategy.float8 itself, so the pieces parallelize calls are called directly; torch's
CPU float8 matmul is emulated, so the seconds are not a float8 speed)."""

from __future__ import annotations

import collections
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from shardtrain.config.loader import load_config
from shardtrain.distributed.float8 import convert_linears
from shardtrain.distributed.parallelize import precompute_float8_scales_after_steps
from shardtrain.models.llama import Llama

SHAPE = ["model.dim=64", "model.n_layers=22", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_hidden_dim=128", "model.vocab_size=256"]


class CountOperators(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def step_counts(mode: str, mesh, tokens: torch.Tensor) -> dict:
    torch.manual_seed(0)
    model = Llama(load_config(SHAPE).model)
    if mode != "plain":
        convert_linears(model)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if mode == "float8, scales precomputed":
        precompute_float8_scales_after_steps(optimizer, model)

    def step() -> float:
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    for _ in range(2):  # the first step computes scales itself; count a steady one
        step()
    with CountOperators() as counted:
        step()
    start = time.perf_counter()
    for _ in range(3):
        step()
    return {"operators": sum(counted.counts.values()), "top": counted.counts.most_common(6),
            "cpu_ms": (time.perf_counter() - start) / 3 * 1e3}


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    results = {mode: step_counts(mode, mesh, tokens)
               for mode in ("plain", "float8", "float8, scales precomputed")}
    if dist.get_rank() == 0:
        print(json.dumps({"world_size": dist.get_world_size(), "results": results}))
        for mode, r in results.items():
            print(f"{mode:28s} {r['operators']:6,d} operators a step  {r['cpu_ms']:7.1f} ms on this CPU")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
