"""``shardtrain export-hf --merge``: a LoRA checkpoint as the merged full model (W + alpha/r * B @ A on
every target), written as ``export-hf`` writes a whole model.

The checkpoint's model (its base, read or drawn as training did, plus its adapters) is built whole in
host memory in fp32 (as ``export-peft``'s check builds it); PEFT's own ``merge`` folds each adapter
into its layer, checked on the spot: the merged model's logits must be the adapted model's. The
merged weights then go through ``export/hf.py``'s conversion (the built-in Llama's state-dict
adapter, or transformers' names), one output shard of at most ``--max-shard-size`` at a time.

The self-check reads the written directory back as transformers would and compares its logits with
the checkpoint's model with its adapters (written in fp32), or, written in bf16/fp16, with the merged
weights rounded to that dtype (what the files can hold; the merge itself was checked in fp32).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from shardtrain.checkpoint.safetensors_files import check_new_directory
from shardtrain.config.schema import ModelConfig
from shardtrain.distributed.sharded_model import parameters_on_meta
from shardtrain.errors import CheckpointError
from shardtrain.export.hf import hf_conversion, shard_parts, tokenizer_copies, write_hf_directory
from shardtrain.export.peft import LoraCheckpoint, base_state, checkpoint_model
from shardtrain.export.verify import (
    EXPORT_TOLERANCE,
    check_tokens,
    compare_logits,
    export_reader,
    streamed_forward,
    written_cast,
)
from shardtrain.models.hf import HFCausalLM
from shardtrain.models.lora import ADAPTER_NAME


@torch.no_grad()
def merge_in_place(model: nn.Module) -> float:
    """Fold every adapter of ``model`` into its layer (PEFT's ``merge``, which refuses NaN); return
    the relative logit difference the merge made on the check batch (a CheckpointError past the
    export tolerance)."""
    tokens = check_tokens(model)
    want = model(tokens)
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            try:
                module.merge(safe_merge=True, adapter_names=[ADAPTER_NAME])
            except ValueError as exc:  # PEFT's safe merge refuses a non-finite merged weight
                raise CheckpointError(f"the adapters of {name} give a non-finite merged weight ({exc}): the "
                                      "checkpoint's adapters are damaged or diverged; merge an earlier "
                                      "checkpoint") from exc
    return compare_logits(want, model(tokens), "the merged model (in memory, before writing)")


def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A merged model's weights under the names the model has without adapters: its state, the
    buffers saved beside the parameters too (found by review: a router's score-correction bias left
    out, transformers filled it with zeros and routed otherwise; a tied weight's second name is the
    conversion's to drop)."""
    return base_state(model)


def select(tensors: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    return {name: tensors[name] for name in names}


def export_merged(checkpoint: str | Path, out_dir: str | Path, max_shard_size: str = "2GB",
                  dtype: str | None = None, verify_checksums: bool = True) -> list[Path]:
    """The merged full model of a ``finetune=lora`` checkpoint as a Hugging Face directory."""
    check_new_directory(Path(out_dir))  # before the model is built and merged, not after
    ckpt = LoraCheckpoint.read(checkpoint, verify_checksums)
    tokenizer_copies(ckpt.model)  # a tokenizer gone since training: before the merge's work
    # QLoRA: merged into the NF4 base's values, which training, generate and eval ran the adapters
    # on (PEFT's merge of a 4-bit model dequantises the same way, then quantises the merged weight
    # again; written here in full precision); the plain base's differ by NF4's rounding (measured:
    # 0.22 relative in a tiny model's logits).
    model = checkpoint_model(ckpt, nf4_base=True)
    merge_in_place(model)
    tensors = merged_weights(model)
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in tensors.items()}
    parts = [partial(select, tensors, names) for names in shard_parts(sizes, max_shard_size)]
    return write_hf_directory(hf_conversion(ckpt.model, dtype), Path(out_dir), parts, max_shard_size)


@torch.no_grad()
def verify_merged_export(checkpoint: str | Path, out_dir: str | Path, tolerance: float = EXPORT_TOLERANCE,
                         verify_checksums: bool = True) -> float:
    """The largest relative logit difference between the written merged model, read back as
    transformers reads it, and the checkpoint's model with its adapters; a CheckpointError past
    ``tolerance``."""
    out_dir = Path(out_dir)
    ckpt = LoraCheckpoint.read(checkpoint, verify_checksums)
    model = checkpoint_model(ckpt, nf4_base=True)
    tokens = check_tokens(model)
    with parameters_on_meta():
        theirs = HFCausalLM(ModelConfig(name="hf", path=str(out_dir)))  # from_pretrained's model
    cast = written_cast(theirs, out_dir)
    if cast.dtype != torch.float32:  # the reference the files can hold: merged, rounded as written
        merge_in_place(model)
        for name, param in merged_weights(model).items():
            param.copy_(param.to(cast.of(name, param.dtype)).float())
    want = model(tokens)
    read = export_reader(out_dir, theirs)
    got = streamed_forward(theirs, tokens, lambda names: read(names).float())
    return compare_logits(want, got, f"{out_dir} (merged) loaded by transformers", tolerance)

