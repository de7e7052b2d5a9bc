"""shardtrain: FSDP2 training with the right defaults and loud errors.

The public names are imported on first use, so ``shardtrain --help`` does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardtrain.version import __version__

if TYPE_CHECKING:  # what type checkers and IDEs see of the names imported on first use
    from shardtrain.config.loader import load_config
    from shardtrain.config.schema import Config
    from shardtrain.logs import setup_logging
    from shardtrain.train.loop import Trainer, TrainResult, run_training

_EXPORTS = {
    "Config": "shardtrain.config.schema",
    "load_config": "shardtrain.config.loader",
    "Trainer": "shardtrain.train.loop",
    "TrainResult": "shardtrain.train.loop",
    "run_training": "shardtrain.train.loop",
    "setup_logging": "shardtrain.logs",
}
__all__ = ["Config", "TrainResult", "Trainer", "__version__", "load_config", "run_training", "setup_logging"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'shardtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
