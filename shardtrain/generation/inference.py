"""Load a checkpoint for inference at any world size: a sharded DCP checkpoint (resharded to this
world) or a consolidated safetensors file (one process), with the model config it was trained with.
A ``finetune=lora`` or ``qlora`` checkpoint (adapters only) loads as its run ran: the base read
from its source (or drawn from the run's seed), checked to be the base the adapters were trained
on, quantised to NF4 under QLoRA, and the adapters on it; ``generate`` and ``eval`` then run the
base with its adapters."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardtrain.accelerator import set_fp32_matmul
from shardtrain.checkpoint import layout
from shardtrain.checkpoint.safetensors_files import eval_settings
from shardtrain.checkpoint.state import STATE_FILE, TrainState
from shardtrain.checkpoint.weights import (
    base_identity,
    check_same_base,
    data_config_of,
    eval_settings_of,
    load_adapters,
    load_model_weights,
    model_config_of,
    resolved_once,
    tokenizer_of,
)
from shardtrain.config.plan import DTYPES, resolve_plan
from shardtrain.config.schema import Config, ModelConfig
from shardtrain.data.batches import part_sample_counts
from shardtrain.data.corpus import Corpus
from shardtrain.data.tokenizer import Tokenizer, check_recorded_tokenizer, tokenizer_for
from shardtrain.distributed.agreement import run_agreed
from shardtrain.distributed.env import DistEnv, build_mesh, init_distributed, set_cpu_threads
from shardtrain.distributed.qlora import quantize_base
from shardtrain.distributed.sharded_model import (
    ModelFactory,
    build_sharded_model,
    deferred_initialization,
    with_adapters,
)
from shardtrain.errors import CheckpointError, DataError, TooFewTokens
from shardtrain.models.hf_directory import is_model_directory
from shardtrain.models.lora import held_targets, round_base_to
from shardtrain.models.registry import model_factory


@dataclass
class Loaded:
    cfg: Config
    env: DistEnv
    model: nn.Module  # sharded
    factory: ModelFactory  # builds the plain (unsharded) model, e.g. for gathered generation
    compute_dtype: torch.dtype
    data_known: bool = True  # cfg.data is the run's data (not for a file consolidated before it was kept)
    state: TrainState | None = None  # a checkpoint directory's
    path: Path | None = None  # what was loaded (a link resolved)

    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, from where the run named it, and the one a checkpoint directory
        records its text was read with."""
        tokenizer = tokenizer_for(self.cfg.model)
        if self.path is not None:  # a checkpoint directory, or a consolidated file
            check_recorded_tokenizer(tokenizer_of(self.path), tokenizer, str(self.path))
        return tokenizer

    def eval_settings(self) -> dict[str, int]:
        """The windows the run's evaluations scored (``seq_len``, ``eval_samples``) where the
        checkpoint records them (a Hugging Face directory does not): read for ``eval`` alone, so that
        damaged metadata does not stop ``generate``."""
        if self.state is not None:
            return eval_settings(self.state.config)
        return eval_settings_of(self.path) if self.path is not None and self.path.is_file() else {}


def check_processes_for(path: Path, processes: int) -> None:
    """A consolidated file is read whole by one process: refused for several (by the CLI before
    any of them starts)."""
    if Path(path).expanduser().is_file() and processes > 1:
        raise CheckpointError("a consolidated safetensors file is loaded by one process; use the "
                              "sharded checkpoint directory with --devices N, or --devices 1")


