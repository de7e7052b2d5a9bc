"""``trainer_state.json``: the typed record of where a run stood when a checkpoint was saved.

Written once per checkpoint (by the checkpointer, on rank 0, just before the directory gets its
final name) and read through ``TrainState.read`` by everything else: resume, ``inspect``,
``consolidate``, generation and evaluation. A file that is missing, unreadable, of another format or
missing fields is a ``CheckpointError`` that names the file and the field. The file carries the
sha256 of its own fields (``sha256``; checksums.json, written before it, cannot cover it): a value
changed since the save (a flipped digit of the step reads as a valid number) is refused, and a
hand edit made on purpose deletes that line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import time
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from omegaconf import OmegaConf

from shardtrain.config.options import same_value
from shardtrain.config.plan import ShardingPlan, describe_mesh
from shardtrain.config.schema import LANGUAGE_MODEL_TASK, Config, DataConfig, FinetuneConfig, ModelConfig
from shardtrain.durable import written_durably
from shardtrain.errors import CheckpointError, CheckpointFromNewerVersion
from shardtrain.version import __version__

T = TypeVar("T")

# The field holding the sha256 of the file's other fields (not a TrainState field: its digest).
DIGEST_FIELD = "sha256"


def state_digest(raw: dict[str, Any]) -> str:
    """The sha256 of a trainer state's fields but its digest, as canonical JSON (sorted keys)."""
    body = {key: value for key, value in raw.items() if key != DIGEST_FIELD}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

STATE_FILE = "trainer_state.json"
# A committed checkpoint's directory, named by the step it holds.
STEP_DIR = re.compile(r"^step-(\d+)$")
FORMAT_FAMILY = "shardtrain-checkpoint-v"
# Fields added within a format are those an older reader may drop (TrainState.read does); a field
# that must not be ignored comes with a new format, which an older reader refuses.
FORMAT = f"{FORMAT_FAMILY}1"
# The settings that decide which sample sits at each position of the global order
# (data/batches.py): resumed with another value, the saved position points into another order.
DATA_ORDER_KEYS = ("trainer.seq_len", "trainer.seed", "data.source", "data.paths", "data.weights",
                   "model.tokenizer")
# Another task's data is its own: what it is comes from the task and its options.
TASK_DATA_KEYS = ("trainer.seed", "task.path", "task.options")
# ... and those that decide what is prepared from data.source=stdlib or files (a prepared dataset
# is read as it is).
PREPARING_KEYS = ("data.file_glob", "data.val_percent", "data.max_bytes", "data.text_field")
# The settings that shape the model's parameters (a task's are among its options).
MODEL_SHAPE_KEYS = tuple(f"model.{name}" for name in (
    "name", "path", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim",
    "ffn_multiple_of", "tie_embeddings"))
# Settings that fit any checkpoint of the model's shape but change what it computes.
MODEL_FUNCTION_KEYS = ("model.rope_theta", "model.norm_eps")
# ... and a LoRA run's adapters.
ADAPTER_SHAPE_KEYS = ("finetune.method", "finetune.rank", "finetune.targets")
# A LoRA run's adapter settings that fit any checkpoint of the same shape, but change what the
# adapters do (their scale alpha / rank, their dropout): a resume that changes them says so.
ADAPTER_SCALE_KEYS = ("finetune.alpha", "finetune.dropout")
# AdamW's settings besides the rate (which the schedule's warning covers): a resume keeps the
# optimizer's moments and takes these as configured now.
OPTIMIZER_SETTING_KEYS = ("trainer.weight_decay", "trainer.beta1", "trainer.beta2", "trainer.adam_eps")


def language_model_refusal(task_path: str | None, model_factory: str | None) -> str | None:
    """Why weights trained with this task (its path; None: recorded before tasks, the language
    model) and model factory are not the language model ``model.*`` builds, which generate, eval and
    export-hf serve: the rest of a sentence whose subject is the weights; None where they are."""
    if task_path not in (None, LANGUAGE_MODEL_TASK):
        return (f"was trained with task={task_path}; generate, eval and export-hf serve the language-model "
                "task only (shardtrain consolidate writes any task's weights to safetensors)")
    if model_factory is not None:
        # Its model.* are the defaults the run never used: the commands failed on keys that no
        # setting could make fit (found by a trial)
        return (f"holds a model built by {model_factory} (LanguageModelTask(model=...) in code), not "
                "from model.*; generate, eval and export-hf build models from model.* only: use the library "
                "with that model (shardtrain consolidate writes its weights to safetensors)")
    return None


