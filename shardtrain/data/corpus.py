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

import hashlib
import json
import logging
import os
import shutil
import socket
import sysconfig
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from shardtrain.config.schema import DataConfig
from shardtrain.data.batches import InterleavedWindows, MixtureWindows, RecordWindows, TokenWindows
from shardtrain.data.documents import PREPARE_LOCK_SUFFIX, resolved_keeping_file_name
from shardtrain.data.prepare import (
    PrepareOptions,
    damaged_files,
    is_validation,
    locked,
    output_options,
    prepare,
    read_manifest,
    tokenizer_entry,
)
from shardtrain.data.prepared import TokenStream, open_prepared
from shardtrain.data.tokenizer import ByteTokenizer, Tokenizer
from shardtrain.errors import DataError, TooFewTokens

log = logging.getLogger("shardtrain")

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
    # A mixture: each dataset's training tokens and its weight, and its validation tokens (empty
    # for one dataset).
    train_parts: list[TokenStream] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    val_parts: list[TokenStream] = field(default_factory=list)
    part_names: list[str] = field(default_factory=list)  # a mixture's datasets, as data.paths names them

    def train_windows(self, seq_len: int, document_mask: bool = False, packing: str = "auto",
                      warn: bool = True) -> TokenWindows | MixtureWindows:
        """The training windows; ``warn`` False for a count alone (``eval``'s check of the data), where
        the truncation warning is training's to give, not a second one beside the validation split's."""
        if not self.train_parts:
            return windows_of(self.train, seq_len, "training data", document_mask, packing, warn)
        parts = [windows_of(part, seq_len, f"training data of {self.part_name(index)}", document_mask,
                            packing, warn)
                 for index, part in enumerate(self.train_parts)]
        return MixtureWindows(parts, self.weights or [part.num_samples for part in parts])

    def val_windows(self, seq_len: int, document_mask: bool = False, what: str = "validation data",
                    packing: str = "auto") -> TokenWindows | InterleavedWindows:
        """The validation windows; a mixture's interleaved, so that the first of them (those an
        evaluation of ``trainer.eval_samples`` reads) sample every dataset whose validation split
        holds a window."""
        if not self.val_parts:
            return windows_of(self.val, seq_len, what, document_mask, packing)
        # Each dataset's packing decided on its own data (a text dataset's stream beside a
        # fine-tuning one's records); a part too small for one window left out.
        parts = []
        for index, part in enumerate(self.val_parts):
            try:
                parts.append(windows_of(part, seq_len, f"{what} of {self.part_name(index)}", document_mask,
                                        packing))
            except TooFewTokens:  # only that: a damaged split is an error (it left validation unsaid)
                continue
        if len(parts) >= 2:
            return InterleavedWindows(parts)
        # Fewer than two hold a window: all of them joined, as one dataset's; but a text dataset
        # joined to a fine-tuning one would be cut into records (auto), each document to one window
        uniform = len({bool(getattr(part, "has_masks", False)) for part in self.val_parts}) == 1
        if parts and not uniform:
            return parts[0]
        return windows_of(self.val, seq_len, what, document_mask, packing)

    def part_name(self, index: int) -> str:
        """The mixture's ``index``-th dataset, by its path where known."""
        return self.part_names[index] if index < len(self.part_names) else f"mixture part {index}"

    def describe(self) -> str:
        return (
            f"{self.root}: {self.train_files} train documents ({self.train.size / 1e6:.1f}M tokens), "
            f"{self.val_files} validation documents ({self.val.size / 1e6:.1f}M tokens); "
            f"tokenizer {self.tokenizer}; prepared at {self.path}"
        )


def windows_of(tokens: TokenStream, seq_len: int, name: str, document_mask: bool,
               packing: str, warn: bool = True) -> TokenWindows:
    """``data.packing``'s windows of ``tokens``: whole records for data with fine-tuning records
    (auto) or when asked, the stream cut every ``seq_len`` tokens otherwise."""
    records = packing == "records" or (packing == "auto" and getattr(tokens, "has_masks", False))
    if not records:
        return TokenWindows(tokens, seq_len, name, document_mask)
    windows = RecordWindows(tokens, seq_len, name, document_mask)
    # once, by rank 0 (every rank packs the same windows), or by a process outside a group (eval)
    if warn and windows.truncated and (not dist.is_initialized() or dist.get_rank() == 0):
        # Plain documents have no answer to lose: said as what they are (found by a trial)
        fine_tuning = getattr(tokens, "has_masks", False)
        kind, lost = ("records", " (a long prompt's answer)") if fine_tuning else ("documents", "")
        log.warning(f"data: {windows.truncated} of the {windows.records} {kind} of the {name} are longer "
                    f"than trainer.seq_len+1={seq_len + 1} tokens: each is cut to one window, the rest of "
                    f"it{lost} not read; raise trainer.seq_len, or set data.packing=stream (windows cut "
                    "anywhere, one running on into the next)")
    return windows


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
    # Resolved as before (the cache key keeps its spelling), but a file's link keeps its own name
    return [resolved_keeping_file_name(Path(p).expanduser()) for p in cfg.paths]


