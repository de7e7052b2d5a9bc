"""Compose a run's configuration: schema defaults <- YAML presets <- ``key=value`` overrides.

Uses hydra-core's compose API over the presets shipped in ``presets/`` and checks the result against
the dataclass schema: an unknown key or group option, a value of the wrong type or out of bounds, a
path that does not exist or an impossible combination is a ``ConfigError`` that names the key and
suggests the closest valid one.

Nothing here imports torch (a test holds it to that): the config's own mistakes are answered in a
fraction of a second. ``keys`` knows the names an override may use; ``loader`` checks next what
needs torch, the devices or the task's code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import signal
import typing
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from shardtrain.config.keys import ALIASES, PRESETS_DIR, check_overrides, schema_keys
from shardtrain.config.schema import (
    LANGUAGE_MODEL_TASK,
    TRACKERS,
    CheckpointConfig,
    Config,
    DiagnosticsConfig,
    FinetuneConfig,
    ModelConfig,
    StrategyConfig,
    TrainerConfig,
    mixture_weights_valid,
    val_percent_problem,
)
from shardtrain.config.strategy import check_strategy_names, devices_count, reshard_setting
from shardtrain.config.suggest import closest
from shardtrain.errors import ConfigError, json_object

# ModelConfig's fields that only the built-in Llama reads (model.name=hf takes config.json's).
LLAMA_ONLY_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim",
                     "ffn_multiple_of", "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings",
                     "lean_layers", "init_std")


def override_hint(detail: str) -> str:
    """How to write the value OmegaConf refused (its own message names only the type)."""
    if "is not a ListConfig" in detail:
        return "; a list is written in brackets: key=[a,b] (key=[a] for one)"
    if "is not Optional" in detail:
        return "; this key takes no null" + (" (checkpoint.resume=none starts afresh)"
                                              if "checkpoint.resume" in detail else "")
    return ""


def plain_override_error(message: str, detail: str) -> str | None:
    """Hydra's "Error merging override KEY=VALUE" for a value of the wrong shape, said as the mistake
    made (a list without brackets, a value given to a whole section), or None for any other."""
    found = re.search(r"override (\S+?)=(\S*)", message)
    if found is None:
        return None
    key, value = found.groups()
    if "is not a ListConfig" in detail:
        return f"{key}={value} is not a list: write {key}=[{value}] (a list is in brackets: key=[a,b])"
    # OmegaConf's words for a value of another type (found by a review: "Value '2.5' of type 'float'
    # could not be converted to Integer", no fix named)
    if "could not be converted to Integer" in detail:
        return f"{key}={value} must be a whole number"
    if "could not be converted to Float" in detail:
        return f"{key}={value} must be a number"
    if re.search(r"Cannot convert '(list|dict)' to string", detail):
        return f"{key}={value} is a list; {key} takes one value: write {key}=VALUE"
    if "is not a subclass of" in detail:
        section = section_fields(key)
        example = f" ({', '.join(f'{key}.{name}' for name in section[:4])}, ...)" if section else ""
        return f"{key} is a section of settings, not a value: set its keys{example}"
    return None


def section_fields(key: str) -> list[str]:
    """The field names of the config section at dotted ``key`` (``run.mlflow``); [] if none."""
    node: Any = Config
    for part in key.split("."):
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        if part not in hints:
            return []
        node = hints[part]
    return [field.name for field in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config these overrides make, checked on its own (``loader.load_config`` goes on to check
    it against the code it names and the devices)."""
    overrides = check_overrides(overrides)
    # The schema is the base of config.yaml's defaults list, so every section exists and is typed.
    ConfigStore.instance().store(name="shardtrain_schema", node=Config)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(PRESETS_DIR), version_base=None):
            composed = compose(config_name="config", overrides=overrides)
    except HydraException as exc:
        if (unreadable := unreadable_override(overrides)) is not None:
            raise ConfigError(unreadable) from exc
        # Hydra wraps the OmegaConf type error; its cause says which value did not convert.
        cause = exc.__cause__
        detail = str(cause).splitlines()[0] if cause is not None else str(exc)
        if (plain := plain_override_error(str(exc.args[0]) if exc.args else str(exc), detail)) is not None:
            raise ConfigError(plain) from exc
        hint = override_hint(detail)
        detail = detail.rstrip(".") if hint else detail
        raise ConfigError(f"invalid override: {exc.args[0] if exc.args else exc}: {detail}{hint}") from exc
    finally:
        GlobalHydra.instance().clear()
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), composed)
        cfg: Config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        message = str(exc).splitlines()[0]
        raise ConfigError(f"invalid value for {key}: {message}") from exc
    check_config(cfg)
    check_preparation_overrides(cfg, overrides)
    check_unread_overrides(cfg, overrides)
    anchor_paths(cfg)
    return cfg


