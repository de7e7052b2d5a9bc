"""Compose a run's configuration: schema defaults <- YAML presets <- ``key=value`` overrides.

Uses hydra-core's compose API over the presets shipped in ``presets/`` and validates everything
against the dataclass schema before any process group starts: an unknown key or group option, a
value of the wrong type, or an impossible combination is a ``ConfigError`` that names the key and
suggests the closest valid one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import signal
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from shardtrain.accelerator import accelerator_count
from shardtrain.config.classpath import import_module_class
from shardtrain.config.plan import devices_count, launch_shape, resolve_plan
from shardtrain.config.schema import BUILTIN_MODELS, Config
from shardtrain.config.suggest import closest
from shardtrain.errors import ConfigError, ShardtrainError

PRESETS_DIR = Path(__file__).parent / "presets"
GROUPS = ("model", "strategy", "data", "experiment")
# Names that cannot be dataclass fields (Python keywords) -> their schema field.
ALIASES = {"checkpoint.async": "checkpoint.async_save"}


def apply_aliases(override: str) -> str:
    prefix = override[: len(override) - len(override.lstrip("+~"))]
    key, sep, value = override[len(prefix):].partition("=")
    return prefix + ALIASES.get(key, key) + sep + value


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (PRESETS_DIR / group).glob("*.yaml"))


def schema_keys(cls: type = Config, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of the schema, mapped to its field (sections included)."""
    keys: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        keys[key] = f
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not
                                    dataclasses.MISSING else None):
            keys.update(schema_keys(f.default_factory, key + "."))
    return keys


def check_override(override: str) -> None:
    if "=" not in override:
        raise ConfigError(
            f"argument {override!r} is not a key=value override (example: trainer.max_steps=100)"
        )
    key = override.split("=", 1)[0].lstrip("+~")
    value = override.split("=", 1)[1]
    if key in GROUPS:
        options = group_options(key)
        if value not in options and value != "null":
            raise ConfigError(
                f"{key}={value!r} is not a preset{closest(value, options)}; "
                f"available in {key}/: {', '.join(options)}"
            )
        return
    keys = schema_keys()
    if key not in keys:
        raise ConfigError(f"unknown config key {key!r}{closest(key, list(keys) + list(GROUPS))}")


