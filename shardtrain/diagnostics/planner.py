"""``shardtrain plan``: per-rank memory for each strategy and world size, before renting a cluster.

States are computed exactly from the model's parameter shapes and FSDP2's layout (dim-0 chunks of
ceil(rows / shard group) rows per rank, the ``torch.chunk`` rule). Activations and communication
buffers are estimates. Formulas and sources: docs/memory-planner.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from shardtrain.config.plan import STRATEGIES, resolve_plan
from shardtrain.config.schema import Config
from shardtrain.models.llama import ffn_hidden_dim
from shardtrain.models.registry import build_model

ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, in the parameters' storage dtype
ADAM_STEP_BYTES = 4  # AdamW keeps one fp32 'step' scalar per parameter tensor


def rows_on_rank(rows: int, shard: int, rank: int) -> int:
    chunk = math.ceil(rows / shard) if rows else 0
    return max(0, min(chunk, rows - rank * chunk))


@dataclass
class Estimate:
    strategy: str
    world_size: int
    mesh: tuple[int, ...]
    params: int
    grads: int
    optimizer: int
    activations: int
    activations_checkpointed: int
    comm_buffers: int

    def total(self, checkpointed: bool) -> int:
        act = self.activations_checkpointed if checkpointed else self.activations
        return self.params + self.grads + self.optimizer + act + self.comm_buffers


def sharded_state_bytes(shapes: list[tuple[int, ...]], shard: int, rank: int,
                        storage: torch.dtype) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes held by ``rank`` of a shard group of ``shard`` ranks."""
    size = storage.itemsize
    local = 0
    for shape in shapes:
        rest = math.prod(shape[1:]) if len(shape) > 1 else 1
        local += rows_on_rank(shape[0] if shape else 1, shard, rank) * rest
    optimizer = ADAM_MOMENTS * local * size + ADAM_STEP_BYTES * len(shapes)
    return local * size, local * size, optimizer


def activation_bytes(cfg: Config, micro_batch: int, param_dtype: torch.dtype) -> tuple[int, int]:
    """(without, with) activation checkpointing, one micro-batch, for the built-in Llama.

    Per block, in the compute dtype: inputs of the norms, q/k/v/attention output, the SwiGLU's
    three hidden-size tensors and their product (Korthikanti et al. 2022 accounting, SDPA without
    the s^2 score matrix); plus the fp32 logits and their gradient.
    """
    m, t = cfg.model, cfg.trainer
    tokens = micro_batch * t.seq_len
    kv = m.dim // m.n_heads * m.n_kv_heads
    b = param_dtype.itemsize
    per_block = tokens * b * (2 * m.dim + m.dim + 2 * kv + m.dim + m.dim + 4 * ffn_hidden_dim(m) + m.dim)
    logits = tokens * m.vocab_size * 4 * 2
    full = m.n_layers * per_block + logits
    checkpointed = m.n_layers * tokens * m.dim * b + per_block + logits
    return full, checkpointed


def unit_param_counts(model: nn.Module) -> list[int]:
    """Parameters per FSDP unit: every block, then the model's extra groups (embeddings, head)."""
    blocks = [sum(p.numel() for p in blk.parameters()) for blk in model.modules()
              if isinstance(blk, getattr(model, "block_classes", ()))]
    groups = [sum(p.numel() for m in group for p in m.parameters())
              for group in getattr(model, "extra_shard_groups", list)()]
    return blocks + groups or [sum(p.numel() for p in model.parameters())]


def estimate(cfg: Config, model: nn.Module, strategy: str, world_size: int, local: int) -> Estimate:
    strategy_cfg = replace(cfg.strategy, sharding_strategy=strategy,
                           shard_group_size=cfg.strategy.shard_group_size
                           if world_size % max(cfg.strategy.shard_group_size, 1) == 0 else 0)
    plan = resolve_plan(strategy_cfg, world_size, min(local, world_size))
    shapes = [tuple(p.shape) for p in model.parameters()]
    params, grads, optim = sharded_state_bytes(shapes, plan.mesh_shape[-1], 0, plan.storage_dtype)
    act, act_ckpt = activation_bytes(cfg, cfg.trainer.micro_batch_size, plan.param_dtype)
    largest_unit = max(unit_param_counts(model))
    total_params = sum(math.prod(s) for s in shapes)
    if plan.grad_accumulation == "unsharded" and cfg.trainer.grad_accum_steps > 1 and plan.mesh_shape[-1] > 1:
        # Between micro-batches every rank holds each parameter's full gradient, kept in the reduce
        # dtype, besides the sharded one.
        grads += total_params * plan.reduce_dtype.itemsize
    if plan.reshard_after_forward is False:
        # Every unit stays unsharded from its forward until its backward.
        gathered = total_params * plan.param_dtype.itemsize
    else:
        # Current and prefetched unit, plus the reduce-scatter input of one unit.
        gathered = 2 * largest_unit * plan.param_dtype.itemsize
    comm = gathered + largest_unit * plan.reduce_dtype.itemsize
    return Estimate(plan.strategy, world_size, plan.mesh_shape, params, grads, optim, act, act_ckpt, comm)


def plan_table(cfg: Config, world_sizes: list[int], device_memory: int | None, local: int) -> str:
    with torch.device("meta"):
        model = build_model(cfg.model)
    n = sum(p.numel() for p in model.parameters())
    lines = [f"model: {n / 1e6:.1f}M parameters; micro-batch {cfg.trainer.micro_batch_size} x "
             f"{cfg.trainer.seq_len} tokens; precision {cfg.strategy.mixed_precision}; "
             f"{local} processes per node",
             "per-rank GiB (rank 0, the largest shard): params | grads | optimizer | activations "
             "(no AC / AC) | comm buffers | total (no AC / AC)" + (" | fits" if device_memory else "")]
    gib = 2**30
    for world in world_sizes:
        for strategy in STRATEGIES:
            if strategy.startswith("HYBRID") and (world < 2 or world % min(local, world)):
                continue
            try:
                e = estimate(cfg, model, strategy, world, local)
            except Exception as exc:  # a combination the plan rejects (e.g. group size)
                lines.append(f"  {world:>4} x {strategy:<19} not possible: {exc}")
                continue
            fit = ""
            if device_memory:
                ok_ac, ok = e.total(True) <= device_memory, e.total(False) <= device_memory
                fit = " | " + ("yes" if ok else "with AC" if ok_ac else "no")
            g = [x / gib for x in (e.params, e.grads, e.optimizer, e.activations,
                                    e.activations_checkpointed, e.comm_buffers,
                                    e.total(False), e.total(True))]
            lines.append(f"  {world:>4} x {strategy:<19} {g[0]:8.2f} {g[1]:8.2f} {g[2]:9.2f}   "
                         f"{g[3]:7.2f} / {g[4]:<7.2f} {g[5]:8.2f}   {g[6]:8.2f} / {g[7]:<8.2f}{fit}")
    return "\n".join(lines)