# The notices schedulers send before stopping a job (Slurm's --signal, Kubernetes' and torchrun's
# SIGTERM, LSF's SIGUSR2 or SIGXCPU), which the launcher's agent can ignore: not SIGINT (Ctrl-C, an
# interrupt) nor SIGHUP (how the launcher stops its agent when SIGTERM preempts).
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGXCPU", "SIGALRM")


# The data settings that shape a preparation of text (data.source=files or stdlib).
PREPARATION_KEYS = ("data.val_percent", "data.max_bytes", "data.text_field", "data.file_glob")


def check_preparation_overrides(cfg: Config, overrides: list[str]) -> None:
    """A preparation setting given beside ``data.source=prepared``, which reads a dataset prepared
    with its own (they were accepted and ignored). Presets' values are left alone: the quick
    experiment's data.max_bytes slices text sources, and a prepared dataset is whole."""
    if cfg.data.source != "prepared":
        return
    given = [key for key in PREPARATION_KEYS if overridden(overrides, key)]
    if given:
        raise ConfigError(f"{', '.join(given)} shape{'s' if len(given) == 1 else ''} how shardtrain prepares "
                          "text (data.source=files or stdlib); data.source=prepared reads a dataset with the "
                          "settings it was prepared with (its manifest.json): drop "
                          f"{'it' if len(given) == 1 else 'them'}, or prepare again (shardtrain prepare "
                          "--val-percent, --max-bytes, --text-field, --glob)")


def overridden(overrides: list[str], prefix: str) -> list[str]:
    """The keys of ``overrides`` equal to ``prefix`` or under it (``run.wandb``: its keys)."""
    keys = (override.lstrip("+~").partition("=")[0] for override in overrides)
    return [key for key in keys if key == prefix or key.startswith(prefix + ".")]


def check_unread_overrides(cfg: Config, overrides: list[str]) -> None:
    """A setting given on the command line that nothing of this run reads: a tracker's keys without
    the tracker in run.trackers, the text cache beside a prepared dataset (each was accepted and
    ignored, found by review). Presets' values are left alone, as ``check_preparation_overrides``
    leaves them."""
    for tracker in ("wandb", "mlflow"):
        keys = overridden(overrides, f"run.{tracker}")
        if keys and tracker not in cfg.run.trackers:
            raise ConfigError(f"{', '.join(keys)} set{'s' if len(keys) == 1 else ''} up the {tracker} "
                              f"tracker, and run.trackers={list(cfg.run.trackers)} does not start it; add it "
                              f"(run.trackers=[{','.join([*cfg.run.trackers, tracker])}]), or drop "
                              f"{'it' if len(keys) == 1 else 'them'}")
    if cfg.run.offline and cfg.run.mlflow.tracking_uri and overridden(overrides, "run.mlflow.tracking_uri"):
        raise ConfigError(f"run.mlflow.tracking_uri={cfg.run.mlflow.tracking_uri} names where MLflow logs, "
                          "and run.offline=true logs it to the file store run.dir/mlruns instead; drop one "
                          "of them")
    # Each read only beside another setting (found by a review of the command line: accepted, and
    # nothing said that it did nothing)
    unread = {
        "strategy.sequence_parallel": (cfg.strategy.tensor_parallel == 1,
                                       "splits sequences over tensor-parallel groups, and strategy."
                                       "tensor_parallel=1 has none"),
        "strategy.tensor_parallel_across_nodes": (cfg.strategy.tensor_parallel == 1,
                                                  "places tensor-parallel groups, and strategy."
                                                  "tensor_parallel=1 has none"),
        "model.pretrained": (cfg.model.name != "hf",
                             f"reads a Hugging Face model's weights, and model.name={cfg.model.name} is "
                             "drawn (model.init_from reads weights for it)"),
        "data.text_field": (cfg.data.source == "stdlib",
                            "names the text of JSON records, and data.source=stdlib reads Python sources"),
        "trainer.sample_prompt": (cfg.trainer.sample_tokens == 0,
                                  "starts the text samples, and trainer.sample_tokens=0 draws none"),
        "run.tracker_timeout_s": (not cfg.run.trackers, "bounds the trackers' calls, and run.trackers=[] "
                                  "starts none"),
    }
    for key, (ignored, why) in unread.items():
        if ignored and overridden(overrides, key):
            raise ConfigError(f"{key} {why}: drop it")
    if cfg.data.source == "prepared" and overridden(overrides, "data.cache_dir"):
        raise ConfigError("data.cache_dir is where text sources (data.source=files or stdlib) are prepared, "
                          "and data.source=prepared reads data.paths as they are; drop it (shardtrain "
                          "prepare writes where it is told)")


