"""The built-in corpus: every machine with Python has its standard library's source files.

Files are read in sorted order of their relative path and assigned to train or validation by a hash
of that path, so the split is deterministic, independent of the world size, and stable when files are
added. Tokens are raw bytes (vocabulary 256).
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardtrain.config.schema import DataConfig
from shardtrain.errors import DataError

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class Corpus:
    train: np.ndarray  # uint8 byte tokens
    val: np.ndarray
    train_files: int
    val_files: int
    root: str

    def describe(self) -> str:
        return (
            f"{self.root}: {self.train_files} train files ({self.train.size / 1e6:.1f} MB), "
            f"{self.val_files} validation files ({self.val.size / 1e6:.1f} MB)"
        )


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, pattern: str) -> list[Path]:
    files = []
    for path in root.rglob(pattern):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]) or not path.is_file():
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_validation(relative_path: str, val_percent: float) -> bool:
    return zlib.crc32(relative_path.encode()) % 10_000 < val_percent * 100


def load_corpus(cfg: DataConfig) -> Corpus:
    if cfg.source == "stdlib":
        roots = [stdlib_root()]
    elif cfg.source == "files":
        if not cfg.paths:
            raise DataError("data.source=files needs data.paths=[dir_or_file,...]")
        roots = [Path(p).expanduser() for p in cfg.paths]
    else:
        raise DataError(f"data.source={cfg.source!r} is unknown; use 'stdlib' or 'files'")

    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    total = 0
    for root in roots:
        if cfg.max_bytes and total >= cfg.max_bytes:
            break
        if not root.exists():
            raise DataError(f"data path {str(root)!r} does not exist; fix data.paths")
        files = [root] if root.is_file() else list_files(root, cfg.file_glob)
        base = root.parent if root.is_file() else root
        for path in files:
            data = path.read_bytes()
            rel = path.relative_to(base).as_posix()
            (val_parts if is_validation(rel, cfg.val_percent) else train_parts).append(data)
            total += len(data)
            if cfg.max_bytes and total >= cfg.max_bytes:
                break
    if not train_parts or not val_parts:
        raise DataError(
            f"data from {', '.join(map(str, roots))} gave {len(train_parts)} training and "
            f"{len(val_parts)} validation files; both need at least one (add files, raise "
            "data.max_bytes, or change data.val_percent)"
        )
    as_array = lambda parts: np.frombuffer(b"".join(parts), dtype=np.uint8)  # noqa: E731
    return Corpus(
        train=as_array(train_parts),
        val=as_array(val_parts),
        train_files=len(train_parts),
        val_files=len(val_parts),
        root=", ".join(map(str, roots)),
    )