@dataclass
class TrainState:
    step: int
    tokens_seen: int
    consumed_samples: int  # the global data position: samples of the global order already used
    global_batch: int
    scheduler: dict[str, Any]
    world_size: int
    strategy: str
    mesh_shape: list[int]
    mesh_dim_names: list[str]
    mixed_precision: str
    config: dict[str, Any]
    # The config as the run was asked for, without its launch shape and before start-up derived its
    # accumulation steps (and an auto micro-batch) from the world it found: a requeue of the same run
    # at another world size has the same one (config/compose.py run_identity_hash; checkpoint/layout.py
    # saved_by_same_resume).
    config_hash: str
    versions: dict[str, str]
    saved_at: str
    format: str = FORMAT
    # finetune=lora: the base weights the adapters belong to (checkpoint/weights.py base_identity);
    # the checkpoint holds the adapters and their optimizer state only.
    base_weights: dict[str, Any] | None = None
    # checkpoint.keep_best, trainer.early_stop_patience: the value judged, the best checkpoints' steps
    # and values so far (this one's among them when it ranked), the best evaluation and the
    # evaluations since it (checkpoint/best.py).
    best: dict[str, Any] | None = None
    # A preemption saved this step before the evaluation due at it: a resume runs it first.
    evaluation_due: bool = False
    # The training data's sample count, on which the global order depends: data changed since (files
    # edited or added under the same settings) is said at the resume.
    train_samples: int | None = None
    # A mixture's sample count of each dataset (its order depends on each: two datasets may change
    # with their sum unchanged); None for one dataset, or a checkpoint saved before 2026-11-30.
    train_part_samples: list[int] | None = None
    # data.packing as it resolved (data.packing=auto: records or stream by the data), for a resume
    # to name a change of it; None for a checkpoint saved before 2026-12-01.
    train_packing: str | None = None
    # The save wrote checksums.json (every save since 2026-11-29 records so): a copy without it is
    # incomplete, not an older checkpoint that never had one.
    checksums: bool = False
    # The name (a digest of its tokenizer.json, or "bytes") of the tokenizer the model's text was
    # read with (a task's text_tokenizer()): generate, eval and export-hf read the tokenizer from
    # where the run named it, and one edited or replaced since is refused there; None for a task
    # without one, or a checkpoint saved before 2026-12-03.
    tokenizer: str | None = None
    # The sums of the steps since the last train record ({"loss_sum", "count", "metrics": {name:
    # [sum, divisor]}}), which a resume's first record goes on from: the steps between a record and a
    # save were in no record after a crash's resume; None in a checkpoint saved before 2026-12-03.
    logged_since: dict[str, Any] | None = None

    @classmethod
    def capture(cls, cfg: Config, plan: ShardingPlan, *, requested_hash: str, step: int, tokens_seen: int,
                consumed_samples: int, global_batch: int, scheduler: dict[str, Any],
                world_size: int, base_weights: dict[str, Any] | None = None,
                best: dict[str, Any] | None = None, evaluation_due: bool = False,
                train_samples: int | None = None, train_part_samples: list[int] | None = None,
                train_packing: str | None = None, tokenizer: str | None = None,
                logged_since: dict[str, Any] | None = None) -> TrainState:
        return cls(
            step=step, tokens_seen=tokens_seen, consumed_samples=consumed_samples,
            global_batch=global_batch, scheduler=scheduler, world_size=world_size,
            strategy=plan.strategy, mesh_shape=list(plan.mesh_shape),
            mesh_dim_names=list(plan.mesh_dim_names), mixed_precision=plan.precision,
            config=OmegaConf.to_container(OmegaConf.structured(cfg)), config_hash=requested_hash,
            versions={"shardtrain": __version__, "torch": torch.__version__,
                      "python": platform.python_version(), "numpy": np.__version__},
            saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), base_weights=base_weights, best=best,
            evaluation_due=evaluation_due, train_samples=train_samples,
            train_part_samples=train_part_samples, train_packing=train_packing, checksums=True,
            tokenizer=tokenizer, logged_since=logged_since,
        )

    def best_steps(self) -> set[int]:
        """The steps of the best checkpoints this one's ranking names (checkpoint.keep_best)."""
        return {int(step) for step, _ in (self.best or {}).get("ranking", [])}

    @property
    def mesh(self) -> str:
        return describe_mesh(self.mesh_dim_names, self.mesh_shape)

    @property
    def task_path(self) -> str:
        """The ``task=`` the checkpoint was trained with (older checkpoints: the language model)."""
        return self.config.get("task", {}).get("path", LANGUAGE_MODEL_TASK)

    @property
    def model_factory(self) -> str | None:
        """The model factory a LanguageModelTask was given in code, if it was (``TaskConfig``)."""
        return self.config.get("task", {}).get("model_factory")

    @property
    def built_from_model_config(self) -> bool:
        """Whether its model is the language model that ``model.*`` builds (not another task's, nor
        one a factory given in code built)."""
        return self.task_path == LANGUAGE_MODEL_TASK and self.model_factory is None

    def model_config(self) -> ModelConfig:
        """The language model's config; a CheckpointError for another task's checkpoint, or one
        whose model a factory given in code built, which only that code can build."""
        if (refusal := language_model_refusal(self.task_path, self.model_factory)) is not None:
            raise CheckpointError(f"this checkpoint {refusal}")
        return self.rebuilt("model", ModelConfig)

    def data_config(self) -> DataConfig:
        return as_packed_then(self.rebuilt("data", DataConfig), self.config.get("data", {}))

    def finetune_config(self) -> FinetuneConfig:
        return self.rebuilt("finetune", FinetuneConfig)

    def setting_changes(self, cfg: Config, keys: tuple[str, ...]) -> list[str]:
        """The ``keys`` whose value in ``cfg`` differs from the saved run's, as "key old -> new"; a
        task's options one by one, as they are set (``task.hidden``). Keys an older checkpoint lacks
        are not compared."""
        now = OmegaConf.to_container(OmegaConf.structured(cfg))
        changes = []
        for key in keys:
            section, name = key.split(".")
            saved = self.config.get(section, {})
            if name not in saved or same_value(saved[name], now[section][name]):
                continue
            old, new = saved[name], now[section][name]
            if key == "task.options" and isinstance(old, dict) and isinstance(new, dict):
                changes += [f"task.{option} {old.get(option)!r} -> {new.get(option)!r}"
                            for option in sorted({*old, *new})
                            if not same_value(old.get(option), new.get(option))]
            else:
                changes.append(f"{key} {old!r} -> {new!r}")
        return changes

    def data_order_changes(self, cfg: Config, train_samples: int | None = None,
                           packing: str | None = None, part_samples: list[int] | None = None) -> list[str]:
        """``DATA_ORDER_KEYS`` whose value in ``cfg`` differs from the saved run's, as "key old -> new",
        the windows' packing (``packing``: data.packing as it resolved now) where the saved run's
        resolved otherwise, and the training data's sample count (``train_samples``, now; a mixture's
        of each dataset, ``part_samples``) where it differs from the saved."""
        if cfg.task.path != LANGUAGE_MODEL_TASK:
            keys = TASK_DATA_KEYS  # a task's data is its own: its options may change it
        else:
            keys = DATA_ORDER_KEYS + (PREPARING_KEYS if cfg.data.source != "prepared" else ())
        changes = self.setting_changes(cfg, keys)
        # Compared as resolved (auto -> records is no change for fine-tuning data); a run saved before
        # data.packing existed cut every dataset as a stream; auto as it resolved then, where recorded
        # (found by a trial: auto -> records on plain text was "the data changed since the save").
        saved = self.config.get("data", {}).get("packing", "stream")
        if saved == "auto":
            saved = self.train_packing or "auto"
        if packing is not None and saved != "auto" and saved != packing:
            older = "" if "packing" in self.config.get("data", {}) else (
                "; runs saved before data.packing cut a stream: set data.packing=stream to go on as it "
                "trained")
            changes.append(f"data.packing {saved} -> {packing} (windows of "
                           f"{'whole records' if packing == 'records' else 'the token stream'} now{older})")
        # A changed setting (the windows' length, the data's paths) explains a count; else the files
        # themselves changed under the same settings.
        counting = [change for change in changes if not change.startswith("trainer.seed ")]
        why = "from the settings above" if counting else "the data changed since the save"
        if None not in (self.train_samples, train_samples) and self.train_samples != train_samples:
            changes.append(f"training samples {self.train_samples} -> {train_samples} ({why})")
        elif (None not in (self.train_part_samples, part_samples)
              and self.train_part_samples != part_samples):
            changes.append(f"training samples of each dataset {self.train_part_samples} -> {part_samples} "
                           f"({why})")
        return changes

    def model_changes(self, cfg: Config) -> str:
        """What a checkpoint that does not fit the model was saved with, where this run differs:
        the model's config and the task's options (either may shape the model)."""
        changes = self.setting_changes(cfg, (*MODEL_SHAPE_KEYS, *ADAPTER_SHAPE_KEYS, "task.options"))
        return f"; it was saved with other settings: {', '.join(changes)}" if changes else ""

    def write(self, directory: Path) -> None:
        """Durably: the file is fsynced before the checkpoint directory is renamed into place."""
        self.write_file(directory / STATE_FILE)

    def write_file(self, path: Path) -> None:
        fields = json.loads(json.dumps(dataclasses.asdict(self)))  # as read back: int keys as strings
        with written_durably(path, "w") as f:
            json.dump({**fields, DIGEST_FIELD: state_digest(fields)}, f, indent=2, sort_keys=True)
            f.write("\n")

    def replace_in(self, directory: Path) -> None:
        """Into a committed checkpoint, whole or not at all: written beside the directory (no file
        the checkpoint's listing would meet if this stopped half-way), then renamed over the old one.
        The manifest does not cover this file."""
        part = directory.parent / f".{directory.name}.{STATE_FILE}.part"
        self.write_file(part)
        os.replace(part, directory / STATE_FILE)

    @classmethod
    def read(cls, directory: Path) -> TrainState:
        file = directory / STATE_FILE
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint {str(directory)!r} has no {STATE_FILE}: it is not a complete shardtrain "
                "checkpoint (model.init_from accepts plain DCP directories)"
            )
        try:
            raw = json.loads(file.read_bytes())  # an OSError is the filesystem's, not damage: raised
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(
                f"checkpoint {str(directory)!r}: {STATE_FILE} is unreadable ({exc}); the file is damaged, "
                "use another checkpoint"
            ) from exc
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        if isinstance(found, str) and found.startswith(FORMAT_FAMILY) and found != FORMAT:
            versions = raw.get("versions") if isinstance(raw.get("versions"), dict) else {}
            saved_by = versions.get("shardtrain", "of a newer version")
            raise CheckpointFromNewerVersion(
                f"checkpoint {str(directory)!r} is in format {found!r}, written by shardtrain {saved_by}; "
                f"this one ({__version__}) reads {FORMAT!r}: resume it with the version that saved it")
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {str(directory)!r}: unknown format {found!r} in {STATE_FILE}")
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(raw))
        if missing:
            raise CheckpointError(f"checkpoint {str(directory)!r}: {STATE_FILE} lacks {missing}; the file "
                                  "is damaged, use another checkpoint")
        # A wrong type would otherwise surface far from here, as a traceback inside the resume.
        hints = typing.get_type_hints(cls)
        for name in sorted(names & set(raw)):
            if not has_type(raw[name], hints[name]):
                raise CheckpointError(
                    f"checkpoint {str(directory)!r}: {STATE_FILE} field {name!r} is "
                    f"{json.dumps(raw[name])[:60]}, not of type {type_name(hints[name])}; the file is "
                    "damaged, use another checkpoint")
        # A count below its least would surface far from here too (numpy's overflow on a negative
        # sample count, a division by a world size of 0).
        least = {"step": 0, "tokens_seen": 0, "consumed_samples": 0, "global_batch": 1, "world_size": 1}
        for name, low in least.items():
            if name in raw and raw[name] < low:
                raise CheckpointError(f"checkpoint {str(directory)!r}: {STATE_FILE} field {name!r} is "
                                      f"{raw[name]}, less than {low}; the file is damaged, use another "
                                      "checkpoint")
        if raw.get("best") is not None and not well_formed_best(raw["best"]):
            raise CheckpointError(f"checkpoint {str(directory)!r}: {STATE_FILE} field 'best' is "
                                  f"{json.dumps(raw['best'])[:80]}, not a record of the best evaluations; "
                                  "the file is damaged, use another checkpoint")
        if "mesh_shape" in raw and any(size < 1 for size in raw["mesh_shape"]):
            raise CheckpointError(f"checkpoint {str(directory)!r}: {STATE_FILE} field 'mesh_shape' is "
                                  f"{raw['mesh_shape']}; the file is damaged, use another checkpoint")
        named = STEP_DIR.match(directory.name)
        if named and int(named.group(1)) != raw["step"]:
            # Trusted by its name, it was resumed at the wrong step, then collided with the save of
            # the step it is named after at every restart (found by a trial).
            raise CheckpointError(f"checkpoint {str(directory)!r} holds step {raw['step']} (its "
                                  f"{STATE_FILE}), not step {named.group(1)} as its name says: copied or "
                                  "renamed by hand; "
                                  f"name it step-{raw['step']}, or use another checkpoint")
        check_saved_config(directory, raw["config"])
        # Last: a damaged field whose value has the wrong type or range is named above. Files saved
        # before 2026-11-30 have no digest.
        if DIGEST_FIELD in raw and raw[DIGEST_FIELD] != state_digest(raw):
            raise CheckpointError(f"checkpoint {str(directory)!r}: {STATE_FILE} changed since its save "
                                  f"(the sha256 of its fields differs from its {DIGEST_FIELD!r}): damaged, "
                                  "or edited by hand; use another checkpoint, or for an edit made on "
                                  f"purpose delete its {DIGEST_FIELD!r} line")
        return cls(**{k: v for k, v in raw.items() if k in names})

    def rebuilt(self, section: str, schema: type[T]) -> T:
        """The saved config's ``section`` as ``schema`` (``rebuild_config``). Checked where a reader
        needs the dataclass, not when the file is read: a resume compares settings key by key."""
        return rebuild_config(schema, self.config.get(section, {}), section,
                              f"shardtrain {self.versions.get('shardtrain', 'unknown')}")


