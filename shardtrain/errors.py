"""Errors that carry a message meant for the user: the CLI prints them without a traceback."""

from __future__ import annotations

import json
import re
from pathlib import Path


class ShardtrainError(Exception):
    """Base class: the message names the problem and the fix."""


class ConfigError(ShardtrainError):
    """An invalid configuration, detected before any process group starts."""


class LayoutError(ConfigError):
    """A layout setting that does not fit the world size or a node's processes: the same config may
    fit the machines ``shardtrain plan`` plans for (``--processes-per-node``)."""


class DataError(ShardtrainError):
    """The training data is missing, empty or too small for the requested batch."""


class TooFewTokens(DataError):
    """A split holds too few tokens for one window (a mixture's validation leaves such a dataset out;
    any other error of its data is raised)."""


class TrainingError(ShardtrainError):
    """Training cannot go on (e.g. too many non-finite steps in a row)."""


class ModelError(ShardtrainError):
    """The model or its wrap policy cannot be sharded as requested."""


class CheckpointError(ShardtrainError):
    """A checkpoint is missing, incomplete, damaged or does not fit the model."""


class CheckpointUnverifiable(CheckpointError):
    """A checkpoint could not be checked: the filesystem or the host failed (an I/O error, memory),
    which says nothing of the checkpoint, so it is never taken for damage."""


class CheckpointFromNewerVersion(CheckpointUnverifiable):
    """A checkpoint in a format a newer shardtrain writes: not damage either, so never skipped (and
    later moved aside) by ``checkpoint.resume=auto`` for it."""


class RunDirectoryBusy(CheckpointError):
    """Another training holds the run directory (``checkpoint/run_lock.py``): no failure of the run
    that holds it, so none is recorded in its ``failures/``."""


class GenerationError(ShardtrainError):
    """A generation request the model cannot serve (e.g. longer than its context)."""


class ReportError(ShardtrainError):
    """A run directory ``shardtrain report`` cannot read (missing, no metrics, nothing logged yet)."""


class TrackerError(ShardtrainError):
    """An experiment tracker (W&B, MLflow) cannot start: not installed, unreachable, not logged in."""


def first_line(exc: BaseException) -> str:
    """An exception's first line, or its type's name where it has no message."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def os_error_code(exc: BaseException) -> int | None:
    """The errno of an OSError, or of a Rust library's I/O error (safetensors' "Error while
    serializing: I/O error: File too large (os error 27)"), else None."""
    if isinstance(exc, OSError):
        return exc.errno
    found = re.search(r"\(os error (\d+)\)", str(exc))
    return int(found.group(1)) if found else None


def json_object(path: Path, error_type: type[ShardtrainError], fix: str) -> dict:
    """The JSON object a file holds; where it holds something else (not JSON, a list, a number) one
    ``error_type`` line naming the file and ``fix``. An OSError is the filesystem's: raised as it is."""
    try:
        value = json.loads(path.read_bytes())
    except ValueError as exc:  # UnicodeDecodeError too
        raise error_type(f"{path} is not valid JSON ({first_line(exc)}); {fix}") from exc
    if not isinstance(value, dict):
        raise error_type(f"{path} holds a JSON {type(value).__name__}, not an object; {fix}")
    return value
