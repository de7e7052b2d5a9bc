"""One rank of the initialisation benchmark (``benchmarks/run.py --only init``, under torchrun).

Builds the ~300M-parameter model of tests/test_init.py (vocab 65,536 x dim 1,024, 13 layers) sharded
with FULL_SHARD, timing the build and measuring this process's peak resident growth, once per-shard
(chunked, the default for the built-in model) or with full tensors on every rank (``full``). Rank 0
prints one JSON line with every rank's numbers.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import resource
import sys
import time

import torch.distributed as dist

from shardtrain.config.plan import resolve_plan
from shardtrain.config.schema import Config
from shardtrain.distributed.env import build_mesh, destroy_distributed, init_distributed
from shardtrain.distributed.sharded_model import build_sharded_model
from shardtrain.models.llama import Llama
from shardtrain.models.registry import model_factory


def main(mode: str) -> None:
    Llama.init_parameter_elementwise = mode == "chunked"
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, vocab_size=65536, dim=1024, n_layers=13, n_heads=16,
                                    n_kv_heads=16, max_seq_len=128)
    env = init_distributed()
    plan = resolve_plan(cfg.strategy, env.world_size, env.local_world_size)
    mesh = build_mesh(plan, "cpu")
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    model, _ = build_sharded_model(cfg, env, plan, mesh, model_factory(cfg.model))
    seconds = time.perf_counter() - start
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    mine = {"rank": env.rank, "seconds": seconds, "peak_growth_mib": grown_mib}
    every = [None] * env.world_size
    dist.all_gather_object(every, mine)
    if env.rank == 0:
        print(json.dumps({"mode": mode, "world_size": env.world_size, "ranks": every,
                          "params": sum(p.numel() for p in model.parameters())}))
    del model
    destroy_distributed()
    gc.collect()  # free the groups while the interpreter is whole (see docs/troubleshooting.md)


if __name__ == "__main__":
    main(sys.argv[1])