def unreadable_override(overrides: list[str]) -> str | None:
    """The first override hydra's grammar cannot read as one value, said with its fix (hydra's
    own message suggests --multirun, which shardtrain has not), else None."""
    parser = OverridesParser.create()
    for override in overrides:
        key, _, value = override.partition("=")
        try:
            sweep = parser.parse_override(override).is_sweep_override()
        except HydraException as exc:
            opened = {"[": "]", "{": "}"}.get(value[:1])
            if opened and value.count(value[0]) > value.count(opened):
                # A list left open: quoting it made it a string (found by a review)
                return f"cannot read {override!r}: the {value[0]} is not closed; write {key}={value}{opened}"
            return (f"cannot read {override!r} ({str(exc).splitlines()[0]}): quote a value holding "
                    f"( ) [ ] {{ }} , = ' or spaces, e.g. {key}='{value}' (in a shell: \"{key}='{value}'\")")
        if sweep:
            return (f"{override!r}: a comma separates list items; write a list as {key}=[{value}], or "
                    f"quote a value with a comma: {key}='{value}'")
    return None


# Settings of the saves themselves: with checkpoint.enabled=false none is saved, and each was ignored
# without a word (save_full=true wrote no model.safetensors).
SAVE_SETTINGS = ("interval", "keep_last", "async_save", "reuse_staging", "save_full", "preemption_signals")


def check_nothing_expects_checkpoints(cfg: Config) -> None:
    """With checkpoints off: no save setting changed from its default, and no restart, which goes on
    from the newest checkpoint (without one it trained the same steps again)."""
    default = CheckpointConfig()
    written = {field: alias for alias, field in ALIASES.items()}  # as the user writes it: checkpoint.async
    def shown(value: object) -> str:
        return f"[{','.join(value)}]" if isinstance(value, list) else str(value).lower()

    changed = []
    for key in SAVE_SETTINGS:
        if (value := getattr(cfg.checkpoint, key)) != getattr(default, key):
            name = f"checkpoint.{key}"
            changed.append(f"{written.get(name, name)}={shown(value)}")
    if changed:
        one = len(changed) == 1
        raise ConfigError(f"{', '.join(changed)} shape{'s' if one else ''} checkpoints, and "
                          f"checkpoint.enabled=false saves none; drop {'it' if one else 'them'}, or "
                          "enable checkpoints")
    if cfg.trainer.max_restarts > 0:
        raise ConfigError(f"trainer.max_restarts={cfg.trainer.max_restarts} restarts from the newest "
                          "checkpoint, and checkpoint.enabled=false saves none (each restart would train "
                          "from step 0 again); enable checkpoints, or set trainer.max_restarts=0")


def check_checkpointing_every(cfg: Config) -> None:
    """``strategy.activation_checkpointing_every`` changed where no every_k is ever used: neither
    the mode given nor one ``trainer.micro_batch_size=auto`` may choose (it tries the modes from the
    one given towards ``all``). Accepted, it changed nothing."""
    strategy = cfg.strategy
    mode = strategy.activation_checkpointing.lower()
    may_choose_every_k = cfg.trainer.micro_batch_size == "auto" and mode in ("none", "selective")
    every = strategy.activation_checkpointing_every
    if every == StrategyConfig().activation_checkpointing_every or mode == "every_k" or may_choose_every_k:
        return
    raise ConfigError(f"strategy.activation_checkpointing_every={every} is k for activation_checkpointing="
                      f"every_k, and activation_checkpointing={strategy.activation_checkpointing} "
                      "checkpoints no block every k; add strategy.activation_checkpointing=every_k, or "
                      "drop it")


