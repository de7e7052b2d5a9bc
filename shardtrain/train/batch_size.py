"""The batch a run trains with: ``trainer.global_batch_size`` turned into accumulation steps, and
``trainer.micro_batch_size=auto`` chosen by the memory planner before anything is built."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from shardtrain.accelerator import allocated_bytes, device_memory_bytes
from shardtrain.config.compose import check_batch_size
from shardtrain.config.plan import with_global_batch
from shardtrain.config.schema import Config
from shardtrain.diagnostics.kept import unmeasured_refusal
from shardtrain.diagnostics.memory import rss_bytes
from shardtrain.diagnostics.planner import BatchChoice, choose_batch, planned_model
from shardtrain.distributed.agreement import agree
from shardtrain.distributed.env import DistEnv
from shardtrain.errors import ConfigError


def agreed_memory(env: DistEnv, limit: int, held: int) -> tuple[int, int]:
    """Every rank must choose the same batch: the smallest limit and the most held memory of any
    rank decide."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return limit, held
    low = torch.tensor([limit], dtype=torch.int64, device=env.device)
    high = torch.tensor([held], dtype=torch.int64, device=env.device)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return int(low.item()), int(high.item())


def resolve_batch(cfg: Config, env: DistEnv) -> BatchChoice | None:
    """Set ``cfg.trainer``'s accumulation steps from a global batch size, and with
    ``micro_batch_size=auto`` its micro-batch and ``cfg.strategy``'s activation checkpointing from
    the planner (for a task whose model its formulas know: ``check_built_in_task_settings``);
    returns the planner's choice (None without auto). Every rank gets the same."""
    t = cfg.trainer
    if t.micro_batch_size != "auto":
        cfg.trainer = with_global_batch(cfg, env.world_size).trainer
        return None
    check_batch_size(cfg)  # load_config checks it; a config built without it reaches here too
    limit = (int(t.memory_limit_gib * 2**30) if t.memory_limit_gib
             else device_memory_bytes(env.device, env.local_world_size))
    if limit is None:
        raise ConfigError(f"trainer.micro_batch_size=auto cannot tell how much memory this {env.device.type} "
                          "device has; set trainer.memory_limit_gib")
    # What the process holds already counts against the limit: on an accelerator its tensors, on a
    # CPU its whole resident set (the interpreter, torch, the loaded data), which is also what a CPU
    # run's peak memory measures.
    held = allocated_bytes(env.device)
    if held is None:
        held = rss_bytes()
        if not t.memory_limit_gib:
            # The host's MemAvailable already leaves out what this process holds: its share of the
            # machine is that plus what it holds, which the budget then subtracts once.
            limit += held
    limit, held = agreed_memory(env, limit, held)
    # Each rank plans alike from agreed inputs; shared, so that a rank whose planning failed or came
    # out otherwise (a model whose blocks could not be measured there) stops every rank, at once.
    choice, error = None, None
    try:
        choice = choose_batch(cfg, planned_model(cfg), env.world_size, env.local_world_size, limit, held,
                              accelerated=None)
    except ConfigError as exc:
        error = str(exc)
    if error is None:
        error = unmeasured_refusal(cfg.model)
    picked = None if choice is None else (
        choice.micro_batch_size, choice.grad_accum_steps, choice.activation_checkpointing)
    picks = agree(error, picked, error_type=ConfigError)
    if differing := [rank for rank, pick in enumerate(picks) if pick != picks[0]]:
        raise ConfigError(f"trainer.micro_batch_size=auto chose differently on rank {differing[0]} "
                          f"({picks[differing[0]]}) than on rank 0 ({picks[0]}), from the same limits: see "
                          "the warnings above; set trainer.micro_batch_size=N")
    cfg.trainer = replace(t, micro_batch_size=choice.micro_batch_size,
                          grad_accum_steps=choice.grad_accum_steps)
    cfg.strategy = replace(cfg.strategy, activation_checkpointing=choice.activation_checkpointing)
    return choice
