"""``shardtrain export-hf``: a shardtrain checkpoint as a Hugging Face ``LlamaForCausalLM`` directory.

Streams one consolidated shard at a time and converts tensor by tensor through the model's
state-dict adapter (``models/llama_hf_adapter.py``); the conversion does not use transformers, the
self-check after it does (``export/verify.py``). Importing goes the other way through
``model.init_from=hf:<dir>`` (``checkpoint/weights.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from shardtrain.checkpoint.safetensors_files import save_shard, shard_name, write_index
from shardtrain.checkpoint.weights import model_config_of
from shardtrain.config.plan import DTYPES
from shardtrain.errors import CheckpointError
from shardtrain.export.consolidate import consolidate
from shardtrain.models.llama_hf_adapter import hf_config, to_hf


def export_hf(checkpoint: str | Path, out_dir: str | Path, max_shard_size: str = "2GB",
              dtype: str | None = None) -> list[Path]:
    """A transformers-loadable Llama directory from a shardtrain checkpoint (or its safetensors)."""
    src, out = Path(checkpoint), Path(out_dir)
    cfg = model_config_of(src)
    if cfg.name != "llama":
        raise CheckpointError(f"export-hf supports the built-in llama model, not {cfg.name!r}")
    out.mkdir(parents=True, exist_ok=True)
    # Stream: consolidate shard by shard into a staging area, then rename and permute per tensor.
    staging = out / ".staging"
    staged = [src] if src.is_file() else consolidate(src, staging, max_shard_size=max_shard_size)
    cast = DTYPES[dtype] if dtype else None
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
    parts = [p for p in staged if p.suffix == ".safetensors"]
    out_dtype = None
    for index, part in enumerate(parts, start=1):
        tensors = {}
        with safe_open(str(part), framework="pt") as f:
            for name in f.keys():
                converted = to_hf(name, f.get_tensor(name), cfg)
                if converted is None:
                    continue
                hf_name, t = converted
                t = (t.to(cast) if cast is not None else t).contiguous()
                out_dtype = t.dtype
                tensors[hf_name] = t
        name = shard_name(index, len(parts))
        save_shard(tensors, out / name, {"format": "pt"})
        files.append(out / name)
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
        del tensors
    shutil.rmtree(staging, ignore_errors=True)
    files.append(write_index(out, weight_map, total))
    config_file = out / "config.json"
    config_file.write_text(json.dumps(hf_config(cfg, out_dtype or torch.float32), indent=2) + "\n")
    files.append(config_file)
    return files