def rebuild_config(schema: type[T], saved: dict[str, Any], section: str, saved_by: str) -> T:
    """A saved config section as ``schema``; settings this shardtrain does not know (a newer one
    saved them) are one line naming them and who saved them, not a TypeError."""
    unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(schema)})
    if unknown:
        names = ", ".join(f"{section}.{name}" for name in unknown)
        raise CheckpointError(f"saved settings shardtrain {__version__} does not know ({names}), written "
                              f"by {saved_by}: read them with that version")
    return schema(**saved)


def check_saved_config(directory: Path, config: dict[str, Any]) -> None:
    """A CheckpointError, rather than a traceback far from here (on one rank of a resume: the others
    waiting in its agreement), where the saved config is not the shape this shardtrain reads: a
    section missing or not a mapping."""
    where = f"checkpoint {str(directory)!r}: {STATE_FILE}"
    for section in (f.name for f in dataclasses.fields(Config)):
        required = section in ("model", "data", "trainer")
        if (required or section in config) and not isinstance(config.get(section), dict):
            found = json.dumps(config.get(section))[:60] if section in config else "missing"
            raise CheckpointError(f"{where}: its config's {section!r} section is {found}, not a mapping; "
                                  "the file is damaged, use another checkpoint")
    if not isinstance(config.get("task", {}).get("path", LANGUAGE_MODEL_TASK), str):
        raise CheckpointError(f"{where}: its config's task.path is not a string; the file is damaged, "
                              "use another checkpoint")


