"""Load a checkpoint for inference at any world size: a sharded DCP checkpoint (resharded to this
world) or a consolidated safetensors file (one process), with the model config it was trained with."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardtrain.checkpoint import layout
from shardtrain.checkpoint.checkpointer import load_model_weights
from shardtrain.config.schema import Config, DataConfig, ModelConfig
from shardtrain.distributed.env import DistEnv, init_distributed, set_cpu_threads
from shardtrain.distributed.parallelize import build_mesh
from shardtrain.distributed.plan import resolve_plan
from shardtrain.errors import CheckpointError
from shardtrain.models.llama import build_model
from shardtrain.train.build import build_sharded_model

CONFIG_METADATA_KEY = "shardtrain_model_config"


def model_config_of(path: Path) -> ModelConfig:
    """The model config saved with a shardtrain checkpoint or consolidated safetensors file."""
    if path.is_file() and path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(CONFIG_METADATA_KEY)
        if raw is None:
            raise CheckpointError(f"{path} carries no shardtrain model config (it was not written by "
                                  "shardtrain consolidate from a shardtrain checkpoint)")
        return ModelConfig(**json.loads(raw))
    layout.verify(path)
    return ModelConfig(**layout.read_trainer_state(path)["config"]["model"])


@dataclass
class Loaded:
    cfg: Config
    env: DistEnv
    model: nn.Module  # sharded
    compute_dtype: torch.dtype


def load_for_inference(checkpoint: str | Path, strategy: str = "FULL_SHARD",
                       dtype: str = "fp32") -> Loaded:
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointError(f"{str(path)!r} does not exist")
    model_cfg = model_config_of(path)
    cfg = Config()
    cfg.model = dataclasses.replace(model_cfg, init_from=None)
    if path.is_dir():  # evaluate on the split the run trained with
        cfg.data = DataConfig(**layout.read_trainer_state(path)["config"]["data"])
    cfg.strategy = dataclasses.replace(cfg.strategy, sharding_strategy=strategy,
                                       mixed_precision="fp32" if dtype == "fp32" else "bf16-mixed")
    env = init_distributed(cfg.dist.backend, cfg.dist.startup_timeout_s)
    if env.device.type == "cpu":
        set_cpu_threads(env, 0)
    if path.is_file() and env.world_size > 1:
        raise CheckpointError("a consolidated safetensors file is loaded by one process; use the "
                              "sharded checkpoint directory with --devices N")
    plan = resolve_plan(cfg.strategy, env.world_size, env.local_world_size)
    model, _ = build_sharded_model(cfg, env, plan, build_mesh(plan, env.device.type))
    load_model_weights(model, str(path))
    return Loaded(cfg, env, model, plan.param_dtype)


def model_factory(cfg: Config):
    return lambda: build_model(cfg.model)