def anchor_paths(cfg: Config) -> None:
    """``model.path``, a tokenizer file, ``model.init_from`` and ``model.adapter`` given relative to
    the working directory, made absolute:
    checkpoints record them, and generate, eval and export-hf read them from wherever those run (a
    relative path named another directory there, or none); ``run.dir``'s ``~`` expanded."""
    model = cfg.model
    if model.path:
        model.path = str(Path(model.path).expanduser().absolute())
    if cfg.run.dir.startswith("~"):  # quoted, '~/runs/a' made a directory named ~ here
        cfg.run.dir = str(Path(cfg.run.dir).expanduser())
    if model.tokenizer not in ("auto", "bytes"):
        model.tokenizer = str(Path(model.tokenizer).expanduser().absolute())
    # The base a LoRA checkpoint's exports, generate and eval read again (found by a review: relative,
    # they were "gone" from any other directory); hf: keeps its prefix (checkpoint.weights.HF_PREFIX).
    if model.init_from:
        prefix = "hf:" if model.init_from.startswith("hf:") else ""
        model.init_from = prefix + str(Path(model.init_from.removeprefix(prefix)).expanduser().absolute())
    if model.adapter:
        model.adapter = str(Path(model.adapter).expanduser().absolute())


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()[:16]


def config_hash_within(cfg: Config, saved: dict[str, Any]) -> str:
    """``config_hash`` of ``cfg`` with only the keys a saved config holds: a config saved before a
    key joined the schema was hashed without it (every added key changed every run's hash, and a
    job requeued across an upgrade no longer knew its own checkpoints)."""
    def kept(now: Any, then: Any) -> Any:
        if isinstance(now, dict) and isinstance(then, dict):
            return {key: kept(value, then[key]) for key, value in now.items() if key in then}
        return now

    body = kept(OmegaConf.to_container(OmegaConf.structured(cfg)), saved)
    return hashlib.sha256(OmegaConf.to_yaml(OmegaConf.create(body)).encode()).hexdigest()[:16]


def run_identity(cfg: Config) -> Config:
    """``cfg`` without where it runs (``run_identity_hash``)."""
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, devices="auto", num_nodes=1))


def run_identity_hash(cfg: Config) -> str:
    """``config_hash`` of ``cfg`` without where it runs (``trainer.devices``, ``trainer.num_nodes``):
    a requeued job of the same run may be given another number of nodes (the Slurm script passes
    ``trainer.num_nodes=$SLURM_NNODES``). Taken before start-up derives the accumulation steps or an
    auto micro-batch from the world it finds."""
    return config_hash(run_identity(cfg))


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
        if f.metadata.get("or_auto"):
            if value == "auto":
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{key}={value!r} must be 'auto' or a whole number")
        if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison
            raise ConfigError(f"{key}={value} must be a finite number")
        low, above, high, choices = (f.metadata.get(k) for k in ("at_least", "above", "at_most", "one_of"))
        if choices is not None and value not in choices:
            raise ConfigError(f"{key}={value!r} is unknown{closest(str(value), choices)}; choose one of "
                              f"{', '.join(choices)}")
        if low is not None and high is not None and not low <= value <= high:
            raise ConfigError(f"{key}={value} must be between {low} and {high}")
        if low is not None and value < low:
            raise ConfigError(f"{key}={value} " + ("must not be negative" if low == 0 else
                                                   f"must be at least {low}"))
        if above is not None and value <= above:
            raise ConfigError(f"{key}={value} must be greater than {above}")
        if high is not None and value > high:  # a bound above without one below
            raise ConfigError(f"{key}={value} must be at most {high}")


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
        hf = json_object(config_file, ConfigError, "write it again with save_pretrained")
        defaults = ModelConfig()
        if changed := [key for key in LLAMA_ONLY_FIELDS if getattr(m, key) != getattr(defaults, key)]:
            shown = ", ".join(f"model.{key}={getattr(m, key)}" for key in changed)
            raise ConfigError(f"{shown} shape{'s' if len(changed) == 1 else ''} the built-in Llama only; "
                              f"model.name=hf takes its shape from {config_file}: drop "
                              f"{'it' if len(changed) == 1 else 'them'} (the model=hf preset sets none) "
                              "or edit config.json")
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
    check_llama_shape(m)


