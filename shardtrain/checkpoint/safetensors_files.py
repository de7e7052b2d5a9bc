"""The Hugging Face safetensors conventions, in one place: shard names, the index, metadata, dtypes.

``model.safetensors`` alone, or ``model-00001-of-00003.safetensors`` ... with
``model.safetensors.index.json`` mapping every tensor name to its file. Consolidation and export write
this layout; ``inspect``, ``model.init_from`` and generation read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardtrain.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Metadata key under which shardtrain stores the model config in a consolidated file.
MODEL_CONFIG_KEY = "shardtrain_model_config"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}


def shard_name(index: int, count: int) -> str:
    """File name of shard ``index`` (1-based) of ``count``."""
    return SINGLE_FILE if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"


def save_shard(tensors: dict[str, torch.Tensor], target: Path, metadata: dict[str, str]) -> None:
    """Write one file atomically (a crash leaves no half-written file under the final name)."""
    tmp = target.with_name(target.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, target)


def write_index(directory: Path, weight_map: dict[str, str], total_bytes: int) -> Path:
    index = directory / INDEX_FILE
    index.write_text(json.dumps({"metadata": {"total_size": total_bytes},
                                 "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    return index


def indexed_files(index: Path) -> list[Path]:
    """The shard files an index names (each once, sorted)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
    return sorted({index.parent / name for name in weight_map.values()})


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory: its index's shards, or its single file."""
    if (directory / INDEX_FILE).is_file():
        return indexed_files(directory / INDEX_FILE)
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    raise CheckpointError(f"{directory} has no {SINGLE_FILE} or {INDEX_FILE} (only safetensors "
                          "Hugging Face checkpoints are supported)")


def file_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}
