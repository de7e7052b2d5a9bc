"""Checksums of a checkpoint's files: recorded once when it is committed, verified before it is read.

DCP keeps no checksums: a shard whose bytes changed after the save (a bad disk, a bad copy, a zeroed
block) has the right length and loads as wrong numbers or as an obscure unpickling error. At commit
time every file's sha256 goes into ``checksums.json``::

    {"algorithm": "sha256", "files": {"__0_0.distcp": {"sha256": "<hex>", "bytes": 123}, ...}}

The work is split so that it does not grow with the world size on any one rank: at a save each rank
hashes the files it wrote (``files_of_rank``: ``__<r>_*.distcp`` and ``rng-rank<r>.pt``; rank 0 the
rest) and rank 0 writes the gathered digests; at a resume each rank hashes its ``verification_share``
(the files balanced by bytes over the ranks) and the ranks agree on one verdict (the checkpointer's
collectives; this module does no communication). A single process (consolidate, inspect) hashes all.

The manifest covers every file but itself and ``trainer_state.json``, which is written after it (it
stays the last file, and ``TrainState.read`` validates its JSON and fields). Verification hashes the
same files again and unpickles nothing; it runs after the cheap structure checks (which read
``.metadata``) and before the RNG files are unpickled or DCP reads a tensor. Files added after the
commit are not checked.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
from pathlib import Path

from shardtrain.checkpoint.layout import rng_file
from shardtrain.checkpoint.state import STATE_FILE
from shardtrain.durable import written_durably
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


def files_of_rank(directory: Path, rank: int) -> list[str]:
    """The files ``rank`` wrote at a save, found by name rather than by listing the directory (which
    holds two files a rank: every rank listing it is world x 2 x world entries read at scale): its
    RNG file and DCP's shards ``__<rank>_0.distcp``, ``__<rank>_1.distcp``, ... (numbered from 0 by
    FileSystemWriter). A file not found this way is hashed by rank 0 when it writes the manifest.
    The RNG file is every save's: the commit refuses a save that lost it before asking for these."""
    names = [rng_file(rank)]
    index = 0
    while (directory / f"__{rank}_{index}.distcp").is_file():
        names.append(f"__{rank}_{index}.distcp")
        index += 1
    return names


def hash_entries(directory: Path, names: list[str]) -> dict[str, dict]:
    """Manifest entries (name -> {"sha256", "bytes"}) for ``names`` in ``directory``."""
    return {name: {ALGORITHM: file_sha256(directory / name), "bytes": (directory / name).stat().st_size}
            for name in names}


def write_manifest(directory: Path, entries: dict[str, dict]) -> None:
    """Write ``checksums.json`` from entries hashed by any ranks, durably (fsynced); the files no
    entry covers (none when every rank did its part) are hashed here."""
    missing = [name for name in covered_files(directory) if name not in entries]
    files = {**entries, **hash_entries(directory, missing)}
    with written_durably(directory / MANIFEST_FILE, "w") as f:
        json.dump({"algorithm": ALGORITHM, "files": files}, f, indent=1, sort_keys=True)
        f.write("\n")


def verification_share(files: dict[str, dict], rank: int, world_size: int) -> list[str]:
    """The recorded files ``rank`` verifies: largest first to the least-loaded rank, so each rank
    reads about 1/world of the bytes; every rank computes the same split from the same manifest."""
    loads = [(0, r) for r in range(world_size)]  # a heap of (bytes so far, rank): ties to the lowest rank
    share: list[str] = []
    for name in sorted(files, key=lambda n: (-files[n]["bytes"], n)):
        load, chosen = heapq.heappop(loads)
        heapq.heappush(loads, (load + files[name]["bytes"], chosen))
        if chosen == rank:
            share.append(name)
    return sorted(share)


