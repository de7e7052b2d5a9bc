"""Compose a run's configuration: schema defaults <- YAML presets <- ``key=value`` overrides.

Uses hydra-core's compose API over the presets shipped in ``presets/`` and validates everything
against the dataclass schema before any process group starts: an unknown key or group option, a
value of the wrong type, or an impossible combination is a ``ConfigError`` that names the key and
suggests the closest valid one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
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
from shardtrain.config.classpath import import_module_class, import_object
from shardtrain.config.plan import devices_count, launch_shape, resolve_plan
from shardtrain.config.schema import TRACKERS, Config
from shardtrain.config.suggest import closest
from shardtrain.errors import ConfigError, ShardtrainError

PRESETS_DIR = Path(__file__).parent / "presets"
GROUPS = ("model", "strategy", "data", "experiment")
# Names that cannot be dataclass fields (Python keywords) -> their schema field.
ALIASES = {"checkpoint.async": "checkpoint.async_save"}
# Keys that were replaced -> what to write instead (a one-line error: the new key's values differ).
REPLACED = {"run.tensorboard": "run.tensorboard was replaced by run.trackers, a list of trackers: "
                               "run.trackers=[] for none, run.trackers=[tensorboard,wandb,mlflow] for more"}


def apply_aliases(override: str) -> str:
    prefix = override[: len(override) - len(override.lstrip("+~"))]
    key, sep, value = override[len(prefix):].partition("=")
    return prefix + ALIASES.get(key, key) + sep + value


def task_override(override: str) -> str:
    """``task=X`` sets the task's path; ``task.NAME=V`` one of its options (checked in
    ``check_task`` against the task's Options, once the task is known)."""
    key, sep, value = override.partition("=")
    bare = key.lstrip("+~")
    if bare == "task" and sep:
        return f"task.path={value}"
    if bare.startswith("task.") and bare not in ("task.path", "task.options") and sep:
        return f"++task.options.{bare.removeprefix('task.').removeprefix('options.')}={value}"
    return override


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
    if key in REPLACED:
        raise ConfigError(REPLACED[key])
    keys = schema_keys()
    if key not in keys and not key.startswith("task.options."):
        raise ConfigError(f"unknown config key {key!r}{closest(key, list(keys) + list(GROUPS))}")


