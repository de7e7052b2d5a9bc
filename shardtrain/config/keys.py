"""What a ``key=value`` override may name: the schema's keys and the presets' groups, with their
aliases; an override naming anything else is a ConfigError suggesting the closest valid name.

The first check the command line makes, so a misspelt key is answered before anything heavier than
the schema is imported (hydra, then torch).
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

from shardtrain.config.schema import Config
from shardtrain.config.suggest import closest
from shardtrain.errors import ConfigError

PRESETS_DIR = Path(__file__).parent / "presets"
GROUPS = ("model", "strategy", "data", "experiment")
# Names that cannot be dataclass fields (Python keywords) -> their schema field.
ALIASES = {"checkpoint.async": "checkpoint.async_save"}
# The spellings OmegaConf reads as a boolean; it also reads any other integer as true (compile=2),
# which is more likely a value meant for another key than a yes.
BOOLEAN_WORDS = ("true", "false", "yes", "no", "y", "n", "on", "off", "1", "0")
# Keys that were replaced -> what to write instead (a one-line error: the new key's values differ).
REPLACED = {"run.tensorboard": "run.tensorboard was replaced by run.trackers, a list of trackers: "
                               "run.trackers=[] for none, run.trackers=[tensorboard,wandb,mlflow] for more"}


# Other frameworks' names for a key's last part (Hugging Face Trainer's, PEFT's, Lightning's), which
# spelling alone does not lead to (learning_rate is closer to min_lr_ratio than to lr).
OTHER_NAMES = {
    "learning_rate": "lr", "warmup": "warmup_steps", "num_warmup_steps": "warmup_steps",
    "every": "interval", "save_every": "interval", "save_steps": "interval", "save_interval": "interval",
    "r": "rank", "lora_r": "rank", "lora_rank": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout",
    "target_modules": "targets", "batch_size": "micro_batch_size",
    "per_device_train_batch_size": "micro_batch_size", "gradient_accumulation_steps": "grad_accum_steps",
    "max_grad_norm": "grad_clip_norm", "gradient_clip_val": "grad_clip_norm", "output_dir": "dir",
    # transformers' config.json names of the built-in model's shape (found by a review: hidden_size
    # was "did you mean model.ffn_hidden_dim")
    "hidden_size": "dim", "intermediate_size": "ffn_hidden_dim", "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
    "max_position_embeddings": "max_seq_len", "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
}


def key_hint(key: str, keys: list[str]) -> str:
    """``"; did you mean 'x'?"`` for an unknown ``key``: a key of the same last part (or another
    framework's name for it) in the same section, or the only one anywhere (lora.rank,
    trainer.keep_last); else the closest spelling among the section's keys, then among all."""
    section, _, typed = key.rpartition(".")
    name = OTHER_NAMES.get(typed, typed)
    same_name = [k for k in keys if k.rpartition(".")[2] == name]
    in_section = [k for k in same_name if k.rpartition(".")[0] == section]
    # Another section's key for a section that does not exist, or for the very name typed
    # (trainer.keep_last is checkpoint.keep_last, which the section's closest spelling, trainer.seed,
    # is not: found by a trial); not for another framework's name in a known section (trainer.every
    # is not checkpoint.interval: eval_every and log_every are nearer in meaning).
    known_section = any(k.startswith(f"{section}.") for k in keys)
    # ... unless the section has a key the typed name is a part of (trainer.steps is
    # trainer.max_steps, not diagnostics.steps; data.dir is data.cache_dir, not run.dir: review)
    holding = [k for k in keys if k.rpartition(".")[0] == section
               and f"_{typed}_" in f"_{k.rpartition('.')[2]}_"]
    if in_section or holding or (len(same_name) == 1 and (not known_section or name == typed)):
        return f"; did you mean {(in_section or holding or same_name)[0]!r}?"
    # The last parts compared, not the whole keys, whose shared section made any two alike
    # (strategy.ac was "strategy.float8", trainer.epochs "trainer.devices": found by a review);
    # nothing below the cutoff.
    by_name = {k.rpartition(".")[2]: k for k in keys if section and k.rpartition(".")[0] == section}
    if by_name:
        match = difflib.get_close_matches(name, by_name, n=1, cutoff=0.6)
        return f"; did you mean {by_name[match[0]]!r}?" if match else ""
    return closest(key, keys)


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
    if bare == "task.options" and sep:
        # Hydra's own refusal was two lines, advising a +task.options the overrides refuse (review)
        raise ConfigError(f"{override}: a task's options are set one at a time, as task.NAME=VALUE "
                          "(task.depth=4)")
    if bare == "task.model_factory" and sep:
        # Rewritten as an option, it was refused as one the task does not take (found by review)
        raise ConfigError(f"{override}: task.model_factory is recorded, not set: it names the model factory "
                          "a LanguageModelTask(model=...) was given in code; pass model=... to "
                          "LanguageModelTask in your script (examples/custom_model.py), or set model.* "
                          "for the built-in model")
    if bare.startswith("task.") and bare not in ("task.path", "task.options") and sep:
        return f"++task.options.{bare.removeprefix('task.').removeprefix('options.')}={value}"
    return override