def prepared_path(cfg: DataConfig, tokenizer: Tokenizer) -> Path:
    """The prepared dataset of ``cfg``: given (``prepared``), or prepared into the cache now.

    Every rank of a run may call this at once. In a distributed run one rank walks the inputs and
    prepares while the others wait (``prepare_once``); a lone process takes a lock file, so that
    processes sharing the cache outside one job prepare one at a time."""
    if cfg.source == "prepared":
        return Path(cfg.paths[0]).expanduser()  # load_corpus sends every other count to load_mixture
    options = PrepareOptions(inputs=[str(p) for p in raw_inputs(cfg)], tokenizer=tokenizer.source,
                             text_field=cfg.text_field,
                             file_glob=cfg.file_glob, val_percent=cfg.val_percent,
                             max_bytes=cfg.max_bytes)
    # The whole tokenizer entry: two tokenizers with one vocabulary and other chat templates (a base
    # model's and its instruct model's) would otherwise share an entry, each preparing it again.
    described = {**output_options(options), "tokenizer": tokenizer_entry(tokenizer)}
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]
    out = cache_root(cfg) / key
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        prepare_once(options, out)
    else:
        prepare_locked(options, out)
    return out


# How often ranks that wait for a preparing rank ask whether it is done: a collective per period
# rather than one barrier, since preparing large inputs can outlast the process group's timeout.
POLL_S = 1.0


def prepare_locked(options: PrepareOptions, out: Path, lock_required: bool = True) -> str:
    """Prepare ``options`` into ``out`` under a lock file beside it (nothing to do when it is up to
    date, which takes a walk and a stat of every input file); the dataset's fingerprint.
    ``lock_required`` False: a filesystem without locks is a warning (within a distributed job the
    collectives already let one rank prepare at a time; the lock only guards against other jobs)."""
    lock_path = out.with_name(f".{out.name}{PREPARE_LOCK_SUFFIX}")  # never an input, as prepare's own
    fix = "set data.cache_dir to a directory on a filesystem with file locks" if lock_required else None
    with locked(lock_path, required=fix):
        if out.is_dir() and read_manifest(out) is None:
            # A cache entry without its manifest (written last) is a preparation that was killed
            # half-way; under the lock nobody else writes it, and the cache is ours to redo.
            log.warning(f"data cache: {out} is an unfinished preparation (interrupted); preparing it again")
            shutil.rmtree(out)
        # A cache inside an input directory holds shardtrain's own files (this and other
        # preparations, their locks), which are never inputs.
        return prepare(options, out, progress=False, exclude=(out.parent, lock_path),
                       lock=False).manifest["fingerprint"]


def fingerprint_at(out: Path, check_files: bool = True) -> str | None:
    """The fingerprint of the whole dataset at ``out``; None where there is none, or (``check_files``)
    a shard is missing or of another size than recorded (a rank whose copy has one prepares its
    node's copy again, as rank 0 does its own)."""
    manifest = read_manifest(out)
    if manifest is None or check_files and damaged_files(out, manifest):
        return None
    return manifest.get("fingerprint")


