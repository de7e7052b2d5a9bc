"""Writes that survive a crash of the machine: data flushed to the disk before the name that points
at it (a checkpoint's commit, a prepared dataset's rename into place)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> int:
    """``data`` written to ``path`` and flushed to the disk; its size in bytes."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    return len(data)
