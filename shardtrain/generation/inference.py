"""Load a checkpoint for inference at any world size: a sharded DCP checkpoint (resharded to this
world) or a consolidated safetensors file (one process), with the model config it was trained with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardtrain.accelerator import set_fp32_matmul
from shardtrain.checkpoint.state import TrainState
from shardtrain.checkpoint.weights import load_model_weights, model_config_of
from shardtrain.config.plan import resolve_plan
from shardtrain.config.schema import Config
from shardtrain.distributed.env import DistEnv, build_mesh, init_distributed, set_cpu_threads
from shardtrain.distributed.sharded_model import ModelFactory, build_sharded_model, deferred_initialization
from shardtrain.errors import CheckpointError
from shardtrain.models.registry import model_factory


@dataclass
class Loaded:
    cfg: Config
    env: DistEnv
    model: nn.Module  # sharded
    factory: ModelFactory  # builds the plain (unsharded) model, e.g. for gathered generation
    compute_dtype: torch.dtype


def load_for_inference(checkpoint: str | Path, strategy: str = "FULL_SHARD",
                       dtype: str = "auto") -> Loaded:
    """``dtype``: the compute dtype, fp32 | bf16 | auto (bf16 on accelerators with bf16 units)."""
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointError(f"{str(path)!r} does not exist")
    model_cfg = model_config_of(path)
    cfg = Config()
    cfg.model = dataclasses.replace(model_cfg, init_from=None)
    if path.is_dir():  # evaluate on the split the run trained with
        cfg.data = TrainState.read(path).data_config()
    precision = {"fp32": "fp32", "bf16": "bf16-mixed"}.get(dtype, dtype)
    cfg.strategy = dataclasses.replace(cfg.strategy, sharding_strategy=strategy, mixed_precision=precision)
    env = init_distributed(cfg.dist.backend, cfg.dist.startup_timeout_s)
    set_cpu_threads(env, 0)
    set_fp32_matmul(env.device, tf32=dtype != "fp32")  # --dtype fp32 asks for full fp32
    if path.is_file() and env.world_size > 1:
        raise CheckpointError("a consolidated safetensors file is loaded by one process; use the "
                              "sharded checkpoint directory with --devices N")
    plan = resolve_plan(cfg.strategy, env.world_size, env.local_world_size)
    factory = model_factory(cfg.model)
    with deferred_initialization():  # every weight is read from the checkpoint: the draw never runs
        model, _ = build_sharded_model(cfg, env, plan, build_mesh(plan, env.device.type), factory)
    load_model_weights(model, str(path))
    return Loaded(cfg, env, model, factory, plan.param_dtype)
