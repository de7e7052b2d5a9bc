"""shardtrain: FSDP2 training with the right defaults and loud errors."""

__version__ = "0.1.0"

from shardtrain.config.loader import load_config  # noqa: E402
from shardtrain.config.schema import Config  # noqa: E402
from shardtrain.logs import setup_logging  # noqa: E402
from shardtrain.train.loop import Trainer, TrainResult, run_training  # noqa: E402

__all__ = ["Config", "Trainer", "TrainResult", "load_config", "run_training", "setup_logging", "__version__"]
