"""``model.adapter=DIR``: a run's LoRA adapters start from a PEFT adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``, as ``save_pretrained`` or ``shardtrain
export-peft`` write it).

``resolve_adapter_settings`` makes ``cfg.finetune`` the adapter's: its rank and alpha where the
finetune config leaves them at their defaults (a value set to something else is a conflict, one
line), and, where ``finetune.targets`` is empty, exactly the modules the adapter's weights are on.
``load_peft_adapter`` then reads its weights into the adapters (after the base and the adapters'
draw): PEFT's keys (``base_model.model.<module>.lora_A.weight``) map to ours as ``export-peft`` maps
ours to them, backwards (the built-in Llama's q/k ``lora_B`` rows take the inverse rotary
permutation); every adapter of the model must be in the file and every tensor of the file used.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from torch import nn

from shardtrain.checkpoint import layout
from shardtrain.checkpoint.safetensors_files import ADAPTER_CONFIG, open_safetensors
from shardtrain.checkpoint.state import TrainState
from shardtrain.config.compose import check_ranges
from shardtrain.config.schema import Config, FinetuneConfig
from shardtrain.distributed.sharded_model import shard_like
from shardtrain.errors import CheckpointError, ConfigError, json_object
from shardtrain.models.hf_directory import PREFIX as HF_PARAMETER_PREFIX
from shardtrain.models.llama_hf_adapter import from_hf_name, halves_to_interleaved, rotary_heads
from shardtrain.models.lora import ADAPTER_NAME, is_adapter, peft_package

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModelForCausalLM -> LoraModel -> the transformers model
# <module>.lora_A.weight (save_pretrained drops the adapter's name) or <module>.lora_A.<name>.weight
PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_[AB])(?:\.[^.]+)?\.weight$")
# LoraConfig fields that leave the adapters computing plain LoRA's B @ A x alpha/r: the shape,
# provenance, initialisation (the weights are read), and which modules hold them (read from the
# weights). Every other field must keep the installed PEFT's default (DoRA, rsLoRA, aLoRA's invocation
# tokens, a LoRA bias, per-module ranks, QA-LoRA, ...), or be absent or empty where this PEFT does not
# know it: such an adapter computes something else on the same weights (aLoRA's logits 0.3-0.5 off).
LAYOUT_AND_PROVENANCE = {
    "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "layers_to_transform",
    "layers_pattern", "task_type", "base_model_name_or_path", "revision", "peft_type", "peft_version",
    "inference_mode", "auto_mapping", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    "megatron_config", "megatron_core", "runtime_config", "qalora_group_size"}
# Initialisations that draw the adapters alone. PiSSA, OLoRA, CorDA, LoRA-GA and LoftQ change the base
# weights too: an adapter saved without converting it is read by PEFT onto that changed base (found by
# review: read as plain LoRA onto the original base, a layer's output 6% off).
ADAPTERS_ONLY_INIT = ("gaussian", "eva", "orthogonal")  # and true / false (PEFT's default draw, zeros)


def read_adapter_config(directory: Path) -> dict:
    """``adapter_config.json`` of a plain LoRA adapter; a ConfigError naming what does not fit."""
    file = directory / ADAPTER_CONFIG
    if not file.is_file() or not (directory / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"model.adapter={str(directory)!r} is not a PEFT adapter directory (it needs "
                          f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}, as save_pretrained writes them)")
    config = json_object(file, ConfigError, "save the adapter again with save_pretrained")
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"model.adapter={str(directory)!r} is a {config.get('peft_type')} adapter; "
                          "finetune=lora starts from LoRA adapters only")
    init = config.get("init_lora_weights", True)
    if not (isinstance(init, bool) or init in ADAPTERS_ONLY_INIT):
        raise ConfigError(f"model.adapter={str(directory)!r} was initialised with init_lora_weights="
                          f"{init!r}, which changes the base weights as well: convert it to a plain "
                          "LoRA adapter (save_pretrained with path_initial_model_for_weight_conversion)")
    plain = peft_package().LoraConfig().to_dict()
    for key, value in config.items():
        if key == "init_lora_weights":
            continue
        if key in LAYOUT_AND_PROVENANCE or value in (None, False, [], {}):
            continue
        if key in plain and value == plain[key]:
            continue
        default = f"{key}={plain[key]!r}" if key in plain else f"no {key}"
        raise ConfigError(f"model.adapter={str(directory)!r} sets {key}={value!r}: only plain LoRA "
                          f"({default}) is supported")
    for key in ("r", "lora_alpha", "lora_dropout"):
        if key == "lora_dropout" and key not in config:  # older PEFTs' files: the run's finetune.dropout
            continue
        if not isinstance(config.get(key), (int, float)) or isinstance(config.get(key), bool):
            raise ConfigError(f"{file} has no number {key} (it has {config.get(key)!r}); save the adapter "
                              "again with save_pretrained")
    return config


def adapter_modules_of(directory: Path, cfg: Config) -> list[str]:
    """Our names of the modules the adapter's weights are on."""
    with open_safetensors(directory / ADAPTER_WEIGHTS) as f:
        return sorted({our_name(key, cfg)[0] for key in f.keys()})


def adapter_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of a PEFT adapter's weight file (a damaged file: one line naming it)."""
    with open_safetensors(directory / ADAPTER_WEIGHTS) as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def our_name(key: str, cfg: Config) -> tuple[str, str]:
    """A PEFT adapter key -> (our module name, lora_A | lora_B)."""
    match = PEFT_KEY.match(key)
    if match is None:
        raise CheckpointError(f"model.adapter: {key!r} is not a LoRA weight (<module>.lora_A.weight)")
    module, matrix = match.groups()
    if cfg.model.name == "hf":
        return HF_PARAMETER_PREFIX + module, matrix
    ours = from_hf_name(module + ".weight")
    if ours is None:
        raise CheckpointError(f"model.adapter: {module!r} is no module of the built-in Llama "
                              "(its adapters are on transformers' Llama names, as export-peft writes them)")
    return ours.removesuffix(".weight"), matrix


