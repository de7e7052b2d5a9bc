"""Writes that survive a crash of the machine: data flushed to the disk before the name that points
at it (a checkpoint's commit, a prepared dataset's rename into place)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def written_durably(path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """``path`` opened for writing in ``mode``; its data flushed to the disk when the block ends."""
    with open(path, mode) as file:
        yield file
        file.flush()
        os.fsync(file.fileno())


def write_durably(path: Path, data: bytes) -> int:
    """``data`` written to ``path`` and flushed to the disk; its size in bytes."""
    with written_durably(path) as file:
        file.write(data)
    return len(data)