def as_packed_then(data: DataConfig, saved: dict[str, Any]) -> DataConfig:
    """A saved data config (``saved``, rebuilt as ``data``) with the packing its run used: one saved
    before data.packing existed cut every dataset as a stream (the key's default, auto, would not)."""
    return data if "packing" in saved else dataclasses.replace(data, packing="stream")


def well_formed_best(best: dict[str, Any]) -> bool:
    """checkpoint/best.py's record: the value judged, min or max, [step, value] pairs ranked, the
    best [step, value] (or null), a count of evaluations and the step of an early stop (or null)."""
    def pair(entry: Any) -> bool:
        return (isinstance(entry, list) and len(entry) == 2 and has_type(entry[0], int)
                and isinstance(entry[1], (int, float)) and not isinstance(entry[1], bool))

    ranking = best.get("ranking")
    return (isinstance(best.get("monitor"), str) and best.get("mode") in ("min", "max")
            and isinstance(ranking, list) and all(pair(entry) for entry in ranking)
            and (best.get("best") is None or pair(best["best"]))
            and has_type(best.get("stale", 0), int) and best.get("stale", 0) >= 0
            and has_type(best.get("stopped_at"), int | None) and has_type(best.get("evaluated"), int | None)
            and has_type(best.get("validation"), dict[str, Any] | None))


def has_type(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's annotation (int, str, list[int], dict[str, Any], X | None)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (types.UnionType, typing.Union):
        return any(has_type(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if hint is int:  # JSON's true/false load as bools, which Python counts as ints
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(has_type(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(has_type(item, args[1]) for item in value.values())
    return isinstance(value, hint)


def type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