def check_llama_shape(m: ModelConfig) -> None:
    """The built-in Llama's heads: also checked where the model is built from a ModelConfig made in
    code, which no config loader saw (a view() of a head size that does not divide failed obscurely)."""
    if m.dim % m.n_heads or m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.dim={m.dim}, model.n_heads={m.n_heads} and model.n_kv_heads={m.n_kv_heads}: dim "
            "must divide by n_heads and n_heads by n_kv_heads"
        )
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(f"model.dim / model.n_heads = {m.dim // m.n_heads} (the head size) must be even "
                          "for RoPE")


def check_batch_size(cfg: Config) -> None:
    """``trainer.micro_batch_size=auto`` keeps a global batch fixed: one must be named."""
    t = cfg.trainer
    if t.micro_batch_size == "auto" and not t.global_batch_size:
        raise ConfigError("trainer.micro_batch_size=auto needs trainer.global_batch_size=N (the "
                          "sequences per step it keeps fixed while it chooses the micro-batch)")
    check_auto_accumulation(t)


def check_auto_accumulation(trainer: TrainerConfig) -> None:
    """An auto micro-batch chooses the accumulation steps: one given is a contradiction at every
    world size (``plan`` said so on each row and exited 0; train said so inside the trainer, after
    torchrun had started: found by review)."""
    if trainer.micro_batch_size == "auto" and trainer.grad_accum_steps != 1:
        raise ConfigError(f"trainer.grad_accum_steps={trainer.grad_accum_steps} contradicts trainer."
                          "micro_batch_size=auto, which chooses the accumulation steps from "
                          "trainer.global_batch_size; leave grad_accum_steps at 1")


def check_trackers(trackers: list[str]) -> None:
    for name in trackers:
        if name not in TRACKERS:
            hint = closest(str(name), TRACKERS)
            raise ConfigError(f"run.trackers: {name!r} is not a tracker{hint}{' C' if hint else '; c'}hoose "
                              f"from {', '.join(TRACKERS)}")
    if len(set(trackers)) != len(trackers):
        raise ConfigError(f"run.trackers={list(trackers)} names a tracker twice; name each once")


def check_finetune(finetune: FinetuneConfig, mixed_precision: str = "auto") -> None:
    """The adapters' settings given without adapters changed nothing: refused, named. QLoRA under
    bf16-pure would quantise bf16-rounded weights (their NF4 scales differ, a layer's output by 3%),
    which generate, eval and export-hf --merge, quantising the fp32 weights, do not rebuild."""
    if finetune.method == "qlora" and mixed_precision == "bf16-pure":
        raise ConfigError("finetune.method=qlora with strategy.mixed_precision=bf16-pure would quantise the "
                          "base from bf16-rounded weights, which generate, eval and export do not rebuild; "
                          "use strategy.mixed_precision=bf16-mixed (the NF4 base is 4-bit either way)")
    if finetune.method != "none":
        return
    defaults = FinetuneConfig()
    if changed := [f.name for f in dataclasses.fields(finetune)
                   if f.name != "method" and getattr(finetune, f.name) != getattr(defaults, f.name)]:
        shown = ", ".join(f"finetune.{name}={getattr(finetune, name)}" for name in changed)
        raise ConfigError(f"{shown} shape{'s' if len(changed) == 1 else ''} LoRA adapters, and this run "
                          "trains every parameter (finetune.method=none); add finetune=lora (or qlora), "
                          f"or drop {'it' if len(changed) == 1 else 'them'}")