def resolve_adapter_settings(cfg: Config) -> list[str]:
    """Make ``cfg.finetune`` the adapter's (see the module's doc); return what it set, one line each."""
    if not cfg.model.adapter:
        return []
    directory = Path(cfg.model.adapter).expanduser()
    if cfg.finetune.method != "lora":
        raise ConfigError(f"model.adapter={str(directory)!r} starts LoRA adapters: it needs finetune=lora")
    if not directory.exists() and (saved := resumed_finetune(cfg)) is not None:
        # A resume reads its adapters from the checkpoint: a requeued job whose adapter directory
        # was cleaned up since its start could not resume (found by a review). What the command line
        # sets stays, as on a resume without model.adapter (its changes said or refused there); the
        # rest is the checkpoint's (found by review: an explicit finetune.alpha was dropped unsaid)
        defaults = FinetuneConfig()
        cfg.finetune = dataclasses.replace(cfg.finetune, **{
            field: list(getattr(saved, field)) if field == "targets" else getattr(saved, field)
            for field in ("rank", "alpha", "dropout", "targets")
            if getattr(cfg.finetune, field) == getattr(defaults, field)})
        return [f"model.adapter={str(directory)!r} no longer exists: the adapters' shape is the checkpoint's "
                "this run resumes"]
    config = read_adapter_config(directory)
    defaults, notes = FinetuneConfig(), []
    changes = {}
    # lora_dropout too: PEFT's trainable model applies the adapter's (found by the docs review: the
    # run's 0.0 trained without it)
    for field, key in (("rank", "r"), ("alpha", "lora_alpha"), ("dropout", "lora_dropout")):
        if key not in config:  # an adapter_config.json of an older PEFT may lack lora_dropout
            continue
        theirs, ours = config[key], getattr(cfg.finetune, field)
        if ours == theirs:
            continue
        if ours != getattr(defaults, field):
            raise ConfigError(f"model.adapter={str(directory)!r} has {key}={theirs:g} but "
                              f"finetune.{field}={ours:g}: drop finetune.{field} (the adapter sets it) or "
                              "use an adapter of that shape")
        changes[field] = type(ours)(theirs)
        notes.append(f"finetune.{field}={theirs:g} (from model.adapter)")
    if not cfg.finetune.targets:
        changes["targets"] = adapter_modules_of(directory, cfg)
        notes.append(f"finetune.targets: the {len(changes['targets'])} modules model.adapter's weights "
                     "are on")
    adapted = dataclasses.replace(cfg.finetune, **changes)
    try:  # an adapter_config.json's values against the settings' bounds (lora_alpha 0, a dropout of 1)
        check_ranges(adapted, FinetuneConfig, "finetune.")
    except ConfigError as exc:
        raise ConfigError(f"model.adapter={str(directory)!r}: {exc} (as its {ADAPTER_CONFIG} sets it); use "
                          "an adapter within the settings' bounds") from exc
    cfg.finetune = adapted
    return notes


def resumed_finetune(cfg: Config) -> FinetuneConfig | None:
    """The LoRA settings of the checkpoint this start resumes (``checkpoint.resume``: auto's newest
    readable one in run.dir, or the one named), None for a fresh start."""
    resume = cfg.checkpoint.resume
    if not cfg.checkpoint.enabled or resume == "none":
        return None
    if resume != "auto":
        found = [Path(resume).expanduser()]
    else:  # newest first, as resume=auto tries them
        complete = layout.candidates(Path(cfg.run.dir) / layout.CHECKPOINTS_DIR).complete
        found = [path for _, path in reversed(complete)]
    for path in found:
        try:
            return TrainState.read(path).finetune_config()
        except CheckpointError:  # damaged: resume=auto passes over it too
            continue
    return None


@torch.no_grad()
def load_peft_adapter(model: nn.Module, cfg: Config) -> None:
    """The weights of ``model.adapter`` into the adapters of ``model`` (sharded or not)."""
    directory = Path(cfg.model.adapter).expanduser()
    params = {name: param for name, param in model.named_parameters() if is_adapter(name)}
    loaded = set()
    for key, tensor in adapter_weights(directory).items():
        module, matrix = our_name(key, cfg)
        name = f"{module}.{matrix}.{ADAPTER_NAME}.weight"
        if name not in params:
            raise CheckpointError(f"model.adapter={str(directory)!r} has an adapter on {module!r}, which "
                                  "finetune.targets does not select; leave finetune.targets empty (the "
                                  "adapter sets it) or name that module")
        heads = rotary_heads(f"{module}.weight", cfg.model) if cfg.model.name != "hf" else None
        if heads and matrix == "lora_B":  # output rows: export-peft permuted them as the projection's
            tensor = halves_to_interleaved(tensor, heads)
        param = params[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(f"model.adapter: {key} has shape {list(tensor.shape)}, the model's "
                                  f"{name} {list(param.shape)}: the adapter was made for another model")
        full = shard_like(tensor.to(param.dtype), param)
        (param.to_local() if hasattr(param, "to_local") else param).copy_(
            full.to_local() if hasattr(full, "to_local") else full)
        loaded.add(name)
    if missing := sorted(set(params) - loaded):
        raise CheckpointError(f"model.adapter={str(directory)!r} lacks {missing[0]} (and {len(missing) - 1} "
                              "more): finetune.targets selects modules it has no adapter for")
