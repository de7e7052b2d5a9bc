"""The built-in corpus: every machine with Python has its standard library's source files.

Files are read in sorted order of their relative path and assigned to train or validation by a hash
of that path, so the split is deterministic, independent of the world size, and stable when files are
added. Each file is one document, tokenized by the model's tokenizer (``data/tokenizer.py``): raw bytes
for the built-in model (vocabulary 256, documents back to back), or a Hugging Face tokenizer with its
end-of-text token after every document.
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardtrain.config.schema import DataConfig
from shardtrain.data.tokenizer import ByteTokenizer, Tokenizer, token_dtype
from shardtrain.errors import DataError

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


# Documents tokenized per call of a Hugging Face tokenizer's batch encoder (which runs in parallel).
ENCODE_BATCH = 256


@dataclass
class Corpus:
    train: np.ndarray  # token ids: uint8 bytes, else uint16 or uint32 by vocabulary size
    val: np.ndarray
    train_files: int
    val_files: int
    root: str
    tokenizer: str = "bytes"

    def describe(self) -> str:
        return (
            f"{self.root}: {self.train_files} train files ({self.train.size / 1e6:.1f}M tokens), "
            f"{self.val_files} validation files ({self.val.size / 1e6:.1f}M tokens); "
            f"tokenizer {self.tokenizer}"
        )


def tokenize(documents: list[bytes], tokenizer: Tokenizer) -> np.ndarray:
    """All documents as one array of token ids, an end-of-text token after each (if the tokenizer
    has one)."""
    if isinstance(tokenizer, ByteTokenizer):
        return np.frombuffer(b"".join(documents), dtype=np.uint8)
    tail = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    dtype = token_dtype(tokenizer.vocab_size)
    parts = [np.asarray(ids + tail, dtype=dtype)
             for start in range(0, len(documents), ENCODE_BATCH)
             for ids in tokenizer.encode_documents(documents[start:start + ENCODE_BATCH])]
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)


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


def load_corpus(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> Corpus:
    tokenizer = tokenizer or ByteTokenizer()
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
    return Corpus(
        train=tokenize(train_parts, tokenizer),
        val=tokenize(val_parts, tokenizer),
        train_files=len(train_parts),
        val_files=len(val_parts),
        root=", ".join(map(str, roots)),
        tokenizer=tokenizer.name,
    )
