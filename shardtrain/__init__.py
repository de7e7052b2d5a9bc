"""shardtrain: FSDP2 training with the right defaults and loud errors.

The public names are imported on first use, so ``shardtrain --help`` does not pay for torch.
"""

from __future__ import annotations

import importlib

from shardtrain.version import __version__

_EXPORTS = {
    "Config": "shardtrain.config.schema",
    "load_config": "shardtrain.config.loader",
    "Trainer": "shardtrain.train.loop",
    "TrainResult": "shardtrain.train.loop",
    "run_training": "shardtrain.train.loop",
    "setup_logging": "shardtrain.logs",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'shardtrain' has no attribute {name!r}")
