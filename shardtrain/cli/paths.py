"""Path checks that need no torch: what ``consolidate``, ``export-hf``, ``generate``, ``eval`` and
``inspect`` check before importing it (seconds), so a mistyped path is answered at once. What a
path holds (a whole checkpoint, a model) is checked by the command itself, after."""

from __future__ import annotations

import os
from pathlib import Path

from shardtrain.errors import ConfigError


def check_exists(path: str, what: str = "") -> None:
    """A path a command reads; ``what`` names it in the message ("checkpoint", "--file")."""
    if not Path(path).exists():
        raise ConfigError(f"{what + ' ' if what else ''}{path!r} does not exist")


def check_writable(path: Path, what: str) -> None:
    """``path`` can be created or written: its nearest existing ancestor is a writable directory."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {str(path)!r} cannot be written ({str(existing)!r} is not a "
                          "writable directory); choose another path")


def check_output(out: Path, source: Path, what: str) -> None:
    """An output path of ``consolidate`` or ``export-hf``: writable, and never inside the source."""
    out, source = out.expanduser().resolve(), source.expanduser().resolve()
    inside = source.is_dir() and source in out.parents
    beside = source.is_file() and out == source.parent  # model.safetensors there is the source
    if out == source or inside or beside:
        raise ConfigError(f"{what} {str(out)!r} is inside the checkpoint it reads; write elsewhere "
                          "(a checkpoint is never modified)")
    single_file = out.suffix == ".safetensors"
    if single_file and out.is_dir():
        raise ConfigError(f"{what} {str(out)!r} is a directory; name a .safetensors file or drop the suffix")
    if not single_file and out.exists() and not out.is_dir():
        raise ConfigError(f"{what} {str(out)!r} is a file; pass a directory (or a .safetensors file name)")
    check_writable(out, what)