def check_weight_average(cfg: Config) -> None:
    """trainer.ema_decay averages whole models: not a LoRA run's adapters, nor float8's weights."""
    if cfg.trainer.ema_decay and cfg.finetune.method != "none":
        raise ConfigError(f"trainer.ema_decay averages every weight, and finetune={cfg.finetune.method} "
                          "trains adapters; set trainer.ema_decay=0")
    if cfg.trainer.ema_decay and not cfg.checkpoint.enabled:
        raise ConfigError("trainer.ema_decay's average is kept in checkpoints, and checkpoint.enabled=false "
                          "saves none; enable checkpoints or set trainer.ema_decay=0")
    if cfg.trainer.ema_warmup and not cfg.trainer.ema_decay:
        raise ConfigError("trainer.ema_warmup ramps the weights' average's decay, and trainer.ema_decay=0 "
                          "keeps none; set trainer.ema_decay (e.g. 0.999) or drop trainer.ema_warmup")
    if cfg.trainer.ema_decay and cfg.strategy.float8:
        raise ConfigError("trainer.ema_decay does not average float8 linears' weights yet; set "
                          "strategy.float8=false or trainer.ema_decay=0")


def check_float8_tokens(cfg: Config) -> None:
    """strategy.float8's weight gradients contract over a micro-batch's tokens, which CUDA's float8
    matmul (torch._scaled_mm) needs in multiples of 16 (torchao pads only the forward's inner size
    when asked, at a copy a matmul): the language model's micro-batch of trainer.seq_len tokens is
    checked here, before any process starts, rather than failing in the first backward on the GPU.
    A task's own batches are checked in the first forward given them (``distributed/float8.py``)."""
    t = cfg.trainer
    if not cfg.strategy.float8 or cfg.task.path != LANGUAGE_MODEL_TASK or t.seq_len % 16 == 0:
        return
    if t.micro_batch_size == "auto" or (t.micro_batch_size * t.seq_len) % 16:
        tokens = "the micro-batch size chosen" if t.micro_batch_size == "auto" else \
            f"trainer.micro_batch_size={t.micro_batch_size}"
        raise ConfigError(f"strategy.float8=true needs a micro-batch's tokens in multiples of 16 (its "
                          f"float8 weight gradients contract over them), and trainer.seq_len={t.seq_len} x "
                          f"{tokens} may not be; use a trainer.seq_len that is a multiple of 16")


def check_monitor(cfg: Config) -> None:
    """trainer.monitor, judged by checkpoint.keep_best and trainer.early_stop_patience: a validation
    value that the run logs."""
    t, c = cfg.trainer, cfg.checkpoint
    if not (c.keep_best or t.early_stop_patience):
        defaults = TrainerConfig()
        if changed := [f"trainer.{name}={getattr(t, name)}" for name in ("monitor", "monitor_mode",
                                                                           "early_stop_min_delta")
                       if getattr(t, name) != getattr(defaults, name)]:
            raise ConfigError(f"{', '.join(changed)} judges the evaluations for checkpoint.keep_best and "
                              "trainer.early_stop_patience, both 0; set one of them, or drop it")
        return
    if c.keep_best and not c.enabled:
        raise ConfigError("checkpoint.keep_best keeps checkpoints, and checkpoint.enabled=false saves "
                          "none; enable checkpoints or set checkpoint.keep_best=0")
    if t.early_stop_patience and not t.eval_every:
        raise ConfigError("trainer.early_stop_patience counts evaluations, and trainer.eval_every=0 "
                          "evaluates at the last step only; set trainer.eval_every=N")
    if not t.monitor.startswith(("val_", "ema_val_")):
        raise ConfigError(f"trainer.monitor={t.monitor!r} is no validation value: name val_loss, "
                          "ema_val_loss, or a task's metric as val_<name> (ema_val_<name>)")
    if t.monitor.startswith("ema_val_") and not t.ema_decay:
        raise ConfigError(f"trainer.monitor={t.monitor} judges the weights' average, which this run does "
                          f"not keep; set trainer.ema_decay (e.g. 0.999) or monitor {t.monitor[4:]}")