def prepare_once(options: PrepareOptions, out: Path) -> None:
    """Prepare the cache entry ``out`` for every rank of the default process group with as few
    walks of the inputs as the cache allows: rank 0 prepares (a walk and a stat of every input file,
    even when it is up to date) while the others wait, then every rank checks with one read of the
    manifest that it sees rank 0's dataset. On a shared cache that is all: one walk, where every
    rank used to walk in turn under the lock. The default cache is under the home directory, usually
    shared, but ``XDG_CACHE_HOME`` or ``data.cache_dir`` may be node-local: ranks that do not see
    rank 0's dataset then prepare their node's copy, the lowest of them on each host while the
    others wait; a rank that sees neither (a cache directory of its own) then prepares its own, while
    every rank still waits in the same polling (a rank preparing alone outside it would leave the
    others in their next collective until its timeout, and its failure would stop it alone)."""
    rank = dist.get_rank()
    work = lambda: prepare_locked(options, out, lock_required=False)  # noqa: E731
    made = result_of(on_some_ranks(work if rank == 0 else None), 0)
    # The shard files stat'ed by one rank a host (its ranks see the same files), the manifest read
    # by all: every rank stat'ing every shard was millions of metadata calls in one burst on a shared
    # filesystem at 1,024 ranks (found by review). A host's damaged copy is its first rank's to see.
    # (processes started without LOCAL_RANK, a library user's own process group, each check)
    first_of_host = os.environ.get("LOCAL_RANK", "0") == "0"
    seen = made if rank == 0 else fingerprint_at(out, check_files=first_of_host)
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, (socket.gethostname(), seen == made))
    leaders: dict[str, int] = {}
    for other, (host, sees) in enumerate(views):
        if not sees:
            leaders.setdefault(host, other)
    if not leaders:
        return
    leader = leaders.get(views[rank][0])  # None: every rank of this host sees rank 0's dataset
    outcomes = on_some_ranks(work if leader == rank else None)
    node_made = result_of(outcomes, rank if leader is None else leader)
    alone = leader not in (None, rank) and not views[rank][1] and fingerprint_at(out) != node_made
    result_of(on_some_ranks(work if alone else None), rank)


def on_some_ranks(work: Callable[[], str] | None) -> list[tuple[str, str] | None]:
    """Run ``work`` on the ranks given one while every rank waits for all of them; each rank's
    outcome on every rank: ``("done", result)``, ``("error", message)`` (a ``DataError``),
    ``("failed", description)`` (anything else, re-raised as it is on its rank) or None (no work)."""
    outcome: list = [None]
    thread = None
    if work is not None:
        def run() -> None:
            try:
                outcome[0] = ("done", work())
            except DataError as exc:
                outcome[0] = ("error", str(exc))
            except BaseException as exc:  # re-raised on this rank below; the others get one line
                outcome[0] = ("failed", f"{type(exc).__name__}: {exc}")
                outcome.append(exc)

        thread = threading.Thread(target=run, name="shardtrain-prepare", daemon=True)
        thread.start()
    while True:
        if thread is not None:
            thread.join(POLL_S)
        busy = thread is not None and thread.is_alive()
        states: list = [None] * dist.get_world_size()
        dist.all_gather_object(states, "busy" if busy else outcome[0])
        if "busy" not in states:
            break
    if len(outcome) > 1:
        raise outcome[1]
    return states


def result_of(outcomes: list[tuple[str, str] | None], preparer: int) -> str | None:
    """``preparer``'s result; a failure on any rank is raised on every rank as the same line."""
    for other, outcome in enumerate(outcomes):
        if outcome is not None and outcome[0] == "error":
            raise DataError(outcome[1])
        if outcome is not None and outcome[0] == "failed":
            raise DataError(f"rank {other} failed to prepare the data ({outcome[1]}); see its log")
    found = outcomes[preparer]
    return None if found is None else found[1]


SPLIT_NAMES = {"train": "training", "val": "validation"}


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
        if cfg.source != "prepared" and train_docs + val_docs == 1 and len(need) == 2:
            # one text file: one document, whole in one split whatever data.val_percent says
            fix = ("a text file is one document, held out or trained on whole: split it into several "
                   "files, or give JSON Lines, one document a line")
        elif cfg.source != "prepared":
            fix = "add files, raise data.max_bytes, or change data.val_percent"
        elif need == ("val",):  # evaluation reads the validation split alone
            fix = "prepare it again with --val-percent above 0"
        else:
            fix = "prepare it again with more inputs or another --val-percent"
        needs = "both need" if len(need) == 2 else f"the {SPLIT_NAMES[need[0]]} split needs"
        raise DataError(f"data from {roots} gave {train_docs} training and {val_docs} validation "
                        f"documents; {needs} at least one ({fix})")
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
                  train_parts=[d.train for d in datasets], weights=list(cfg.weights),
                  val_parts=[d.val for d in datasets], part_names=[str(d.path) for d in datasets])
