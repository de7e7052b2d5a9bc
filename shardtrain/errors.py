"""Errors that carry a message meant for the user: the CLI prints them without a traceback."""


class ShardtrainError(Exception):
    """Base class: the message names the problem and the fix."""


class ConfigError(ShardtrainError):
    """An invalid configuration, detected before any process group starts."""


class DataError(ShardtrainError):
    """The training data is missing, empty or too small for the requested batch."""


class TrainingError(ShardtrainError):
    """Training cannot go on (e.g. too many non-finite steps in a row)."""


class ModelError(ShardtrainError):
    """The model or its wrap policy cannot be sharded as requested."""


class CheckpointError(ShardtrainError):
    """A checkpoint is missing, incomplete, damaged or does not fit the model."""


class GenerationError(ShardtrainError):
    """A generation request the model cannot serve (e.g. longer than its context)."""


class ReportError(ShardtrainError):
    """A run directory ``shardtrain report`` cannot read (missing, no metrics, nothing logged yet)."""


class TrackerError(ShardtrainError):
    """An experiment tracker (W&B, MLflow) cannot start: not installed, unreachable, not logged in."""
