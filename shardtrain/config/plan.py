"""Resolve a config (FSDP1 vocabulary welcome) into what FSDP2 and torchrun will be asked to do.

Pure functions of the config and the world: the launch shape (processes per node, world size), the
mesh shape, reshard policy and dtypes. Unit-testable, and the ``plan`` and diagnostics commands can
show them without starting any process group. This module is the one home of the dtype table, the
strategy table and how a mesh is described.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from shardtrain.accelerator import accelerator_count, default_precision
from shardtrain.config.schema import Config, StrategyConfig
from shardtrain.config.suggest import closest
from shardtrain.errors import ConfigError

# FSDP1 name -> (hybrid mesh?, reshard parameters after forward?). NO_SHARD is a 2-D mesh whose
# shard groups have size 1: every rank holds everything and gradients are all-reduced (DDP).
STRATEGIES: dict[str, tuple[bool, bool]] = {
    "FULL_SHARD": (False, True),
    "SHARD_GRAD_OP": (False, False),
    "NO_SHARD": (True, False),
    "HYBRID_SHARD": (True, True),
    "HYBRID_SHARD_ZERO2": (True, False),
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# preset -> (storage dtype, param dtype in forward/backward, gradient reduce dtype)
PRECISION_PRESETS: dict[str, tuple[str, str, str]] = {
    "fp32": ("fp32", "fp32", "fp32"),
    "bf16-mixed": ("fp32", "bf16", "fp32"),
    "bf16-pure": ("bf16", "bf16", "bf16"),
}

AC_MODES = ("none", "all", "every_k")


def dtype_name(dtype: torch.dtype | str) -> str:
    """'float32', 'bfloat16', ...: how every report and file names a dtype."""
    return str(dtype).replace("torch.", "")


def describe_mesh(dim_names: list[str] | tuple[str, ...], shape: list[int] | tuple[int, ...]) -> str:
    """'dp_replicate=2 x dp_shard=4'."""
    return " x ".join(f"{n}={s}" for n, s in zip(dim_names, shape, strict=True))


@dataclass(frozen=True)
class ShardingPlan:
    strategy: str
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    reshard_after_forward: bool | int
    storage_dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    cpu_offload: bool
    activation_checkpointing: str
    activation_checkpointing_every: int
    grad_accumulation: str = "sharded"  # sharded | unsharded (see StrategyConfig)
    precision: str = "fp32"  # the mixed-precision preset, with auto resolved

    def checkpointed(self, block_index: int) -> bool:
        if self.activation_checkpointing == "all":
            return True
        if self.activation_checkpointing == "every_k":
            return block_index % self.activation_checkpointing_every == 0
        return False

    @property
    def mesh(self) -> str:
        return describe_mesh(self.mesh_dim_names, self.mesh_shape)

    def describe(self) -> str:
        ac = self.activation_checkpointing
        if ac == "every_k":
            ac = f"every {self.activation_checkpointing_every} blocks"
        return (
            f"{self.strategy}: mesh [{self.mesh}], reshard_after_forward={self.reshard_after_forward}, "
            f"storage={dtype_name(self.storage_dtype)} compute={dtype_name(self.param_dtype)} "
            f"reduce={dtype_name(self.reduce_dtype)}, cpu_offload={self.cpu_offload}, "
            f"activation_checkpointing={ac}, grad_accumulation={self.grad_accumulation}"
        )


def normalize_strategy_name(name: str) -> str:
    key = str(name).strip().upper().replace("-", "_")
    if key not in STRATEGIES:
        raise ConfigError(
            f"strategy.sharding_strategy={name!r} is not a sharding strategy"
            f"{closest(key, STRATEGIES)}; choose one of {', '.join(STRATEGIES)}"
        )
    return key


def resolve_precision(name: str, accelerated: bool | None = None) -> str:
    """The mixed-precision preset ``strategy.mixed_precision`` names; ``auto`` is bf16-mixed on
    accelerators (``accelerated``; None: this machine's devices) and fp32 on CPUs."""
    preset = name.lower()
    if preset == "auto":
        preset = default_precision() if accelerated is None else ("bf16-mixed" if accelerated else "fp32")
    if preset not in PRECISION_PRESETS:
        raise ConfigError(
            f"strategy.mixed_precision={name!r} is unknown"
            f"{closest(preset, PRECISION_PRESETS)}; choose auto or one of {', '.join(PRECISION_PRESETS)}"
        )
    return preset


def resolve_plan(cfg: StrategyConfig, world_size: int, local_world_size: int,
                 accelerated: bool | None = None) -> ShardingPlan:
    """``accelerated``: what ``mixed_precision=auto`` plans for (None: this machine's devices)."""
    strategy = normalize_strategy_name(cfg.sharding_strategy)
    hybrid, reshard = STRATEGIES[strategy]

    if strategy == "NO_SHARD":
        mesh_shape: tuple[int, ...] = (world_size, 1)
    elif hybrid:
        shard = cfg.shard_group_size or local_world_size
        if shard <= 0 or world_size % shard:
            raise ConfigError(
                f"strategy.shard_group_size={shard} must divide the world size {world_size} "
                f"for {strategy}; set strategy.shard_group_size to a divisor of {world_size}"
            )
        mesh_shape = (world_size // shard, shard)
    else:
        mesh_shape = (world_size,)
    names = ("dp_replicate", "dp_shard") if len(mesh_shape) == 2 else ("dp_shard",)

    raf = cfg.reshard_after_forward
    if raf is None:
        reshard_after_forward: bool | int = reshard
    elif isinstance(raf, bool):
        reshard_after_forward = raf
    elif isinstance(raf, int) and raf > 0:
        if raf == 1 or mesh_shape[-1] % raf:
            raise ConfigError(
                f"strategy.reshard_after_forward={raf} must be a divisor of the shard group size "
                f"{mesh_shape[-1]} other than 1 (or true/false)"
            )
        reshard_after_forward = True if raf == mesh_shape[-1] else raf
    else:
        raise ConfigError(
            f"strategy.reshard_after_forward={raf!r} must be null, true, false or a positive int"
        )

    preset = resolve_precision(cfg.mixed_precision, accelerated)
    storage, param, reduce = PRECISION_PRESETS[preset]
    param = cfg.param_dtype or param
    reduce = cfg.reduce_dtype or reduce
    for key, value in (("param_dtype", param), ("reduce_dtype", reduce)):
        if value not in DTYPES:
            raise ConfigError(f"strategy.{key}={value!r} must be one of {', '.join(DTYPES)}")
        if value == "fp16":  # fp16 stays in DTYPES for casting exported weights, not for training
            raise ConfigError(
                f"strategy.{key}=fp16 needs loss scaling (fp16 gradients underflow to zero silently), "
                "which shardtrain does not implement; use bf16 (strategy.mixed_precision=bf16-mixed)"
            )

    ac = cfg.activation_checkpointing.lower()
    if ac not in AC_MODES:
        raise ConfigError(
            f"strategy.activation_checkpointing={cfg.activation_checkpointing!r} must be one of "
            f"{', '.join(AC_MODES)}"
        )
    if ac == "every_k" and cfg.activation_checkpointing_every < 1:
        raise ConfigError("strategy.activation_checkpointing_every must be at least 1")

    return ShardingPlan(
        strategy=strategy,
        mesh_shape=mesh_shape,
        mesh_dim_names=names,
        reshard_after_forward=reshard_after_forward,
        storage_dtype=DTYPES[storage],
        param_dtype=DTYPES[param],
        reduce_dtype=DTYPES[reduce],
        cpu_offload=cfg.cpu_offload,
        activation_checkpointing=ac,
        activation_checkpointing_every=cfg.activation_checkpointing_every,
        grad_accumulation=resolve_accumulation(cfg.grad_accumulation, mesh_shape[-1]),
        precision=preset,
    )


def resolve_accumulation(choice: str, shard_group: int) -> str:
    """auto: sharded whenever there is something to reduce-scatter. Holding full-size gradients
    between micro-batches (about 4 bytes a parameter on every rank) defeats the sharding the run
    asked for; with a shard group of one (NO_SHARD, one rank) gradients are whole anyway, and one
    all-reduce per step is the cheaper choice (DDP's no_sync)."""
    if choice != "auto":
        return choice
    return "sharded" if shard_group > 1 else "unsharded"


def devices_count(devices: Any) -> int | None:
    """``trainer.devices`` as an int, or None for "auto"."""
    if devices == "auto":
        return None
    if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
        return devices
    if isinstance(devices, str) and devices.isdigit() and int(devices) >= 1:
        return int(devices)
    raise ConfigError(f"trainer.devices={devices!r} must be 'auto' or a positive int")


def launch_shape(cfg: Config) -> tuple[int, int]:
    """(processes per node, world size) the config asks for.

    ``trainer.devices=auto`` follows torchrun when running under it, else one process per
    accelerator (one on a CPU-only machine).
    """
    per_node = devices_count(cfg.trainer.devices)
    if per_node is None:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or max(1, accelerator_count())
    return per_node, per_node * cfg.trainer.num_nodes


def check_world(cfg: Config, world_size: int, local_world_size: int) -> None:
    """The world that was started (by torchrun, or a process group) must be the one configured."""
    per_node, world = launch_shape(cfg)
    if (local_world_size, world_size) != (per_node, world):
        raise ConfigError(
            f"{world_size} processes were started, {local_world_size} per node, but the config asks "
            f"for trainer.devices={cfg.trainer.devices} per node x trainer.num_nodes="
            f"{cfg.trainer.num_nodes}; make them agree (trainer.devices=auto follows torchrun, "
            "torchrun --nproc-per-node N starts N per node)"
        )
