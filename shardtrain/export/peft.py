"""``shardtrain export-peft``: a LoRA checkpoint's adapters as a PEFT adapter directory.

Writes ``adapter_config.json`` and ``adapter_model.safetensors`` under PEFT's key names
(``base_model.model.<module>.lora_A.weight``), which ``peft.PeftModel.from_pretrained(base, OUT)``
loads onto the transformers base model. A ``model.name=hf`` model's modules already have
transformers' names (under ``hf.``); the built-in Llama's go through its state-dict adapter
(``models/llama_hf_adapter.py``), as ``export-hf`` maps the base: a q/k adapter's ``lora_B`` rows
take the same rotary permutation as the projection's own rows (``lora_A`` acts on inputs, which
keep their order).

The self-check (``verify_peft_export``) builds the checkpoint's model with its base and adapters,
and the transformers base with the written adapters loaded by PEFT, and compares their logits.
Both models are whole in host memory in fp32.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from peft import PeftModel
from torch import nn

from shardtrain.checkpoint import integrity, layout
from shardtrain.checkpoint.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX
from shardtrain.checkpoint.safetensors_files import check_new_directory, remove_written, save_shard
from shardtrain.checkpoint.state import TrainState
from shardtrain.checkpoint.weights import (
    base_identity,
    check_same_base,
    load_model_weights,
    refuse_task_adapters,
    source_files,
)
from shardtrain.config.plan import DTYPES
from shardtrain.config.schema import FinetuneConfig, ModelConfig
from shardtrain.distributed.qlora import round_base_to_nf4
from shardtrain.distributed.sharded_model import init_full_parameter
from shardtrain.errors import CheckpointError
from shardtrain.export.consolidate import Cast, load_tensors, plan_shards
from shardtrain.export.hf import tokenizer_max_length, write_tokenizer_files
from shardtrain.export.verify import EXPORT_TOLERANCE, check_tokens, compare_logits
from shardtrain.generation.generate import shared_parameter_names
from shardtrain.models.hf import attention_implementation
from shardtrain.models.hf_directory import hf_name, is_model_directory
from shardtrain.models.llama_hf_adapter import hf_config, to_hf, to_hf_name
from shardtrain.models.lora import (
    ADAPTER_NAME,
    DEFAULT_TARGETS,
    add_adapters,
    base_name,
    held_targets,
    is_adapter,
    lora_config,
    round_base_to,
)
from shardtrain.models.registry import build_model


@dataclass
class LoraCheckpoint:
    """What a ``finetune=lora`` checkpoint holds: its model, LoRA settings, base and adapters."""

    path: Path
    model: ModelConfig
    finetune: FinetuneConfig
    seed: int
    adapters: dict[str, torch.Tensor]  # our parameter names -> full tensors

    @classmethod
    def read(cls, path: str | Path, verify_checksums: bool = True) -> LoraCheckpoint:
        path = Path(path)
        layout.verify(path)
        state = TrainState.read(path)
        if state.base_weights is None:
            raise CheckpointError(f"checkpoint {str(path)!r} holds no LoRA adapters (it was not trained "
                                  "with finetune=lora); export-hf without --merge exports whole models")
        refuse_task_adapters(path, state)  # before model_config, which names consolidate for a task's
        if source := state.model_config().weights_source():
            source_files(source)  # a base moved since training: said before anything is written
        # A base changed since training (its files replaced) merged or shipped the adapters onto
        # another model, and the self-check, reading that same base, passed.
        seed = int(state.config["trainer"]["seed"])
        trained_on = base_identity(state.model_config(), seed, state.finetune_config())
        check_same_base(path, state.base_weights, trained_on, use="export it with")
        plan = plan_shards(path, None, Cast(), "model")
        if verify_checksums:
            integrity.verify_files(path, names=plan.files)  # every byte read, as consolidate verifies
        entries = [entry for shard in plan.shards for entry in shard if is_adapter(entry[1])]
        tensors = load_tensors(path, entries, plan.metadata)
        return cls(path, state.model_config(), state.finetune_config(), seed,
                   {name: tensors[key] for key, name, _ in entries})


def peft_key(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> tuple[str, torch.Tensor]:
    """Our adapter parameter -> (PEFT's key, tensor) on the transformers model."""
    module, _, rest = name.partition(".lora_")
    matrix = "lora_" + rest.split(".")[0]  # lora_A | lora_B
    if cfg.name == "hf":
        return f"{PEFT_PREFIX}{hf_name(module)}.{matrix}.weight", tensor
    weight = f"{module}.weight"
    if matrix == "lora_B":  # output rows: permuted like the projection's
        hf_weight, tensor = to_hf(weight, tensor, cfg)
    else:
        hf_weight = to_hf_name(weight)
    return f"{PEFT_PREFIX}{hf_weight.removesuffix('.weight')}.{matrix}.weight", tensor


def base_directory(cfg: ModelConfig) -> str | None:
    """The Hugging Face directory PEFT's base model is loaded from, where the base is one."""
    source = cfg.weights_source()
    if cfg.name == "hf" and source == cfg.path:
        return str(Path(source).expanduser().resolve())
    if source is not None and source.startswith("hf:"):
        return str(Path(source.removeprefix("hf:")).expanduser().resolve())
    if cfg.name == "hf" and source is not None and is_model_directory(Path(source).expanduser()):
        # model.init_from naming another Hugging Face directory of the model (found by a review: null)
        return str(Path(source).expanduser().resolve())
    return None


def adapted_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The transformers modules that PEFT's keys (``peft_key``) put adapters on."""
    return sorted({key.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0] for key in tensors})