def read_manifest(path: Path) -> dict[str, dict] | None:
    """The recorded files (name -> {"sha256", "bytes"}), or None when no manifest exists (a
    checkpoint from before checksums, or another tool's); a CheckpointError where the checkpoint's
    trainer state says its save wrote one."""
    file = path / MANIFEST_FILE
    if not file.is_file():
        try:
            recorded = json.loads((path / STATE_FILE).read_bytes()).get("checksums") is True
        except (OSError, ValueError, AttributeError):  # none, or damaged: its own reader says so
            recorded = False
        if recorded:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {MANIFEST_FILE} is missing, though its save wrote one: the "
                "checkpoint is incomplete (copied without it?); copy it again or use another one "
                "(checkpoint.verify_checksums=false, or --skip-checksums of the commands that read "
                "it, reads it unverified)")
        return None
    try:
        raw = json.loads(file.read_bytes())  # an OSError is the filesystem's, not damage: raised
        files = raw["files"]
        if raw["algorithm"] != ALGORITHM or not all(
            isinstance(e[ALGORITHM], str) and isinstance(e["bytes"], int) for e in files.values()
        ):
            raise ValueError(f"not a {ALGORITHM} manifest")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        # A KeyError's text is the bare key: named as the entry the file lacks
        why = f"no {exc.args[0]!r} entry" if isinstance(exc, KeyError) and exc.args else str(exc)
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {MANIFEST_FILE} is unreadable ({why}); the checkpoint is "
            "damaged, use another one (or skip verification: checkpoint.verify_checksums=false, "
            "--skip-checksums of the commands that read it)"
        ) from exc
    return files


def damaged_files(path: Path, files: dict[str, dict] | None = None,
                  names: list[str] | None = None) -> dict[str, str] | None:
    """Damaged file name -> what is wrong with it, among ``names`` (default: every recorded file);
    None when the checkpoint records no checksums.

    Sizes first (cheap), then hashes, so a missing or truncated file is named without hashing the rest.
    """
    files = read_manifest(path) if files is None else files
    if files is None:
        return None
    names = sorted(files) if names is None else names
    damaged: dict[str, str] = {}
    for name in names:
        entry, file = files[name], path / name
        if not file.is_file():
            damaged[name] = f"{name} is missing"
        elif (size := file.stat().st_size) != entry["bytes"]:
            how = "truncated" if size < entry["bytes"] else "longer than recorded"
            damaged[name] = f"{name} is {how} ({size} bytes, {entry['bytes']} were recorded)"
    for name in names:
        if name not in damaged and (found := file_sha256(path / name)) != files[name][ALGORITHM]:
            damaged[name] = f"{name} is damaged (sha256 {found}, recorded {files[name][ALGORITHM]})"
    return damaged


def damage_error(path: Path, damaged: dict[str, str]) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {str(path)!r}: {'; '.join(damaged[n] for n in sorted(damaged))}; the checkpoint "
        "is damaged (its files changed after the save), use another one"
    )


def warn_unrecorded(path: Path) -> None:
    log.warning(f"checkpoint {path}: no checksums recorded (it predates {MANIFEST_FILE}, or "
                "another tool wrote it); damage inside its files cannot be detected")


def verify_files(path: Path, *, names: list[str] | None = None) -> None:
    """Raise a CheckpointError naming every damaged, missing or resized file of the checkpoint at
    ``path`` (among ``names``, default all); a checkpoint without a manifest (saved before checksums
    existed) only gets a warning. One process, every byte: the ranks of a run split it instead."""
    if not path.is_dir():
        what = "is a file, not a checkpoint directory" if path.exists() else "does not exist"
        raise CheckpointError(f"checkpoint {str(path)!r} {what}")
    files = read_manifest(path)
    if files is None:
        warn_unrecorded(path)
        return
    wanted = None if names is None else set(names)
    if damaged := damaged_files(path, files, [n for n in sorted(files) if wanted is None or n in wanted]):
        raise damage_error(path, damaged)
