"""The strategy section's vocabulary, checked by name alone: sharding strategies (FSDP1 names),
precision presets, dtypes, activation checkpointing modes.

No torch here, so a misspelt strategy is answered as fast as any other config typo; ``plan`` turns
these names into a sharding plan for the world and the devices the launch has.
"""

from __future__ import annotations

from typing import Any

from shardtrain.config.schema import StrategyConfig
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

# The dtypes a strategy may name (plan.DTYPES maps them to torch's).
DTYPE_NAMES = ("fp32", "bf16", "fp16")

# preset -> (storage dtype, param dtype in forward/backward, gradient reduce dtype)
PRECISION_PRESETS: dict[str, tuple[str, str, str]] = {
    "fp32": ("fp32", "fp32", "fp32"),
    "bf16-mixed": ("fp32", "bf16", "fp32"),
    "bf16-pure": ("bf16", "bf16", "bf16"),
}

# Cheapest in time first: none, selective (recompute element-wise operations), every_k (every k-th
# block in full), all (every block in full). micro_batch_size=auto tries them in this order.
AC_MODES = ("none", "selective", "every_k", "all")


def normalize_strategy_name(name: str, given_as: str = "strategy.sharding_strategy=") -> str:
    """``name`` in the canonical spelling; ``given_as`` names where it came from in the error (a
    config key, or ``--strategy `` of generate and eval)."""
    # FSDP1 spells one name with a leading underscore (_HYBRID_SHARD_ZERO2), and its enum's members
    # print as ShardingStrategy.FULL_SHARD: both taken (found by review)
    key = str(name).strip().upper().replace("-", "_").removeprefix("SHARDINGSTRATEGY.").lstrip("_")
    if key not in STRATEGIES:
        raise ConfigError(
            f"{given_as}{name!r} is not a sharding strategy"
            f"{closest(key, STRATEGIES)}; choose one of {', '.join(STRATEGIES)}"
        )
    return key


def precision_preset(name: str) -> str:
    """``strategy.mixed_precision`` checked and lower-cased: a preset, or ``auto`` (which only the
    devices decide: ``plan.resolve_precision``)."""
    preset = name.lower()
    if preset != "auto" and preset not in PRECISION_PRESETS:
        raise ConfigError(
            f"strategy.mixed_precision={name!r} is unknown"
            f"{closest(preset, PRECISION_PRESETS)}; choose auto or one of {', '.join(PRECISION_PRESETS)}"
        )
    return preset


def check_compute_dtype(key: str, value: str) -> str:
    """``strategy.param_dtype`` or ``strategy.reduce_dtype`` (``key``): a dtype training can use."""
    if value not in DTYPE_NAMES:  # the dtypes training takes: fp16 is refused below (found by a review)
        usable = [name for name in DTYPE_NAMES if name != "fp16"]
        raise ConfigError(f"strategy.{key}={value!r} must be one of {', '.join(usable)}"
                          f"{closest(value, usable)}")
    if value == "fp16":  # fp16 stays a dtype name for casting exported weights, not for training
        raise ConfigError(
            f"strategy.{key}=fp16 needs loss scaling (fp16 gradients underflow to zero silently), "
            "which shardtrain does not implement; use bf16 (strategy.mixed_precision=bf16-mixed)"
        )
    return value


def checkpointing_mode(cfg: StrategyConfig) -> str:
    ac = cfg.activation_checkpointing.lower()
    if ac not in AC_MODES:
        raise ConfigError(
            f"strategy.activation_checkpointing={cfg.activation_checkpointing!r} is unknown"
            f"{closest(ac, AC_MODES)}; choose one of {', '.join(AC_MODES)}"
        )
    if ac == "every_k" and cfg.activation_checkpointing_every < 1:
        raise ConfigError("strategy.activation_checkpointing_every must be at least 1")
    return ac


def reshard_setting(value: object) -> bool | int | None:
    """``strategy.reshard_after_forward`` as given: null, a bool, or a positive int (whether the int
    divides the shard group is the plan's to check, once the world size is known)."""
    if value is None or isinstance(value, bool) or (isinstance(value, int) and value > 0):
        return value
    raise ConfigError(
        f"strategy.reshard_after_forward={value!r} must be null, true, false or a positive int"
    )


def check_strategy_names(cfg: StrategyConfig) -> None:
    """Every name in the strategy section, put in its canonical spelling (each is taken in any case,
    and compared as written after: found by review, BF16-PURE passed QLoRA's refusal of bf16-pure,
    EVERY_K was simulated as uniform blocks); what depends on the world size or the devices (group
    sizes, ``auto`` precision) is checked when the plan is resolved."""
    strategy = cfg.sharding_strategy = normalize_strategy_name(cfg.sharding_strategy)
    if cfg.shard_group_size and not strategy.startswith("HYBRID_SHARD"):
        # FSDP1's users set a group size expecting hybrid sharding, and got full sharding silently.
        raise ConfigError(f"strategy.shard_group_size={cfg.shard_group_size} applies to the hybrid "
                          f"strategies only; {strategy} shards over every data-parallel rank: use "
                          "strategy=hybrid_shard (or hybrid_shard_zero2) with it, or drop it")
    reshard_setting(cfg.reshard_after_forward)
    cfg.mixed_precision = precision_preset(cfg.mixed_precision)
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(cfg, key) is not None:
            check_compute_dtype(key, getattr(cfg, key))
    cfg.activation_checkpointing = checkpointing_mode(cfg)


def devices_count(devices: Any) -> int | None:
    """``trainer.devices`` as an int, or None for "auto"."""
    if devices == "auto":
        return None
    if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
        return devices
    if isinstance(devices, str) and devices.isdigit() and int(devices) >= 1:
        return int(devices)
    raise ConfigError(f"trainer.devices={devices!r} must be 'auto' or a positive int")
