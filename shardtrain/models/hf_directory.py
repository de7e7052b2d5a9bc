"""What shardtrain knows of a Hugging Face model directory without importing transformers: its config
file, where to find it, and the prefix of its parameters' names inside shardtrain. Weight loading
and adapters (``checkpoint/``) use these in runs of every model; only runs with ``model.name=hf``
load transformers (``models/registry``)."""

from __future__ import annotations

from pathlib import Path

from shardtrain.config.schema import ModelConfig
from shardtrain.errors import ModelError

PREFIX = "hf."
CONFIG_FILE = "config.json"


def hf_name(name: str) -> str:
    """A parameter's name in transformers' state dict (and the model directory's files)."""
    return name.removeprefix(PREFIX)


def is_model_directory(path: Path) -> bool:
    """A Hugging Face model directory (its config file) that is not also a DCP checkpoint (whose
    metadata file, ``.metadata``, decides: one saved beside a config is read as a checkpoint)."""
    return (path / CONFIG_FILE).is_file() and not (path / ".metadata").is_file()


def model_directory(cfg: ModelConfig) -> Path:
    if not cfg.path:
        raise ModelError("model.name=hf needs model.path=DIR, a local Hugging Face model directory")
    directory = Path(cfg.path).expanduser()
    if not (directory / CONFIG_FILE).is_file():
        raise ModelError(f"model.path={cfg.path!r} has no {CONFIG_FILE}: not a Hugging Face model "
                         "directory (nothing is downloaded; save the model there with save_pretrained; "
                         "a model moved since a run trained on it: put it back, or link its new place there)")
    return directory
