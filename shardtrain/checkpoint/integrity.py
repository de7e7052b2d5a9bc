"""Checksums of a checkpoint's files: recorded once when it is committed, verified before it is read.

DCP keeps no checksums: a shard whose bytes changed after the save (a bad disk, a bad copy, a zeroed
block) has the right length and loads as wrong numbers or as an obscure unpickling error. At commit
time rank 0 hashes every file of the checkpoint into ``checksums.json``::

    {"algorithm": "sha256", "files": {"__0_0.distcp": {"sha256": "<hex>", "bytes": 123}, ...}}

The manifest covers every file but itself and ``trainer_state.json``, which is written after it (it
stays the last file, and ``TrainState.read`` validates its JSON and fields). Verification hashes the
same files again and unpickles nothing; it runs after the cheap structure checks (which read
``.metadata``) and before the RNG files are unpickled or DCP reads a tensor. Files added after the
commit are not checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from shardtrain.checkpoint.state import STATE_FILE
from shardtrain.errors import CheckpointError

log = logging.getLogger("shardtrain")

MANIFEST_FILE = "checksums.json"
ALGORITHM = "sha256"
BLOCK_BYTES = 8 << 20
# The manifest itself, and the one file written after it.
NOT_COVERED = frozenset({MANIFEST_FILE, STATE_FILE})


def file_sha256(file: Path) -> str:
    """Streamed in fixed blocks into one reused buffer: memory stays at one block for any file size."""
    digest = hashlib.sha256()
    buffer = bytearray(BLOCK_BYTES)
    view = memoryview(buffer)
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def covered_files(directory: Path) -> list[str]:
    """Relative names (POSIX separators) of the files the manifest records, sorted."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.relative_to(directory).as_posix() not in NOT_COVERED)


def write_manifest(directory: Path) -> None:
    """Hash every file of ``directory`` into ``checksums.json``, durably (fsynced)."""
    files = {}
    for name in covered_files(directory):
        file = directory / name
        files[name] = {ALGORITHM: file_sha256(file), "bytes": file.stat().st_size}
    with open(directory / MANIFEST_FILE, "w") as f:
        json.dump({"algorithm": ALGORITHM, "files": files}, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: Path) -> dict[str, dict] | None:
    """The recorded files (name -> {"sha256", "bytes"}), or None when no manifest exists."""
    file = path / MANIFEST_FILE
    if not file.is_file():
        return None
    try:
        raw = json.loads(file.read_text())
        files = raw["files"]
        if raw["algorithm"] != ALGORITHM or not all(
            isinstance(e[ALGORITHM], str) and isinstance(e["bytes"], int) for e in files.values()
        ):
            raise ValueError(f"not a {ALGORITHM} manifest")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {MANIFEST_FILE} is unreadable ({exc}); the checkpoint is "
            "damaged, use another one (or skip verification: checkpoint.verify_checksums=false, "
            "consolidate --skip-checksums)"
        ) from exc
    return files


def damaged_files(path: Path) -> dict[str, str] | None:
    """Damaged file name -> what is wrong with it; None when the checkpoint records no checksums.

    Sizes first (cheap), then hashes, so a missing or truncated file is named without hashing the rest.
    """
    files = read_manifest(path)
    if files is None:
        return None
    damaged: dict[str, str] = {}
    for name, entry in sorted(files.items()):
        file = path / name
        if not file.is_file():
            damaged[name] = f"{name} is missing"
        elif (size := file.stat().st_size) != entry["bytes"]:
            how = "truncated" if size < entry["bytes"] else "longer than recorded"
            damaged[name] = f"{name} is {how} ({size} bytes, {entry['bytes']} were recorded)"
    for name, entry in sorted(files.items()):
        if name not in damaged and (found := file_sha256(path / name)) != entry[ALGORITHM]:
            damaged[name] = f"{name} is damaged (sha256 {found}, recorded {entry[ALGORITHM]})"
    return damaged


def verify_files(path: Path, *, warn: bool = True) -> None:
    """Raise a CheckpointError naming every damaged, missing or resized file of the checkpoint at
    ``path``; a checkpoint without a manifest (saved before checksums existed) only gets a warning
    (``warn=False``: not even that, for the ranks that would repeat rank 0's)."""
    if not path.is_dir():
        what = "is a file, not a checkpoint directory" if path.exists() else "does not exist"
        raise CheckpointError(f"checkpoint {str(path)!r} {what}")
    damaged = damaged_files(path)
    if damaged is None and warn:
        log.warning(f"checkpoint {path}: no checksums recorded (it predates {MANIFEST_FILE}, or "
                    "another tool wrote it); damage inside its files cannot be detected")
    elif damaged:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {'; '.join(damaged.values())}; the checkpoint is damaged (its "
            "files changed after the save), use another one"
        )