def load_for_inference(checkpoint: str | Path, strategy: str = "FULL_SHARD",
                       dtype: str = "auto", verify_checksums: bool = True, average: bool = False) -> Loaded:
    """``checkpoint``: a shardtrain checkpoint directory, a consolidated ``.safetensors`` file, or a
    Hugging Face model directory (``export-hf``'s output, or any local one).
    ``dtype``: the compute dtype, fp32 | bf16 | auto (bf16 on accelerators with bf16 units).
    ``verify_checksums``: a checkpoint directory's recorded checksums are checked before reading.
    ``average``: the checkpoint's weight average (trainer.ema_decay) instead of its weights."""
    defaults = Config()
    # The weights' read is bounded as training's is, by a save's bound: the first data-parallel
    # replica reads while the others wait in a collective (found by review: a model read for longer
    # than start-up's 600 s on slow storage ended there in the backend's timeout).
    env = init_distributed(defaults.dist.backend,
                           max(defaults.dist.startup_timeout_s, defaults.checkpoint.save_timeout_s))
    path = resolved_once(checkpoint)
    if not path.exists():
        raise layout.missing(Path(checkpoint), what="")
    state = TrainState.read(path) if (path / STATE_FILE).is_file() else None
    lora = state is not None and state.base_weights is not None
    if lora and average:  # trainer.ema_decay is refused with adapters: no run saved both
        raise layout.no_average(path)
    cfg = Config()
    hf_directory = state is None and path.is_dir() and is_model_directory(path)
    if hf_directory and average:
        raise CheckpointError(f"{str(path)!r} is a Hugging Face model directory, which holds one set of "
                              "weights: the weights' average (--ema) is read from a checkpoint directory")
    if lora:  # adapters only: the base is read (or drawn) as training did, the adapters on it
        cfg.model = state.model_config()
        held = [key.removeprefix("model.") for key in layout.read_dcp_metadata(path).state_dict_metadata
                if key.startswith("model.")]  # not the optimizer's state of them
        cfg.finetune = held_targets(state.finetune_config(), held)
        cfg.trainer = dataclasses.replace(cfg.trainer, seed=int(state.config["trainer"]["seed"]))
        check_same_base(path, state.base_weights, base_identity(cfg.model, cfg.trainer.seed, cfg.finetune),
                        use="load it with")
    elif hf_directory:  # its config.json says the model; its tokenizer is beside it
        cfg.model = ModelConfig(name="hf", path=str(path))
    else:
        cfg.model = dataclasses.replace(model_config_of(path), init_from=None)
    # `eval` scores the held-out split of the data the run trained with
    data = (None if hf_directory else
            state.data_config() if state is not None else data_config_of(path))
    if data is not None:
        cfg.data = data
    precision = {"fp32": "fp32", "bf16": "bf16-mixed"}.get(dtype, dtype)
    cfg.strategy = dataclasses.replace(cfg.strategy, sharding_strategy=strategy, mixed_precision=precision)
    set_cpu_threads(env, 0)
    set_fp32_matmul(env.device, tf32=dtype != "fp32")  # --dtype fp32 asks for full fp32
    check_processes_for(path, env.world_size)
    plan = resolve_plan(cfg.strategy, env.world_size, env.local_world_size)
    stored_base = DTYPES[cfg.finetune.base_dtype] if lora else torch.float32
    if stored_base != torch.float32 and plan.param_dtype == torch.float32:
        # An fp32 forward cannot read a bf16 weight: the base is held in fp32 with the values
        # training stored (rounded below).
        cfg.finetune = dataclasses.replace(cfg.finetune, base_dtype="fp32")
    factory = model_factory(cfg.model)
    with deferred_initialization() as draws:  # every weight is read from the checkpoint: no draw
        model, _ = build_sharded_model(cfg, env, plan, build_mesh(plan, env.device.type), factory)
    if lora:
        if source := cfg.model.weights_source():
            run_agreed(lambda: load_model_weights(model, source, cfg.model))
        draws.draw()  # a random base as training drew it (seeded), or nothing left to draw
        if stored_base != torch.float32:
            round_base_to(model, stored_base)
        if cfg.finetune.method == "qlora":  # the adapters learnt on the NF4 base, so they run on it
            quantize_base(model)
        load_adapters(model, path, verify_checksums)
    else:
        # Each rank reads and checks its own rows (a tied weight's two copies among them): what one
        # rank finds, every rank raises, none going on alone into the next collective.
        run_agreed(lambda: load_model_weights(model, str(path), cfg.model, verify_checksums=verify_checksums,
                                              average=average))
    return Loaded(cfg, env, model, with_adapters(factory, cfg, env.device), plan.param_dtype,
                  data_known=data is not None, state=state, path=path)


def data_changed_since(state: TrainState | None, corpus: Corpus) -> str | None:
    """Why the data ``eval`` reads as the run's (its recorded settings, read again) is not what the run
    trained on, where the training sample count differs from the checkpoint's; else None."""
    if state is None or state.train_samples is None:
        return None
    trainer, data = state.config.get("trainer", {}), state.config.get("data", {})
    try:
        windows = corpus.train_windows(trainer["seq_len"], data.get("document_mask", False),
                                       data.get("packing", "stream"), warn=False)
        found, parts = windows.num_samples, part_sample_counts(windows)
    except TooFewTokens:  # too little left for one training window: changed, and said so, not raised
        found, parts = 0, None
    except DataError as exc:  # a damaged training split: eval scores the held-out one, and says so
        return (f"the run's training data ({corpus.root}) cannot be read to check it is the run's "
                f"({str(exc).splitlines()[0]}); the held-out split is scored as it is")
    if found != state.train_samples:
        counts = f"{found} training samples, where the run trained on {state.train_samples}"
    elif None not in (parts, state.train_part_samples) and parts != state.train_part_samples:
        counts = (f"{parts} training samples of its datasets, where the run trained on "
                  f"{state.train_part_samples}")
    else:
        return None
    return (f"the run's data ({corpus.root}) now gives {counts}: its files changed since, or data.paths or "
            "the standard library resolve to others here, so the held-out split scored is not the run's; "
            "name the text to score with --file")