def finetune_override(override: str) -> str:
    """``finetune=lora`` is short for ``finetune.method=lora``."""
    key, sep, value = override.partition("=")
    if key.lstrip("+~") == "finetune" and sep:
        return f"finetune.method={value}"
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
    if override.startswith("~"):  # Hydra's deletion: its answer was two lines, or a false one
        key = override.lstrip("~").split("=", 1)[0]
        raise ConfigError(f"{override}: the config's keys cannot be removed; set one instead ({key}=VALUE)")
    if "=" not in override:
        raise ConfigError(
            f"argument {override!r} is not a key=value override (example: trainer.max_steps=100)"
        )
    key = override.split("=", 1)[0].lstrip("+~")
    value = override.split("=", 1)[1]
    if key in GROUPS:
        if override.startswith("+"):  # Hydra's answer named its defaults-list syntax, twice
            raise ConfigError(f"{override}: {key} is a preset group every config has (its defaults "
                              f"list names it), so there is nothing to add; write {override.lstrip('+')}")
        options = group_options(key)
        if value == "null" and key != "experiment":
            raise ConfigError(f"{key}=null: a run needs a {key} preset; available in {key}/: "
                              f"{', '.join(options)}")
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
        raise ConfigError(f"unknown config key {key!r}{key_hint(key, list(keys) + list(GROUPS))}")
    if override.startswith("+") and not override.startswith("++") and key in keys:
        # Hydra's answer to adding a key the config has: six lines, twice
        raise ConfigError(f"{override}: {key} is a key every config has, so there is nothing to add; write "
                          f"{override.lstrip('+')}")
    if key in keys and keys[key].type in ("bool", bool) and not boolean_spelling(value):
        raise ConfigError(f"{key}={value!r} is not a boolean: write {key}=true or {key}=false")


def boolean_spelling(value: str) -> bool:
    """Whether an override's value reads as a boolean: a word of ``BOOLEAN_WORDS``, quoted or not,
    or an interpolation (``${...}``, resolved later)."""
    bare = value.strip()
    if len(bare) >= 2 and bare[0] == bare[-1] and bare[0] in "'\"":
        bare = bare[1:-1].strip()
    return bare.lower() in BOOLEAN_WORDS or bare.startswith("${")


def check_overrides(overrides: list[str] | tuple[str, ...]) -> list[str]:
    """The overrides in the schema's spelling (aliases, task options), each naming a key or preset."""
    spelled = [finetune_override(task_override(apply_aliases(o))) for o in overrides]
    for override in spelled:
        check_override(override)
    # experiment=null is the default (no experiment preset): said again, nothing to override (Hydra
    # refused a null group override with a traceback); after an experiment=X it takes that one back,
    # as any later override wins (found by review: X stayed).
    kept = []
    for override in spelled:
        if override.lstrip("+") == "experiment=null":
            kept = [o for o in kept if not o.lstrip("+").startswith("experiment=")]
        else:
            kept.append(as_text(override))
    return kept


TEXT_TYPES = ("str", "str | None")
KEPT_AS_TYPED = ("trainer.sample_prompt",)  # its spaces are the prompt's


def as_text(override: str) -> str:
    """A text key's value kept as written: Hydra reads ``run.name=1e-3`` as a number, whose text is
    then ``0.001`` (``run.dir=1e3`` made a directory ``1000.0``; ``true``, ``1_000`` alike: found by
    review), so a plain value of a text key is quoted; null, a quoted value, a list or a dictionary
    (refused as such), one with an interpolation, a quote or a backslash are left to Hydra."""
    key, sep, value = override.partition("=")
    field = schema_keys().get(key.lstrip("+"))
    # Hydra strips the spaces around a plain value (a run.dir ending in one made such a directory);
    # a prompt keeps them as written
    value = value if key.lstrip("+") in KEPT_AS_TYPED else value.strip()
    if (not sep or field is None or field.type not in TEXT_TYPES or value.lower() in ("", "null")
            or "${" in value or "'" in value or "\\" in value or value[0] in "[{"
            or (len(value) >= 2 and value[0] == value[-1] == '"')):
        return override
    return f"{key}='{value}'"