def check_profiling(cfg: Config) -> None:
    """A profiling window that can happen; the memory snapshot only with one."""
    d, max_steps = cfg.diagnostics, cfg.trainer.max_steps
    default = DiagnosticsConfig()
    if d.profile_steps != default.profile_steps and not d.profile_at:
        raise ConfigError(f"diagnostics.profile_steps={d.profile_steps} counts the steps traced from "
                          "diagnostics.profile_at, which is 0 (never); set diagnostics.profile_at=STEP too, "
                          "or drop profile_steps")
    if not d.enabled and not d.dry_run and d.steps != default.steps:  # a dry run measures its step
        raise ConfigError(f"diagnostics.steps={d.steps} measures the first steps' memory, and "
                          "diagnostics.enabled=false measures none; drop one of them")
    if negative := [rank for rank in d.profile_ranks if rank < 0]:
        raise ConfigError(f"diagnostics.profile_ranks holds {negative[0]}: ranks count from 0")
    if d.profile_ranks and not d.profile_at:
        raise ConfigError(f"diagnostics.profile_ranks={list(d.profile_ranks)} names the ranks that trace "
                          "from diagnostics.profile_at, which is 0 (never); set diagnostics.profile_at=STEP "
                          "too, or drop profile_ranks")
    if d.memory_snapshot and not d.profile_at:
        raise ConfigError("diagnostics.memory_snapshot=true records over the profiled steps; set "
                          "diagnostics.profile_at=STEP too")
    if d.dry_run and d.profile_at > 1:
        raise ConfigError(f"diagnostics.dry_run trains step 1 only, and diagnostics.profile_at="
                          f"{d.profile_at}: set diagnostics.profile_at=1 to trace it")
    if d.profile_at > max_steps:
        raise ConfigError(f"diagnostics.profile_at={d.profile_at} is after trainer.max_steps={max_steps}: "
                          "nothing would be traced; choose a step up to max_steps")


def check_qlora_combinations(cfg: Config) -> None:
    """What ``finetune.method=qlora``'s NF4 base does not combine with, in one line."""
    if cfg.finetune.method != "qlora":
        return
    not_with = {"strategy.float8=true (it converts the same linear layers)": cfg.strategy.float8,
                "strategy.compile=true (not tested with the NF4 base yet)": cfg.strategy.compile,
                "strategy.cpu_offload=true (not tested with the NF4 base yet)": cfg.strategy.cpu_offload,
                "finetune.base_dtype=bf16 (not tested with the NF4 base yet)":
                    cfg.finetune.base_dtype != "fp32",
                # FSDP2 cannot reshard a parameter that brings its own all-gather (NF4's) to a smaller
                # group: an AssertionError at the end of the first forward (found by review)
                "an integer strategy.reshard_after_forward (NF4 weights reshard to their whole group: "
                "true)":
                    type(reshard_setting(cfg.strategy.reshard_after_forward)) is int}
    for setting, asked in not_with.items():
        if asked:
            raise ConfigError(f"finetune.method=qlora does not combine with {setting}; use one or the other")