def load_config(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The resolved, validated config for these overrides."""
    overrides = [task_override(apply_aliases(o)) for o in overrides]
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


def check_ranges(cfg: Any, cls: type = Config, prefix: str = "") -> None:
    """Every key against the bounds declared beside it in the schema (``knob(...)``); also a
    task's options (``cls``: its Options, ``prefix`` "task.")."""
    for key, f in schema_keys(cls).items():
        if not f.metadata:
            continue
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        key = prefix + key
        low, above, high, choices = (f.metadata.get(k) for k in ("at_least", "above", "at_most", "one_of"))
        if choices is not None and value not in choices:
            raise ConfigError(f"{key}={value!r} is unknown{closest(str(value), choices)}; choose one of "
                              f"{', '.join(choices)}")
        if low is not None and high is not None and not low <= value <= high:
            raise ConfigError(f"{key}={value} must be between {low} and {high:g}")
        if low is not None and value < low:
            raise ConfigError(f"{key}={value} " + ("must not be negative" if low == 0 else
                                                   f"must be at least {low}"))
        if above is not None and value <= above:
            raise ConfigError(f"{key}={value} must be greater than {above}")


def check_model(cfg: Config) -> None:
    """The model section: a Hugging Face directory that exists, or the built-in model's shape."""
    m, seq_len = cfg.model, cfg.trainer.seq_len
    if m.tokenizer not in ("auto", "bytes") and not Path(m.tokenizer).expanduser().exists():
        raise ConfigError(f"model.tokenizer={m.tokenizer!r} does not exist; use auto (the model's own), "
                          "bytes, or a tokenizer.json file or the directory holding one")
    if m.name == "hf":
        if not m.path:
            raise ConfigError("model.name=hf needs model.path=DIR, a local Hugging Face model directory "
                              "(config.json, safetensors weights, tokenizer.json)")
        config_file = Path(m.path).expanduser() / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"model.path={m.path!r} has no config.json (nothing is downloaded: "
                              "point it at a directory written by save_pretrained)")
        try:
            hf = json.loads(config_file.read_text())
        except ValueError as exc:
            raise ConfigError(f"{config_file} is not valid JSON ({exc})") from exc
        positions = hf.get("max_position_embeddings") or hf.get("n_positions")
        if positions and seq_len > positions:
            raise ConfigError(f"trainer.seq_len={seq_len} exceeds the model's {positions} positions "
                              f"({config_file}); lower trainer.seq_len")
        return
    if m.path:
        raise ConfigError(f"model.path={m.path!r} is read with model.name=hf only (a Hugging Face model "
                          "directory); add model=hf, or drop model.path for the built-in model")
    if m.tokenizer in ("auto", "bytes") and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is too small for byte-level data "
                          "(256 token ids); use at least 256")
    if seq_len > m.max_seq_len:
        raise ConfigError(
            f"trainer.seq_len={seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
            "lower trainer.seq_len or raise model.max_seq_len"
        )
    if m.dim % m.n_heads or m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.dim={m.dim}, model.n_heads={m.n_heads} and model.n_kv_heads={m.n_kv_heads}: dim "
            "must divide by n_heads and n_heads by n_kv_heads"
        )
    if (m.dim // m.n_heads) % 2:
        raise ConfigError("model.dim / model.n_heads (the head size) must be even for RoPE")


def check_task_section(cfg: Config) -> None:
    """``task.path`` imports, and ``task.options`` fit its ``Options`` dataclass: names, types and
    bounds, each wrong one a ConfigError naming ``task.NAME``. The options are stored back in full,
    defaults included, so config.yaml and checkpoints record every one."""
    cls = import_object(cfg.task.path, "task")
    if not isinstance(cls, type):
        raise ConfigError(f"task={cfg.task.path!r} is not a class")
    cfg.task.path = f"{cls.__module__}:{cls.__qualname__}"  # one spelling, whichever was given
    options_cls = getattr(cls, "Options", None)
    if options_cls is None:
        if cfg.task.options:
            raise ConfigError(f"task {cfg.task.path} takes no options (it declares no Options "
                              f"dataclass), got task.{next(iter(cfg.task.options))}")
        return
    if not dataclasses.is_dataclass(options_cls):
        raise ConfigError(f"task {cfg.task.path}: its Options must be a dataclass")
    names = [f.name for f in dataclasses.fields(options_cls)]
    reserved = sorted({"path", "options"} & set(names))
    if reserved:
        raise ConfigError(f"task {cfg.task.path}: an option may not be named {' or '.join(reserved)} "
                          "(task.path and task.options are the task section's own keys); rename it")
    for name in cfg.task.options:
        if name not in names:
            raise ConfigError(f"unknown task option 'task.{name}'"
                              f"{closest(f'task.{name}', [f'task.{n}' for n in names])}; "
                              f"{cls.__name__} takes: {', '.join(names) or 'none'}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(options_cls), cfg.task.options)
        options = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"invalid value for task.{key}: {str(exc).splitlines()[0]}") from exc
    check_ranges(options, options_cls, "task.")
    cfg.task.options = OmegaConf.to_container(merged)


def check_trackers(trackers: list[str]) -> None:
    for name in trackers:
        if name not in TRACKERS:
            raise ConfigError(f"run.trackers: {name!r} is not a tracker{closest(str(name), TRACKERS)}; "
                              f"choose from {', '.join(TRACKERS)}")
    if len(set(trackers)) != len(trackers):
        raise ConfigError(f"run.trackers={list(trackers)} names a tracker twice; name each once")


def validate(cfg: Config) -> None:
    t = cfg.trainer
    cfg.dist.debug = str(cfg.dist.debug).upper()
    check_ranges(cfg)
    devices_count(t.devices)
    if cfg.dist.backend == "nccl" and not accelerator_count():
        raise ConfigError(
            "dist.backend=nccl needs GPUs and none is visible; use dist.backend=auto (gloo on CPU)"
        )
    if cfg.data.source in ("files", "prepared"):
        for entry in cfg.data.paths:
            if not any(ch in entry for ch in "*?[") and not Path(entry).expanduser().exists():
                raise ConfigError(f"data path {entry!r} does not exist; fix data.paths")
    weights = cfg.data.weights
    if weights and (cfg.data.source != "prepared" or len(weights) != len(cfg.data.paths)
                    or not all(isinstance(w, (int, float)) and w > 0 for w in weights)):
        raise ConfigError(f"data.weights={list(weights)}: one positive weight per prepared dataset in "
                          f"data.paths ({len(cfg.data.paths)} given), with data.source=prepared")
    if cfg.data.cache_dir != "auto" and Path(cfg.data.cache_dir).expanduser().is_file():
        raise ConfigError(f"data.cache_dir={cfg.data.cache_dir!r} is a file; name a directory (or auto)")
    for entry in cfg.strategy.wrap_policy:
        if entry != "auto" and "." in entry:  # a bare class name is looked up in the model itself
            try:
                import_module_class(entry)
            except ShardtrainError as exc:
                raise ConfigError(f"strategy.wrap_policy: {exc}") from exc
    check_model(cfg)
    check_task_section(cfg)
    check_trackers(cfg.run.trackers)
    for name in cfg.checkpoint.preemption_signals:
        if not isinstance(getattr(signal, str(name), None), signal.Signals):
            raise ConfigError(f"checkpoint.preemption_signals: {name!r} is not a signal name like 'SIGTERM'")
        if name in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(
                f"checkpoint.preemption_signals: {name} cannot be caught; use SIGTERM or SIGUSR1"
            )
    # Check the strategy section now, against the world size the launch will have.
    per_node, world = launch_shape(cfg)
    resolve_plan(cfg.strategy, world, per_node)
