"""What the launching process checks before any worker starts: every path a command will read or
write. A problem found here is one line and exit status 2, instead of every rank's traceback.
The checks that need no torch are in ``paths``, for the commands that check before importing it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from shardtrain.checkpoint import layout
from shardtrain.checkpoint.peft_adapter import resolve_adapter_settings
from shardtrain.checkpoint.run_lock import take_run_lock
from shardtrain.checkpoint.safetensors_files import file_metadata, weight_files
from shardtrain.checkpoint.state import STATE_FILE
from shardtrain.checkpoint.weights import HF_PREFIX, read_hf_config, source_path
from shardtrain.cli.paths import check_not_in_checkpoint, check_writable
from shardtrain.config.schema import Config
from shardtrain.data.corpus import cache_root
from shardtrain.data.documents import is_prepared_dataset
from shardtrain.data.prepared import open_prepared
from shardtrain.data.tokenizer import tokenizer_for
from shardtrain.distributed.preconditions import resolve_wrap_classes
from shardtrain.errors import CheckpointError, ConfigError
from shardtrain.models.hf_directory import is_model_directory
from shardtrain.models.llama import llama_dims
from shardtrain.models.llama_tp import check_sequence_split, check_tensor_parallel_dims
from shardtrain.tasks.language_model import LanguageModelTask
from shardtrain.tasks.task import run_wrap_policy, task_from_config
from shardtrain.train.trackers import (
    check_reachable,
    missing_package_error,
    missing_packages,
    mlflow_tracking_uri,
)


def check_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir={str(run_dir)!r} is a file; run.dir must be a directory")
    if run_dir.is_dir():
        check_not_checkpoints(run_dir)
        check_not_inputs(run_dir)
    # (found by review: a run inside another's step-2 was deleted with it by that run's keep_last)
    check_not_in_checkpoint(run_dir, "run.dir")
    check_writable(run_dir, "run.dir")
    try:  # made now, as training would: a path the permissions allow may still refuse (/proc, a quota)
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"run.dir={str(run_dir)!r} cannot be created ({exc.strerror or exc}); choose "
                          "another path") from exc


def check_not_checkpoints(run_dir: Path) -> None:
    """A checkpoint, or a run's checkpoints directory, named as run.dir (to go on from it): training
    would start afresh inside it."""
    if (run_dir / layout.METADATA_FILE).is_file() or (run_dir / STATE_FILE).is_file():
        raise ConfigError(f"run.dir={str(run_dir)!r} is a checkpoint; run.dir is the run's directory "
                          "(the one holding checkpoints/): name that one to go on from its newest "
                          "checkpoint, or set checkpoint.resume to this checkpoint with a new run.dir")
    if any(layout.STEP_DIR.match(entry.name) or layout.TMP_DIR.match(entry.name)
           for entry in run_dir.iterdir()):
        run = repr(str(run_dir.parent)) if run_dir.name == layout.CHECKPOINTS_DIR else "the one above"
        raise ConfigError(f"run.dir={str(run_dir)!r} is a run's checkpoints directory; name the run's "
                          f"directory, {run}, to go on from its newest checkpoint")


def check_not_inputs(run_dir: Path) -> None:
    """A prepared dataset or a model directory named as run.dir: the run's checkpoints, config and
    logs would go among its files (and preparing the dataset again replaces its directory)."""
    if is_prepared_dataset(run_dir):
        what = "a prepared dataset (shardtrain prepare's manifest.json and token shards)"
    elif is_model_directory(run_dir):
        what = "a model directory (its config.json)"
    else:
        return
    raise ConfigError(f"run.dir={str(run_dir)!r} is {what}; a run writes its checkpoints, config and logs "
                      "into run.dir: choose a directory of its own")


def check_resume(cfg: Config) -> None:
    choice = cfg.checkpoint.resume
    if not cfg.checkpoint.enabled:
        if not cfg.diagnostics.dry_run:  # a dry run changes no file of the run
            layout.refuse_checkpointless_start(Path(cfg.run.dir) / "checkpoints")
        return
    if choice == "auto":
        return
    if choice == "none":
        root = Path(cfg.run.dir) / "checkpoints"
        if layout.slurm_requeued() and layout.saved_by_same_resume(root, choice):
            return  # a requeued job going on from its own: the ranks decide, comparing the config
        layout.refuse_fresh_start(root)
    else:
        root = Path(cfg.run.dir) / "checkpoints"
        if layout.saved_by_same_resume(root, choice):
            # Perhaps a requeued job going on from its own later checkpoints (its choice may since
            # have been pruned): the ranks decide, comparing the config as asked for (TrainState.config_hash).
            return
        # The structure only: the ranks verify the checksums, split between them, hashing it once.
        path = Path(choice).expanduser()
        if not path.exists():
            spelled = choice.lower() in ("auto", "none")  # AUTO, None: the words, not a path
            raise CheckpointError(f"checkpoint.resume={choice!r} does not exist" + (
                f"; the choice is spelt in lower case: checkpoint.resume={choice.lower()}" if spelled else
                "; name a checkpoint directory (a run's checkpoints/step-N), auto or none"))
        layout.verify(path)
        layout.refuse_newer_checkpoints(root, path)


def check_init_from(source: str | None, model_name: str) -> None:
    if not source:
        return
    path = Path(source).expanduser()
    if is_model_directory(path) and model_name != "hf":
        raise CheckpointError(f"model.init_from={source!r} is a Hugging Face model directory: train it "
                              f"with model.name=hf model.path={source} (a Llama also imports into the "
                              f"built-in model with model.init_from={HF_PREFIX}{source})")
    if is_model_directory(path):  # model=hf reads any family's directory as it reads model.path
        weight_files(path)
        return
    if source.startswith(HF_PREFIX):  # a Llama imported into the built-in model
        directory = source_path(source)
        if not directory.is_dir():
            raise CheckpointError(f"model.init_from={source!r}: {str(directory)!r} is not a directory")
        read_hf_config(directory)
        weight_files(directory)
        return
    if path.suffix == ".safetensors":
        if not path.is_file():
            raise CheckpointError(f"model.init_from={source!r} does not exist")
        try:
            file_metadata(path)
        except Exception as exc:  # safetensors raises several types for a bad header
            raise CheckpointError(f"model.init_from={source!r} is not a readable safetensors file "
                                  f"({str(exc).splitlines()[0]})") from exc
        return
    if not path.exists():
        raise CheckpointError(f"model.init_from={source!r} does not exist")
    layout.verify(path, need_state=False)


def check_trackers(cfg: Config) -> None:
    """The trackers' packages are installed and an MLflow server answers (W&B's login is checked by
    its start on rank 0, which needs the library itself)."""
    for name, package in missing_packages(cfg.run.trackers):
        raise missing_package_error(name, package)
    if "mlflow" in cfg.run.trackers:
        check_reachable(mlflow_tracking_uri(cfg.run), cfg.run.tracker_timeout_s)


def check_model_splits(cfg: Config, task: LanguageModelTask) -> None:
    """The model's sizes split evenly at ``strategy.tensor_parallel`` (train before launch, and plan's
    formulas, which would otherwise give figures for a layout that cannot exist)."""
    if task.tensor_parallel_hook() is not None or task.model_factory is not None:
        # The task's own tensor-parallel plan (the model's is not used), or a model of its own, whose
        # sizes model.* do not give: its build checks the model it has (parallelize_llama, hf_tp).
        return
    if cfg.model.name == "llama":
        check_tensor_parallel_dims(llama_dims(cfg.model), cfg.strategy.tensor_parallel)
        if cfg.strategy.sequence_parallel:
            check_sequence_split(cfg.trainer.seq_len, cfg.strategy.tensor_parallel)
    elif cfg.model.name == "hf":
        from shardtrain.models.hf import check_tensor_parallel as check_hf_tensor_parallel  # transformers

        check_hf_tensor_parallel(cfg.model, cfg.strategy.tensor_parallel, cfg.strategy.sequence_parallel)


def check_wrap_policy(cfg: Config, task: LanguageModelTask) -> None:
    """A bare class name in the run's wrap policy names one of the model's own modules (a dotted path
    is imported by check_runtime): looked up in the model built on the meta device, before launch (a
    typo was found by every worker after the launch)."""
    policy = run_wrap_policy(task, cfg)
    if all(isinstance(entry, type) or entry == "auto" or "." in entry for entry in policy):
        return
    with torch.device("meta"):
        model = task.new_model(cfg.model)
    resolve_wrap_classes(model, policy)


def check_run_dir_free(cfg: Config) -> None:
    """No other training holds run.dir: said by the launching process, before any worker starts
    (each worker would refuse alone, and torchrun's report hide the reason)."""
    if not cfg.diagnostics.dry_run:
        take_run_lock(Path(cfg.run.dir)).release()


def check_training(cfg: Config) -> None:
    check_run_dir(Path(cfg.run.dir))
    check_run_dir_free(cfg)
    check_trackers(cfg)
    check_resume(cfg)
    check_init_from(cfg.model.init_from, cfg.model.name)
    resolve_adapter_settings(dataclasses.replace(cfg))  # model.adapter fits finetune (on a copy)
    # The task is a Task with what the contract requires; the model and data checks below are the
    # language model's.
    task = task_from_config(cfg)
    if not isinstance(task, LanguageModelTask):
        return
    if cfg.model.name == "llama" and cfg.trainer.sample_tokens >= cfg.model.max_seq_len:
        # The sample at the end of training (and every sample_every steps) needs a position for a
        # prompt token besides its new ones: refused before launch. The exact check, with the
        # prompt's tokens and a Hugging Face model's positions, is at start-up (check_sample_fits).
        raise ConfigError(f"trainer.sample_tokens={cfg.trainer.sample_tokens} leaves no room for the "
                          f"prompt in model.max_seq_len={cfg.model.max_seq_len} positions; lower "
                          "trainer.sample_tokens (0: no sample)")
    check_model_splits(cfg, task)
    check_wrap_policy(cfg, task)
    if cfg.model.weights_source() == cfg.model.path and cfg.model.path:
        weight_files(Path(cfg.model.path).expanduser())  # a Hugging Face model's own weights
    tokenizer = tokenizer_for(cfg.model)  # a missing or unreadable tokenizer fails here, before any worker
    if cfg.data.source == "prepared":
        for path in cfg.data.paths:
            open_prepared(path, tokenizer, warn=False)  # made with the model's tokenizer, and whole
    else:  # prepared into the cache at start-up: a cache that cannot be made is named now
        check_data_cache(cache_root(cfg.data))


def check_data_cache(root: Path) -> None:
    """The data cache ``root`` can be made and written (found by review: a cache under /proc failed
    in every worker with "[Errno 2] No such file or directory", exit 1, naming no setting)."""
    check_not_in_checkpoint(root, "data.cache_dir")
    check_writable(root, "data.cache_dir")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"data.cache_dir: {str(root)!r} cannot be created ({exc.strerror or exc}); set "
                          "data.cache_dir to a writable directory") from exc