def check_config(cfg: Config) -> None:
    """Everything the config and the files it names can tell."""
    cfg.dist.debug = str(cfg.dist.debug).upper()
    check_strategy_names(cfg.strategy)  # first: what follows compares the canonical spellings
    check_ranges(cfg)
    # Before any process starts, and in `plan` (found by a review: refused inside the trainer, after
    # torchrun had started its workers, and planned without a word).
    check_qlora_combinations(cfg)
    devices_count(cfg.trainer.devices)
    check_batch_size(cfg)
    if cfg.data.source != "prepared" and (problem := val_percent_problem(cfg.data.val_percent)):
        # before any process starts (found by review: said by the data preparation, after a launch)
        raise ConfigError(f"data.val_percent={cfg.data.val_percent:g}: {problem}")
    if cfg.data.source == "stdlib" and cfg.data.paths:
        raise ConfigError(f"data.paths={list(cfg.data.paths)} is read with data.source=files or prepared; "
                          "add data=files (text, JSON Lines, Parquet) or data.source=prepared, or drop "
                          "data.paths")
    if cfg.data.source in ("files", "prepared"):
        for entry in cfg.data.paths:
            if not str(entry).strip():  # '' is the working directory to pathlib: all of it was read
                raise ConfigError(f"data.paths={list(cfg.data.paths)} holds an empty path; name files or "
                                  "directories")
            if not any(ch in entry for ch in "*?[") and not Path(entry).expanduser().exists():
                raise ConfigError(f"data path {entry!r} does not exist; fix data.paths")
    weights = cfg.data.weights
    if weights and (cfg.data.source != "prepared" or not mixture_weights_valid(weights, len(cfg.data.paths))):
        raise ConfigError(f"data.weights={list(weights)}: one positive, finite weight per prepared dataset "
                          f"in data.paths ({len(cfg.data.paths)} given), with data.source=prepared")
    if cfg.data.cache_dir != "auto" and Path(cfg.data.cache_dir).expanduser().is_file():
        raise ConfigError(f"data.cache_dir={cfg.data.cache_dir!r} is a file; name a directory (or auto)")
    if not cfg.strategy.wrap_policy:  # said before torch is imported, as the training's build says it
        raise ConfigError("strategy.wrap_policy=[] names no module class: nothing would be sharded per "
                          "block; use [auto] (the model's own blocks) or the classes to shard")
    check_model(cfg)
    check_finetune(cfg.finetune, cfg.strategy.mixed_precision)
    check_trackers(cfg.run.trackers)
    check_profiling(cfg)
    check_weight_average(cfg)
    check_float8_tokens(cfg)
    if cfg.checkpoint.save_full and cfg.finetune.method != "none":
        # It wrote PEFT's unmerged names (base_layer, lora_A), which nothing reads as a model, and
        # under QLoRA failed the first save on the NF4 tensors.
        raise ConfigError(f"checkpoint.save_full=true writes a whole model's weights, and finetune="
                          f"{cfg.finetune.method} trains adapters on a frozen base; drop it, and write the "
                          "merged model with shardtrain export-hf CKPT OUT --merge (or the adapters with "
                          "shardtrain export-peft)")
    check_monitor(cfg)
    for key, value in (("run.dir", cfg.run.dir), ("checkpoint.resume", cfg.checkpoint.resume),
                       ("data.cache_dir", cfg.data.cache_dir), ("model.tokenizer", cfg.model.tokenizer)):
        if not str(value).strip():  # '' is the working directory to pathlib, or '.' as a checkpoint
            raise ConfigError(f"{key} is empty; " + {
                "checkpoint.resume": "name a directory (or auto, or none)",
                "model.tokenizer": "name a tokenizer.json or its directory (or auto, or bytes)"}.get(
                    key, "name a directory"))
    if not cfg.checkpoint.enabled and cfg.checkpoint.resume not in ("auto", "none"):
        raise ConfigError(f"checkpoint.resume={cfg.checkpoint.resume} is not read with "
                          "checkpoint.enabled=false (the run would start afresh); enable checkpoints, or "
                          "start from its weights alone with model.init_from")
    if not cfg.checkpoint.enabled:
        check_nothing_expects_checkpoints(cfg)
    checkpoints = Path(cfg.run.dir).expanduser() / "checkpoints"
    if cfg.checkpoint.enabled and checkpoints.exists() and not checkpoints.is_dir():
        raise ConfigError(f"{checkpoints} is a file, where run.dir's checkpoints go; move it away or "
                          "choose another run.dir")
    for index, name in enumerate(cfg.checkpoint.preemption_signals):
        if not isinstance(getattr(signal, str(name), None), signal.Signals):
            raise ConfigError(f"checkpoint.preemption_signals: {name!r} is not a signal name like 'SIGTERM'")
        if name in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(
                f"checkpoint.preemption_signals: {name} cannot be caught; use SIGTERM or SIGUSR1"
            )
        if name not in PREEMPTION_SIGNALS:
            # The launcher's agent ignores these signals: an ignored SIGCHLD reaps the workers unread, a
            # failed run exiting 0 (found by review); a fault's (SIGSEGV) or a pipe's are no notice
            raise ConfigError(f"checkpoint.preemption_signals: {name} is not a notice a scheduler gives; "
                              f"choose among {', '.join(PREEMPTION_SIGNALS)}")
        if name in cfg.checkpoint.preemption_signals[:index]:
            raise ConfigError(f"checkpoint.preemption_signals: {name} is listed twice; name it once")
    check_checkpointing_every(cfg)
    if cfg.trainer.sample_every and cfg.trainer.sample_tokens == 0:
        # (found by review: every N steps a gathered copy was made for a sample of the prompt alone)
        raise ConfigError(f"trainer.sample_every={cfg.trainer.sample_every} samples trainer.sample_tokens "
                          "tokens, and trainer.sample_tokens=0 generates none; set trainer.sample_tokens "
                          "above 0, or drop trainer.sample_every")
