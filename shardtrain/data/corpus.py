"""A run's training and validation tokens: always a prepared dataset (``data/prepare.py``), read
through memory maps (``data/prepared.py``).

``data.source=prepared`` names one (``data.paths=[DIR]``). ``stdlib`` (every machine with Python has
its standard library's source files) and ``files`` (``data.paths`` with ``data.file_glob``) are
prepared on first use into a cache (``data.cache_dir``) and read from there afterwards; a change to
the inputs prepares them again. Each file is one document; files are read in sorted order of their
relative path and assigned to train or validation by a hash of that path, so the split is
deterministic, independent of the world size, and stable when files are added. Tokens are the
model's (``data/tokenizer.py``): raw bytes for the built-in model, documents back to back, or a
Hugging Face tokenizer with its end-of-text token after every document.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from shardtrain.config.schema import DataConfig
from shardtrain.data.batches import MixtureWindows, TokenWindows
from shardtrain.data.prepare import PrepareOptions, is_validation, output_options, prepare
from shardtrain.data.prepared import TokenStream, open_prepared
from shardtrain.data.tokenizer import ByteTokenizer, Tokenizer
from shardtrain.errors import DataError

__all__ = ["Corpus", "is_validation", "load_corpus", "stdlib_root"]


@dataclass
class Corpus:
    train: TokenStream  # token ids, memory-mapped (a mixture: all its datasets' training tokens)
    val: TokenStream
    train_files: int  # documents in each split
    val_files: int
    root: str
    tokenizer: str = "bytes"
    path: str = ""  # the prepared dataset(s) read
    # A mixture: each dataset's training tokens and its weight (empty for one dataset).
    train_parts: list[TokenStream] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)

    def train_windows(self, seq_len: int, document_mask: bool = False) -> TokenWindows | MixtureWindows:
        if not self.train_parts:
            return TokenWindows(self.train, seq_len, "training data", document_mask)
        parts = [TokenWindows(part, seq_len, f"training data of mixture part {index}", document_mask)
                 for index, part in enumerate(self.train_parts)]
        return MixtureWindows(parts, self.weights or [part.num_samples for part in parts])

    def describe(self) -> str:
        return (
            f"{self.root}: {self.train_files} train documents ({self.train.size / 1e6:.1f}M tokens), "
            f"{self.val_files} validation documents ({self.val.size / 1e6:.1f}M tokens); "
            f"tokenizer {self.tokenizer}; prepared at {self.path}"
        )


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def cache_root(cfg: DataConfig) -> Path:
    if cfg.cache_dir != "auto":
        return Path(cfg.cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shardtrain" / "prepared"


def raw_inputs(cfg: DataConfig) -> list[Path]:
    if cfg.source == "stdlib":
        return [stdlib_root()]
    if not cfg.paths:
        raise DataError(f"data.source={cfg.source} needs data.paths=[...]")
    return [Path(p).expanduser().resolve() for p in cfg.paths]


def prepared_path(cfg: DataConfig, tokenizer: Tokenizer) -> Path:
    """The prepared dataset of ``cfg``: given (``prepared``), or prepared into the cache now.

    Every rank of a run may call this at once: a lock file makes one prepare while the others wait,
    then find it up to date."""
    if cfg.source == "prepared":
        return Path(cfg.paths[0]).expanduser()  # load_corpus sends every other count to load_mixture
    options = PrepareOptions(inputs=[str(p) for p in raw_inputs(cfg)], tokenizer=tokenizer.source,
                             text_field=cfg.text_field,
                             file_glob=cfg.file_glob, val_percent=cfg.val_percent,
                             max_bytes=cfg.max_bytes)
    described = {**output_options(options), "tokenizer": tokenizer.name}
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]
    root = cache_root(cfg)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        prepare(options, root / key, progress=False)
    return root / key


def load_corpus(cfg: DataConfig, tokenizer: Tokenizer | None = None,
                need: tuple[str, ...] = ("train", "val")) -> Corpus:
    """The corpus of ``cfg``; the splits in ``need`` must hold documents (evaluation on a file
    needs one split only)."""
    tokenizer = tokenizer or ByteTokenizer()
    if cfg.source == "prepared" and len(cfg.paths) != 1:
        return load_mixture(cfg, tokenizer)
    path = prepared_path(cfg, tokenizer)
    dataset = open_prepared(path, tokenizer)
    train_docs, val_docs = dataset.train.documents, dataset.val.documents
    roots = ", ".join(dataset.manifest["options"]["inputs"])
    if ("train" in need and not train_docs) or ("val" in need and not val_docs):
        raise DataError(
            f"data from {roots} gave {train_docs} training and {val_docs} validation documents; both "
            "need at least one (add files, raise data.max_bytes, or change data.val_percent)"
        )
    return Corpus(train=dataset.train, val=dataset.val, train_files=train_docs, val_files=val_docs,
                  root=roots, tokenizer=tokenizer.name, path=str(path))


def load_mixture(cfg: DataConfig, tokenizer: Tokenizer) -> Corpus:
    """Several prepared datasets (all made with the model's tokenizer), drawn by ``data.weights``;
    validation is all their validation splits."""
    if not cfg.paths:
        raise DataError("data.source=prepared needs data.paths=[DIR, ...]")
    datasets = [open_prepared(path, tokenizer) for path in cfg.paths]
    empty = [str(d.path) for d in datasets if not d.train.documents]
    if empty:
        raise DataError(f"mixture datasets without training documents: {', '.join(empty)}")
    val = TokenStream.concat([d.val for d in datasets])
    if not val.documents:
        raise DataError(f"no validation documents in any of {', '.join(cfg.paths)}; prepare one with "
                        "--val-percent above 0")
    return Corpus(train=TokenStream.concat([d.train for d in datasets]), val=val,
                  train_files=sum(d.train.documents for d in datasets), val_files=val.documents,
                  root="mixture of " + ", ".join(cfg.paths), tokenizer=tokenizer.name,
                  path=", ".join(str(d.path) for d in datasets),
                  train_parts=[d.train for d in datasets], weights=list(cfg.weights))