def load_config(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The resolved, validated config for these overrides."""
    overrides = [apply_aliases(o) for o in overrides]
    for override in overrides:
        check_override(override)
    # The schema is the base of config.yaml's defaults list, so every section exists and is typed.
    ConfigStore.instance().store(name="shardtrain_schema", node=Config)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(PRESETS_DIR), version_base=None):
            composed = compose(config_name="config", overrides=overrides)
    except HydraException as exc:
        # Hydra wraps the OmegaConf type error; its cause says which value did not convert.
        cause = exc.__cause__
        detail = str(cause).splitlines()[0] if cause is not None else str(exc)
        raise ConfigError(f"invalid override: {exc.args[0] if exc.args else exc}: {detail}") from exc
    finally:
        GlobalHydra.instance().clear()
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), composed)
        cfg: Config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        message = str(exc).splitlines()[0]
        raise ConfigError(f"invalid value for {key}: {message}") from exc
    validate(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()[:16]


def validate(cfg: Config) -> None:
    t = cfg.trainer
    positive = {
        "trainer.max_steps": t.max_steps,
        "trainer.micro_batch_size": t.micro_batch_size,
        "trainer.grad_accum_steps": t.grad_accum_steps,
        "trainer.seq_len": t.seq_len,
        "trainer.num_nodes": t.num_nodes,
        "trainer.log_every": t.log_every,
        "model.dim": cfg.model.dim,
        "model.n_layers": cfg.model.n_layers,
        "model.n_heads": cfg.model.n_heads,
        "model.n_kv_heads": cfg.model.n_kv_heads,
        "model.vocab_size": cfg.model.vocab_size,
        "dist.timeout_s": cfg.dist.timeout_s,
        "dist.startup_timeout_s": cfg.dist.startup_timeout_s,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
        "trainer.eval_samples": t.eval_samples,
        "model.ffn_multiple_of": cfg.model.ffn_multiple_of,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    for key, value in {"trainer.lr": t.lr, "trainer.grad_clip_norm": t.grad_clip_norm,
                       "trainer.weight_decay": t.weight_decay}.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must not be negative")
    for key, value, low, high in [
        ("trainer.min_lr_ratio", t.min_lr_ratio, 0.0, 1.0),
        ("trainer.beta1", t.beta1, 0.0, 0.999999),
        ("trainer.beta2", t.beta2, 0.0, 0.999999),
        ("data.val_percent", cfg.data.val_percent, 0.0, 100.0),
    ]:
        if not low <= value <= high:
            raise ConfigError(f"{key}={value} must be between {low} and {high:g}")
    if t.warmup_steps < 0:
        raise ConfigError(f"trainer.warmup_steps={t.warmup_steps} must not be negative")
    devices_count(t.devices)
    if cfg.model.name not in BUILTIN_MODELS:
        hint = closest(cfg.model.name, BUILTIN_MODELS)
        raise ConfigError(f"model.name={cfg.model.name!r} is unknown{hint}; "
                          f"built-in models: {', '.join(BUILTIN_MODELS)} (bring your own through the "
                          "library API)")
    if cfg.model.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is too small for byte-level data "
                          "(256 token ids); use at least 256")
    if cfg.dist.backend == "nccl" and not accelerator_count():
        raise ConfigError(
            "dist.backend=nccl needs GPUs and none is visible; use dist.backend=auto (gloo on CPU)"
        )
    if cfg.data.source == "files":
        for entry in cfg.data.paths:
            if not Path(entry).expanduser().exists():
                raise ConfigError(f"data path {entry!r} does not exist; fix data.paths")
    for entry in cfg.strategy.wrap_policy:
        if entry != "auto":
            try:
                import_module_class(entry)
            except ShardtrainError as exc:
                raise ConfigError(f"strategy.wrap_policy: {exc}") from exc
    if t.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"trainer.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}; "
            "lower trainer.seq_len or raise model.max_seq_len"
        )
    if cfg.model.dim % cfg.model.n_heads or cfg.model.n_heads % cfg.model.n_kv_heads:
        raise ConfigError(
            f"model.dim={cfg.model.dim}, model.n_heads={cfg.model.n_heads} and "
            f"model.n_kv_heads={cfg.model.n_kv_heads}: dim must divide by n_heads and n_heads by "
            "n_kv_heads"
        )
    if (cfg.model.dim // cfg.model.n_heads) % 2:
        raise ConfigError("model.dim / model.n_heads (the head size) must be even for RoPE")
    if cfg.checkpoint.interval < 0:
        raise ConfigError(f"checkpoint.interval={cfg.checkpoint.interval} must be 0 (end only) or positive")
    for name in cfg.checkpoint.preemption_signals:
        if not isinstance(getattr(signal, str(name), None), signal.Signals):
            raise ConfigError(f"checkpoint.preemption_signals: {name!r} is not a signal name like 'SIGTERM'")
        if name in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(
                f"checkpoint.preemption_signals: {name} cannot be caught; use SIGTERM or SIGUSR1"
            )
    if str(cfg.dist.debug).upper() not in ("OFF", "INFO", "DETAIL"):
        raise ConfigError(f"dist.debug={cfg.dist.debug!r} must be OFF, INFO or DETAIL")
    if cfg.dist.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"dist.backend={cfg.dist.backend!r} must be auto, gloo or nccl")
    if cfg.data.source not in ("stdlib", "files"):
        raise ConfigError(
            f"data.source={cfg.data.source!r} must be 'stdlib' or 'files'"
            f"{closest(cfg.data.source, ['stdlib', 'files'])}"
        )
    # Check the strategy section now, against the world size the launch will have.
    per_node, world = launch_shape(cfg)
    resolve_plan(cfg.strategy, world, per_node)