def target_modules(finetune: FinetuneConfig, modules: list[str]) -> list[str]:
    """``target_modules`` for ``adapter_config.json``: the modules' last names where the run's targets
    were last names too (each selected every module so named, as PEFT's last names do), else their
    full names: last names would give PEFT adapters on modules the run never trained."""
    if all("." not in target for target in finetune.targets or DEFAULT_TARGETS):
        return sorted({module.rsplit(".", 1)[-1] for module in modules})
    return modules


def export_peft(checkpoint: str | Path, out_dir: str | Path, verify_checksums: bool = True) -> list[Path]:
    """PEFT's adapter directory from a ``finetune=lora`` checkpoint."""
    ckpt = LoraCheckpoint.read(checkpoint, verify_checksums)
    out = Path(out_dir)
    # Never into a model's directory (a base model's own would load the adapters from then on) nor
    # over another adapter.
    check_new_directory(out)
    tensors = dict(peft_key(name, tensor, ckpt.model) for name, tensor in ckpt.adapters.items())
    config = lora_config(ckpt.finetune, target_modules(ckpt.finetune, adapted_modules(tensors)))
    # PEFT keeps them as a set, which it writes in the interpreter's hash order: sorted, two exports
    # of one checkpoint are the same bytes.
    config.target_modules = sorted(config.target_modules)
    config.task_type = "CAUSAL_LM"
    config.base_model_name_or_path = base_directory(ckpt.model)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    written = [out / ADAPTER_WEIGHTS, out / ADAPTER_CONFIG]
    try:
        # The weights under their name only when whole, the config last: a full disk left a cut
        # adapter file that PEFT would try, and blocked the rerun (found by review).
        save_shard({k: v.contiguous() for k, v in tensors.items()}, out / ADAPTER_WEIGHTS, {"format": "pt"})
        if not base_tokenizer(ckpt.model):
            # The ids the adapters were trained on are the run's tokenizer's, which the base's would
            # not give (found by review: a byte-level run's adapter shipped for the base's tokenizer)
            written += write_tokenizer_files(ckpt.model, out, tokenizer_max_length(ckpt.model))
        config.save_pretrained(str(out))
    except BaseException:
        remove_written(out, [*written, out / f"{ADAPTER_WEIGHTS}.tmp"], made)
        raise
    return sorted(written)


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A model's state without its adapters, under the names it has without them: the parameters and
    the buffers saved beside them (a tied weight under each of its names: a conversion drops the
    second)."""
    return {base_name(name): tensor.detach() for name, tensor in model.state_dict(keep_vars=True).items()
            if not is_adapter(name)}


def base_tokenizer(cfg: ModelConfig) -> bool:
    """The run's tokenizer is its Hugging Face base directory's own (``model.tokenizer=auto``)."""
    return cfg.name == "hf" and cfg.tokenizer == "auto"


@torch.no_grad()
def checkpoint_model(ckpt: LoraCheckpoint, nf4_base: bool = False) -> nn.Module:
    """The checkpoint's model in fp32 on the CPU: its base as training read or drew it, and its
    adapters. ``nf4_base``: a QLoRA checkpoint's base quantised to NF4 and back, as training used it
    (export-peft's check leaves it plain: it checks the mapping onto PEFT's model of the plain base)."""
    model = add_adapters(build_model(ckpt.model), held_targets(ckpt.finetune, ckpt.adapters))
    if source := ckpt.model.weights_source():
        load_model_weights(model, source, ckpt.model)
    else:
        for name, param in model.named_parameters():
            if not is_adapter(name):
                init_full_parameter(model, base_name(name), param, ckpt.seed)
    if ckpt.finetune.base_dtype != "fp32":
        round_base_to(model, DTYPES[ckpt.finetune.base_dtype])  # the base as training stored it
    if nf4_base and ckpt.finetune.method == "qlora":
        round_base_to_nf4(model)
    params = dict(model.named_parameters())
    if set(params) - set(ckpt.adapters) != {n for n in params if not is_adapter(n)}:
        missing = sorted(n for n in params if is_adapter(n) and n not in ckpt.adapters)
        raise CheckpointError(f"{ckpt.path} lacks adapters for {missing[:3]}: the checkpoint does not fit "
                              "the LoRA settings it records")
    for name, tensor in ckpt.adapters.items():
        params[name].copy_(tensor)
    return model.eval()


@torch.no_grad()
def transformers_base(ckpt: LoraCheckpoint, ours: nn.Module) -> nn.Module:
    """The transformers model PEFT's adapters go on: ``from_pretrained`` of the base directory, or
    (a random or shardtrain base) the transformers Llama filled with our base weights."""
    directory = base_directory(ckpt.model)
    if directory is not None:
        base = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32,
            attn_implementation=attention_implementation(transformers.AutoConfig.from_pretrained(directory)))
        if ckpt.finetune.base_dtype != "fp32":  # the base as training stored it, as ours is
            round_base_to(base, DTYPES[ckpt.finetune.base_dtype])
        return base
    if ckpt.model.name == "hf":
        config = transformers.AutoConfig.from_pretrained(ckpt.model.path)
    else:
        config = transformers.LlamaConfig(**hf_config(ckpt.model, torch.float32))
    theirs = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=attention_implementation(config))
    state = {}
    # The buffers saved beside the parameters too (found by review: a DCP base's router bias left at
    # its initial value, and a right adapter failed the check)
    for name, tensor in base_state(ours).items():
        converted = (hf_name(name), tensor) if ckpt.model.name == "hf" else to_hf(name, tensor, ckpt.model)
        if converted is not None:
            state[converted[0]] = converted[1]
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    tied = {name for names in shared_parameter_names(theirs) for name in names[1:]}  # the embedding's
    if unexpected or (missing := [name for name in missing if name not in tied]):
        raise CheckpointError(f"the transformers base built to check the export does not take the "
                              f"checkpoint's base (missing {missing[:4]}, unexpected {unexpected[:4]}): "
                              "report a defect; export-peft --no-verify writes the adapters unchecked")
    return theirs


@torch.no_grad()
def verify_peft_export(checkpoint: str | Path, out_dir: str | Path, tolerance: float = EXPORT_TOLERANCE,
                       verify_checksums: bool = True) -> float:
    """The largest relative logit difference between the checkpoint's model and the transformers base
    with the exported adapters loaded by PEFT; a CheckpointError past ``tolerance``."""
    ckpt = LoraCheckpoint.read(checkpoint, verify_checksums)
    ours = checkpoint_model(ckpt)
    with warnings.catch_warnings():
        # PEFT asks transformers a question transformers has renamed, and transformers warns of it:
        # nothing the exporter's user can change.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        theirs = PeftModel.from_pretrained(transformers_base(ckpt, ours), str(out_dir),
                                           adapter_name=ADAPTER_NAME).eval()
    # Extra adapters leave the logits alone (PEFT starts lora_B at zero) but train on in PEFT.
    expected = adapted_modules(dict(peft_key(n, t, ckpt.model) for n, t in ckpt.adapters.items()))
    loaded = sorted(name.removeprefix(PEFT_PREFIX) for name, module in theirs.named_modules()
                    if ADAPTER_NAME in getattr(module, "lora_A", {}))
    if loaded != expected:
        extra, missing = sorted(set(loaded) - set(expected)), sorted(set(expected) - set(loaded))
        raise CheckpointError(f"export check failed: PEFT put adapters on {len(loaded)} modules, the "
                              f"checkpoint trained {len(expected)} (extra {extra[:3]}, missing "
                              f"{missing[:3]}); do not use {out_dir}")
    tokens = check_tokens(ours)
    return compare_logits(ours(tokens), theirs(input_ids=tokens).logits,
                          f"{out_dir} loaded by peft.PeftModel", tolerance)
