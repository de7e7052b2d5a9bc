"""``shardtrain prepare``: raw inputs -> a prepared dataset that training memory-maps.

Layout of a prepared dataset directory::

    manifest.json                 what it holds and what it was made from (below)
    sources.json                  every source's name, size and modification time (the manifest
                                  holds their count; older manifests hold the entries themselves)
    train/tokens-00000.npy ...    token ids, uint16 when the vocabulary fits, else uint32
    train/docs-00000.npy ...      int64 start offset of each document within its shard
    train/mask-00000.npy ...      uint8, 1 where a token is a training target (only in shards holding
                                  fine-tuning documents; other shards' tokens are all targets)
    val/...                       the same for the validation split

Every document is tokenized, followed by the tokenizer's end-of-text token (the byte tokenizer has
none: documents are back to back), and appended to its split's current shard; a shard holds whole
documents and up to ``shard_tokens`` tokens (one longer document gets a shard of its own). The
manifest records the tokenizer (identity, vocabulary size, end-of-text id), the counts, each shard
file's size, the options and the split, and sources.json every source's size and modification time;
its ``fingerprint`` hashes the sources, the tokenizer's identity (not its path) and the options but
the number of workers (inputs as absolute paths), and ``prepare`` with an unchanged fingerprint and
every file there at its recorded size does nothing.

Workers tokenize batches of documents in separate processes while the main process reads the inputs
and writes the shards in input order, so the output is byte for byte the same for any number of
workers; a worker that dies (killed for memory) stops the run with one line. The directory is
written beside the target, flushed to the disk (files, then directories) and renamed into place when
complete: an interrupted run (or a crash of the machine) never leaves a half-prepared dataset under
the name, and a failed one leaves nothing. The output directory (and what is written beside it) is
never read as an input, even inside an input directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from shardtrain.config.schema import val_percent_problem
from shardtrain.data.documents import (
    PREPARE_LOCK_SUFFIX,
    PREPARED_FORMAT,
    PREPARED_MANIFEST,
    PREPARED_SHARD,
    PREPARED_TOKEN_SHARDS,
    Document,
    Source,
    documents,
    resolve_sources,
)
from shardtrain.data.tokenizer import TOKENIZER_CONFIG_FILE, Tokenizer, load_tokenizer, token_dtype
from shardtrain.durable import fsync_path, write_durably, written_durably
from shardtrain.errors import DataError

log = logging.getLogger("shardtrain")

FORMAT = PREPARED_FORMAT
VERSION = 1
MANIFEST = PREPARED_MANIFEST
# Every source's entry, beside the manifest: inline, a million input files made a 106 MB manifest
# that every rank parsed at start-up. The manifest holds their count.
SOURCES_FILE = "sources.json"
SPLITS = ("train", "val")
SUFFIX_PROBE = "a"  # a text whose encoding shows what a tokenizer appends to every text
SHARD_TOKENS = 1 << 27  # 256 MiB of uint16 per shard file
BATCH_DOCUMENTS = 256  # documents per task sent to a worker, at most
# ... and at most about this much text: what is in flight (workers x BATCHES_AHEAD batches, and
# their token ids) stays bounded when the documents are large (a corpus of whole books).
BATCH_BYTES = 8 << 20
BATCHES_AHEAD = 2  # per worker: batches read and queued while the writer waits for the oldest


@dataclass
class PrepareOptions:
    inputs: list[str]
    tokenizer: str = "bytes"  # "bytes", or a tokenizer.json / model directory
    text_field: str = "text"  # JSON Lines field, Parquet or Arrow column
    file_glob: str = "*"  # files taken from input directories
    val_percent: float = 5.0  # documents (by a hash of their key) held out for validation
    max_bytes: int = 0  # stop reading after this many bytes of text (0 = everything)
    shard_tokens: int = SHARD_TOKENS
    workers: int = field(default=1, metadata={"output": False})  # never changes the output


@dataclass
class PrepareResult:
    manifest: dict
    up_to_date: bool  # nothing was done: the dataset was already prepared from these inputs
    seconds: float = 0.0


def is_validation(key: str, val_percent: float) -> bool:
    # Rounded: in floats 0.07 * 100 is 7.000000000000001, which let an eighth bucket in. A key holds
    # a file's name, whose bytes need not be UTF-8 on Linux (Python keeps them as lone surrogates,
    # which a plain encode refused with a traceback: found by review); a UTF-8 name's bytes, and so
    # its split, are as before.
    return zlib.crc32(key.encode("utf-8", "surrogateescape")) % 10_000 < round(val_percent * 100, 6)


def output_options(options: PrepareOptions) -> dict:
    """The options that decide the output (all but the number of workers)."""
    return {k: v for k, v in asdict(options).items()
            if PrepareOptions.__dataclass_fields__[k].metadata.get("output", True)}


def end_of_text(tokenizer: Tokenizer, suffix: list[int]) -> list[int]:
    """What follows every document after the tokenizer's own ``suffix`` (``appended_tokens``): its
    end-of-text token, if it has one and the suffix does not end with it already (a T5 tokenizer's
    post-processor, or a Llama tokenizer saved with ``add_eos_token``, appends it to every text: it
    was doubled, found by review)."""
    if tokenizer.eos_id is None or suffix[-1:] == [tokenizer.eos_id]:
        return []
    return [tokenizer.eos_id]


def appended_tokens(tokenizer: Tokenizer) -> list[int]:
    """The special tokens the tokenizer puts after every text's own (most put none)."""
    plain = tokenizer.encode(SUFFIX_PROBE, special_tokens=False)
    marked = tokenizer.encode(SUFFIX_PROBE)
    if not plain:  # a vocabulary without the probe (and no unknown token): nothing to tell by
        return []
    for start in range(len(marked) - len(plain) + 1):
        if marked[start:start + len(plain)] == plain:
            return list(marked[start + len(plain):])
    return []


def no_end_of_text(tokenizer: Tokenizer) -> str | None:
    """The warning for a Hugging Face tokenizer whose settings name no end-of-text token: the
    documents then run into each other with nothing between them (the byte tokenizer's way, which
    data.md states; for a tokenizer.json copied without its tokenizer_config.json, an accident)."""
    if tokenizer.eos_id is not None or tokenizer.name == "bytes":
        return None
    held = getattr(tokenizer, "unnamed_end_tokens", [])
    settings = getattr(tokenizer, "config_file", TOKENIZER_CONFIG_FILE)
    fix = (f'add "eos_token": "{held[0]}" (in its vocabulary) to {settings}' if held else
           f"name its end-of-text token as eos_token in {settings}")
    return (f"data: the tokenizer {tokenizer.source} names no end-of-text token (no eos_token in "
            f"{TOKENIZER_CONFIG_FILE}): documents follow each other with nothing between them, and "
            f"generation stops only at its length; {fix}, then prepare again")


def fingerprint(options: PrepareOptions, source_entries: list[dict], tokenizer: Tokenizer) -> str:
    """What the output is made from. Inputs count as absolute paths (``t/in.jsonl``,
    ``./t/in.jsonl`` and ``$PWD/t/in.jsonl`` are one input; a pattern stays a pattern), and the
    tokenizer by ``tokenizer_entry`` alone: its path as typed (``DIR`` or ``DIR/tokenizer.json``)
    prepared everything again."""
    described_options = output_options(options)
    described_options["inputs"] = [os.path.abspath(Path(entry).expanduser()) for entry in options.inputs]
    del described_options["tokenizer"]
    described = {"format": FORMAT, "version": VERSION, "options": described_options,
                 "tokenizer": tokenizer_entry(tokenizer), "sources": source_entries,
                 # 2: the validation split rounds val_percent * 100 (0.07 held out 0.08%), and inputs
                 # are normalised as above. 3: a prompt and its completion are tokenized together
                 # (encode_pair). Every dataset of an earlier recipe is prepared again once.
                 "recipe": 3}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def tokenizer_entry(tokenizer: Tokenizer) -> dict:
    """What of the tokenizer the tokens depend on: its vocabulary (by ``name``, a digest of it), the
    end-of-text id appended to every document, and the chat template and BOS token that render
    fine-tuning conversations (tokenizer.json alone left a changed template's cache in use)."""
    template = getattr(tokenizer, "chat_template", None)
    digest = None if template is None else hashlib.sha256(template.encode()).hexdigest()[:16]
    entry = {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
             "chat_template": digest, "bos_token": getattr(tokenizer, "bos_token", None)}
    if suffix := appended_tokens(tokenizer):
        # Prepared before the end of text was appended once, its documents held two (and a prompt
        # its end before the completion): a fingerprint of its own prepares them again.
        entry["appended"] = suffix
    if template is not None and any(word in template for word in ("tools", "documents", "tojson")):
        # Rendered before tools=None and transformers' tojson were passed, a template that tests
        # `tools is not none` wrote an empty tool list into every record: prepared again once (only
        # where the template reads them: the others render as before)
        entry["template_context"] = 2
    if getattr(tokenizer, "reads_specials_as_text", False):
        # Prepared before a document's text spelling a special token was read as text, such text
        # was that token: a fingerprint of its own prepares them again (a tokenizer without special
        # tokens, the byte-level one among them, reads the same ids either way)
        entry["specials_as_text"] = True
    if getattr(tokenizer, "file_truncates", False):
        # Prepared before its truncation and padding were turned off, its documents were cut: a
        # fingerprint of its own prepares them again (every other tokenizer's stays as it was).
        entry["truncation_off"] = True
    return entry


def save_durably(path: Path, array: np.ndarray) -> int:
    """``array`` saved as ``path`` (.npy) and flushed to the disk; its size in bytes. Without the
    flush, a crash after the rename into place could leave the manifest naming empty files."""
    with written_durably(path) as file:
        np.save(file, array)
        size = file.tell()
    return size


class ShardWriter:
    """One split's shards: whole documents, up to ``limit`` tokens per shard."""

    def __init__(self, directory: Path, dtype: type, limit: int) -> None:
        self.directory = directory
        self.dtype = dtype
        self.limit = limit
        self.parts: list[np.ndarray] = []
        self.masks: list[np.ndarray | None] = []
        self.buffered = 0
        self.shards: list[dict] = []
        self.documents = 0
        self.tokens = 0
        self.masked = False  # whether any document marks which of its tokens are targets
        self.targets = 0  # tokens a document marks as targets (all of one that marks none)

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        if self.buffered and self.buffered + len(ids) > self.limit:
            self.flush()
        self.parts.append(ids)
        self.masks.append(mask)
        self.buffered += len(ids)
        self.masked |= mask is not None
        self.targets += len(ids) if mask is None else int(np.count_nonzero(mask))

    def flush(self) -> None:
        if not self.parts:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        index = len(self.shards)
        lengths = np.fromiter((len(p) for p in self.parts), dtype=np.int64, count=len(self.parts))
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        tokens_file, docs_file = (PREPARED_SHARD.format(kind=kind, index=index)
                                  for kind in ("tokens", "docs"))
        split = self.directory.name
        sizes = {"tokens_file": save_durably(self.directory / tokens_file,
                                             np.concatenate(self.parts).astype(self.dtype, copy=False)),
                 "docs_file": save_durably(self.directory / docs_file, starts)}
        shard = {"tokens_file": f"{split}/{tokens_file}", "docs_file": f"{split}/{docs_file}",
                 "tokens": int(lengths.sum()), "documents": len(lengths)}
        if any(mask is not None for mask in self.masks):
            mask_file = PREPARED_SHARD.format(kind="mask", index=index)
            sizes["mask_file"] = save_durably(self.directory / mask_file, np.concatenate([
                mask if mask is not None else np.ones(len(ids), dtype=np.uint8)
                for ids, mask in zip(self.parts, self.masks)]))
            shard["mask_file"] = f"{split}/{mask_file}"
        # What the up-to-date check compares each file with: a file cut short (a full disk, a copy
        # that stopped) keeps its name, and only its size tells it from a whole one.
        shard["bytes"] = sizes
        self.shards.append(shard)
        self.documents += len(lengths)
        self.tokens += int(lengths.sum())
        self.parts, self.masks, self.buffered = [], [], 0

    def entry(self) -> dict:
        self.flush()
        return {"documents": self.documents, "tokens": self.tokens, "shards": self.shards}


# Each worker process loads the tokenizer once (it is a path, not a pickled object).
_worker_tokenizer: Tokenizer | None = None


def _start_worker(source: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(source)


# The split of each document, the document, and its key (file and line: what an error names).
Batch = tuple[list[str], list[Document], list[str]]
# ids and target mask (or None) of each document, and the conversations scored on their last turn
Encoded = tuple[list[str], list[tuple[np.ndarray, np.ndarray | None]], int, list[str]]


def encode_pair(tokenizer: Tokenizer, record: dict,
                suffix: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Prompt then completion; only the completion (and the end of text after it) are targets.

    Tokenized together, as the model reads them at inference, the completion's tokens being what
    follows the prompt's own: tokenized apart, a SentencePiece tokenizer that prepends "▁" to every
    text put one before each completion (" four" after "Answer:" became "▁▁four"), which the model
    then learnt to emit. Where the prompt's last tokens merge with the completion's first (a prompt
    ending in a space before a word), the two are tokenized apart, so that no target starts inside
    the prompt."""
    suffix = appended_tokens(tokenizer) if suffix is None else suffix
    prompt = tokenizer.encode(record["prompt"])
    if suffix and prompt[-len(suffix):] == suffix:  # what the tokenizer appends ends the whole only
        prompt = prompt[:-len(suffix)]
    whole = tokenizer.encode(record["prompt"] + record["completion"])
    completion = (whole[len(prompt):] if whole[:len(prompt)] == prompt
                  else tokenizer.encode(record["completion"], special_tokens=False) + suffix)
    tail = end_of_text(tokenizer, suffix)
    return prompt + completion + tail, [0] * len(prompt) + [1] * (len(completion) + len(tail))


def encode_chat(tokenizer: Tokenizer, messages: list[dict]) -> tuple[list[int], list[int], bool]:
    """The conversation in the model's chat template; the assistant's turns are the targets, found
    by rendering the conversation up to each turn (with and without it) and tokenizing both.

    A template may render an earlier turn otherwise in a prefix than in the whole (Qwen3's drops the
    reasoning of assistant turns before the last user message): such a conversation is scored on
    its last assistant turn alone, which every template renders the same in both (the third value
    says so; ``encode`` counts them); where even that one cannot be located, it is an error."""
    ids = tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=False),
                           special_tokens=False)
    mask = [0] * len(ids)
    turns = [turn for turn, message in enumerate(messages) if message["role"] == "assistant"]
    spans = []
    for turn in turns:
        before = tokenizer.encode(tokenizer.render_chat(messages[:turn], add_generation_prompt=True),
                                  special_tokens=False)
        through = tokenizer.encode(
            tokenizer.render_chat(messages[:turn + 1], add_generation_prompt=False), special_tokens=False)
        spans.append((len(before), len(through))
                     if ids[:len(through)] == through and through[:len(before)] == before else None)
    if turns and spans[-1] is None:
        named = getattr(tokenizer, "source", tokenizer.name)
        raise DataError(f"the chat template of {named} does not tokenize the conversation up to "
                        f"its last assistant turn (message {turns[-1] + 1}) as the start of the whole; its "
                        "assistant turns cannot be located: give each turn to be trained as a record of its "
                        "own ending with it, or use a template that renders it so")
    last_only = None in spans
    for start, stop in spans[-1:] if last_only else spans:
        mask[start:stop] = [1] * (stop - start)
    # The template ends turns; the separator is no target. A template that ends the conversation
    # with the end-of-text token itself (Llama 2's, Mistral's: "</s>") had it doubled.
    # (Rendered text is encoded without the tokenizer's appended tokens: none to count.)
    tail = end_of_text(tokenizer, []) if not ids or ids[-1] != tokenizer.eos_id else []
    return ids + tail, mask + [0] * len(tail), last_only


def encode(tokenizer: Tokenizer, batch: Batch) -> Encoded:
    """Token ids of each document, with the end-of-text token after it, and for fine-tuning
    documents which tokens are targets; how many conversations were scored on their last assistant
    turn alone (``encode_chat``); and the keys of the text documents that spell a special token of
    the tokenizer (read as text: ``HFTokenizer.encode_documents``)."""
    splits, docs, keys = batch
    dtype = token_dtype(tokenizer.vocab_size)
    suffix = appended_tokens(tokenizer)
    tail = end_of_text(tokenizer, suffix)
    texts = [doc for doc in docs if isinstance(doc, bytes)]
    plain = iter(tokenizer.encode_documents(texts)) if texts else iter(())
    out: list[tuple[np.ndarray, np.ndarray | None]] = []
    last_turn_only = 0
    spelling = getattr(tokenizer, "spells_special", None)
    spelled = [key for doc, key in zip(docs, keys) if isinstance(doc, bytes) and spelling and spelling(doc)]
    for doc, key in zip(docs, keys):
        if isinstance(doc, bytes):
            out.append((np.concatenate([np.asarray(next(plain), dtype=dtype), np.asarray(tail, dtype=dtype)]),
                        None))
            continue
        try:
            if "messages" in doc:
                ids, mask, last_only = encode_chat(tokenizer, doc["messages"])
                last_turn_only += last_only
            else:
                ids, mask = encode_pair(tokenizer, doc, suffix)
        except DataError as exc:  # the template's own error (a role it refuses): which record
            raise DataError(f"{key}: {exc}") from exc
        out.append((np.asarray(ids, dtype=dtype), np.asarray(mask, dtype=np.uint8)))
    return splits, out, last_turn_only, spelled


def _encode_in_worker(batch: Batch) -> Encoded:
    return encode(_worker_tokenizer, batch)


def encoded_in_workers(pool: ProcessPoolExecutor, work: Iterable[Batch], ahead: int) -> Iterator[Encoded]:
    """``work`` encoded by ``pool``, in input order, at most ``ahead`` batches in flight (reading
    never runs further ahead of writing than that, so memory does not grow with the input). A worker
    that dies breaks the pool, and every waiting result raises, where ``Pool.imap`` waited forever."""
    pending: deque[Future] = deque()
    try:
        for batch in work:
            pending.append(pool.submit(_encode_in_worker, batch))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool as exc:
        raise DataError("a tokenizing worker process died (most likely killed by the system for lack "
                        "of memory: see dmesg); prepare again with fewer --workers") from exc
    finally:
        for future in pending:
            future.cancel()


@dataclass
class Reading:
    """What ``batches`` has read: documents, and bytes of their text."""

    documents: int = 0
    bytes: int = 0
    conversations: int = 0  # fine-tuning records of messages, rendered with the chat template
    spelled_special: int = 0  # text documents that spell a special token of the tokenizer


def batches(sources: list[Source], options: PrepareOptions, bar: tqdm, reading: Reading) -> Iterator[Batch]:
    """(split of each document, its text) in input order, BATCH_DOCUMENTS or BATCH_BYTES at a time."""
    splits: list[str] = []
    texts: list[Document] = []
    keys: list[str] = []
    batch_bytes = 0
    for source in sources:
        for key, text in documents(source, options.text_field):
            splits.append("val" if is_validation(key, options.val_percent) else "train")
            texts.append(text)
            keys.append(key)
            size = len(text) if isinstance(text, bytes) else len(json.dumps(text))
            reading.documents += 1
            reading.conversations += isinstance(text, dict) and "messages" in text
            reading.bytes += size
            batch_bytes += size
            bar.update(1)
            if len(texts) == BATCH_DOCUMENTS or batch_bytes >= BATCH_BYTES:
                yield splits, texts, keys
                splits, texts, keys, batch_bytes = [], [], [], 0
            if options.max_bytes and reading.bytes >= options.max_bytes:
                break
        if options.max_bytes and reading.bytes >= options.max_bytes:
            break
    if texts:
        yield splits, texts, keys


def absent(names: Iterable[str], listing: Callable[[str], set[str]]) -> list[str]:
    """The ``names`` (relative, '/'-separated) that ``listing`` (a folder's file names; '' for the
    top) does not hold, in order: one listing a folder, where a check of each name would stat
    every shard."""
    listed: dict[str, set[str]] = {}
    gone = []
    for name in names:
        parent, _, base = name.rpartition("/")
        if parent not in listed:
            listed[parent] = listing(parent)
        if base not in listed[parent]:
            gone.append(name)
    return gone


SHARD_FILES = ("tokens_file", "docs_file", "mask_file")


def damaged_files(directory: Path, manifest: dict) -> list[str]:
    """What is wrong with the files ``manifest`` names (shards, and the sources file), in order:
    each one ``directory`` lacks ("NAME missing") or whose size is not the one recorded ("NAME: 1000
    of 2048 bytes"). A manifest without sizes (written before they were recorded) is checked by
    name alone. One listing of each directory, and one stat of each file whose size is recorded."""
    expected: list[tuple[str, int | None]] = []  # name, recorded size
    for split in SPLITS:
        for shard in manifest.get("splits", {}).get(split, {}).get("shards", []):
            sizes = shard.get("bytes") or {}
            expected += [(shard[key], sizes.get(key)) for key in SHARD_FILES if shard.get(key)]
    if isinstance(recorded := manifest.get("sources"), dict) and isinstance(recorded.get("file"), str):
        expected.append((recorded["file"], recorded.get("bytes")))
    listed: dict[str, dict[str, os.DirEntry]] = {}
    damaged = []
    for name, recorded_size in expected:
        parent, _, base = name.rpartition("/")
        if parent not in listed:
            try:
                with os.scandir(directory / parent) as found:
                    listed[parent] = {entry.name: entry for entry in found}
            except OSError:
                listed[parent] = {}
        entry = listed[parent].get(base)
        try:
            present = entry is not None and entry.is_file()
            size = entry.stat().st_size if present and recorded_size is not None else None
        except OSError:  # gone since the listing
            present = False
        if not present:
            damaged.append(f"{name} missing")
        elif size != recorded_size:
            damaged.append(f"{name}: {size} of {recorded_size} bytes")
    return damaged


def recorded_sources(directory: Path, manifest: dict) -> list[dict]:
    """The source entries of the dataset at ``directory``: from its sources file, or inline in a
    manifest written before they had a file of their own."""
    recorded = manifest.get("sources")
    if isinstance(recorded, list):
        return recorded
    if not (isinstance(recorded, dict) and isinstance(recorded.get("file"), str)):
        raise DataError(f"{directory / MANIFEST} names no sources: the prepared dataset is damaged; "
                        "prepare it again")
    path = directory / recorded["file"]
    try:
        entries = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or type(exc).__name__
        raise DataError(f"{path} cannot be read ({why}): the prepared dataset is damaged; prepare it "
                        "again") from exc
    if not isinstance(entries, list):
        raise DataError(f"{path} holds a {type(entries).__name__}, not a list of sources: the prepared "
                        "dataset is damaged; prepare it again")
    return entries


def read_manifest(directory: Path) -> dict | None:
    try:
        manifest = json.loads((directory / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def prepare(options: PrepareOptions, out: str | Path, progress: bool = True,
            exclude: Iterable[Path] = (), lock: bool = True) -> PrepareResult:
    """Prepare ``options.inputs`` into ``out`` (nothing to do when it is already prepared from them
    and whole).

    ``out``, its staging and replaced siblings, its lock and ``exclude`` are never read as inputs:
    an output inside an input directory would otherwise be tokenized into the next preparation.
    ``lock``: under a lock file beside ``out``, so that preparations of one output (``prepare``
    started on every node of a job) run one after the other, the later ones finding it up to date;
    they shared one staging directory, and each deleted the other's shards. False: the caller holds
    a lock of its own (the data cache's)."""
    if problem := val_percent_problem(options.val_percent):
        raise DataError(f"{problem} (--val-percent, data.val_percent)")
    # Absolute, so that ".", ".." and "a/.." have a name to put the staging directory beside.
    out = Path(os.path.abspath(Path(out).expanduser()))
    if not out.name:
        raise DataError(f"the output {out} has no name (a dataset is written beside its directory and "
                        "renamed into place); choose a directory to create")
    if out.is_symlink():  # the dataset goes where the link points, and the link stays (renamed aside,
        out = out.resolve()  # the link was replaced by a directory and its removal failed)
    if out.exists() and not out.is_dir():
        raise DataError(f"{out} is a file, not a directory; choose another output directory")
    lock_path = out.with_name(f".{out.name}{PREPARE_LOCK_SUFFIX}")
    exclude = [*exclude, lock_path]
    if not lock:
        return prepare_unlocked(options, out, progress, exclude)
    # Up to date: nothing is written, not even the lock (a dataset on a read-only share, another
    # user's); else under the lock, where a preparation that finished meanwhile is found up to date.
    # The inputs are listed once for both (their warnings were said twice: found by review).
    tokenizer = load_tokenizer(options.tokenizer)  # its errors before the inputs'
    sources = input_sources(options, out, exclude)
    if (current := prepare_unlocked(options, out, progress, exclude, check_only=True,
                                    sources=sources, tokenizer=tokenizer)) is not None:
        return current
    with locked(lock_path):
        return prepare_unlocked(options, out, progress, exclude, sources=sources, tokenizer=tokenizer)


def input_sources(options: PrepareOptions, out: Path, exclude: list[Path]) -> list[Source]:
    """The inputs' files, never ``out``, its staging and replaced siblings, or ``exclude``."""
    return resolve_sources(options.inputs, options.file_glob, [out, *output_siblings(out), *exclude],
                           options.text_field)


def output_siblings(out: Path) -> tuple[Path, Path]:
    """Where a preparation of ``out`` is staged, and where the dataset it replaces is put aside."""
    return out.with_name(f".{out.name}.preparing"), out.with_name(f".{out.name}.replaced")


@contextmanager
def locked(path: Path, required: str | None = None) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created) for the block. Where the filesystem has no
    ``flock``: with ``required`` (what to do instead), a ``DataError`` saying so; else a warning,
    and the block runs unlocked. A lock file that cannot be created is the filesystem's error (the
    CLI's one line for those: a full disk, a path under a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held: said, so that a wait behind a stopped one is not silent
                log.info(f"data: waiting for another preparation of the same output to finish (it holds "
                         f"{path})")
                fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as exc:
            if required:
                raise DataError(f"cannot lock {path} ({exc.strerror or exc}); {required}") from exc
            log.warning(f"data: cannot lock {path} ({exc.strerror or exc}): another preparation of the "
                        "same output at the same time would spoil it")
        yield


def prepare_unlocked(options: PrepareOptions, out: Path, progress: bool, exclude: list[Path],
                     check_only: bool = False, sources: list[Source] | None = None,
                     tokenizer: Tokenizer | None = None) -> PrepareResult | None:
    """``prepare``'s work; ``check_only``: the result if ``out`` is up to date, else None.
    ``sources``: the inputs' files (``input_sources``), and ``tokenizer``, when read already."""
    tokenizer = load_tokenizer(options.tokenizer) if tokenizer is None else tokenizer
    staging, aside = output_siblings(out)
    sources = input_sources(options, out, exclude) if sources is None else sources
    source_entries = [s.fingerprint() for s in sources]  # every input file's size and mtime, once
    digest = fingerprint(options, source_entries, tokenizer)
    existing = read_manifest(out)
    if existing is not None and existing.get("fingerprint") == digest:
        if not (damaged := damaged_files(out, existing)):
            return PrepareResult(existing, up_to_date=True)
        if check_only:
            return None
        # Ours, and named "prepare it again" by the reader that found it so: done here.
        log.warning(f"data: {out} is prepared but damaged ({', '.join(damaged[:3])}); preparing it again")
    manifest_lost = out.exists() and existing is None and any(out.iterdir())
    if manifest_lost and (not_prepared_here(out) or not holds_token_shards(out)):
        unreadable = f" (its {MANIFEST} cannot be read)" if (out / MANIFEST).exists() else ""
        raise DataError(f"{out} exists and is not a prepared dataset{unreadable}; choose another output "
                        "directory")
    if existing is not None and (foreign := not_prepared_here(out)):
        # Replacing the dataset deletes the directory: a run's checkpoints kept in it (run.dir named
        # the dataset) went with it without a word.
        raise DataError(f"{out} is a prepared dataset that also holds what prepare did not write "
                        f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}), which preparing "
                        "it again would delete; move those out, or choose another output directory")
    if check_only:
        return None
    if manifest_lost:
        # What the reader that found it says ("prepare it again") is done here: it was refused as
        # not a prepared dataset (found by review).
        log.warning(f"data: {out} holds a prepared dataset's shards but no readable {MANIFEST} (a copy "
                    "or a preparation cut short); preparing it again")

    if (unseparated := no_end_of_text(tokenizer)) is not None:
        log.warning(unseparated)
    started = time.perf_counter()
    shutil.rmtree(staging, ignore_errors=True)
    try:
        # Made now, so that an output that cannot be written fails before the inputs are read.
        staging.mkdir(parents=True)
    except OSError as exc:
        raise DataError(f"cannot create {staging} ({exc.strerror or exc}); choose an output directory "
                        "in a writable directory") from exc
    try:
        manifest = write_staging(options, sources, source_entries, digest, tokenizer, staging, progress)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a failed preparation leaves nothing behind
        raise
    # An old dataset a crash left aside (between the two renames below) goes too.
    shutil.rmtree(aside, ignore_errors=True)
    # The new directory's entries reach the disk before its name does: a crash after the rename
    # must not leave a dataset whose files were never listed.
    for split in SPLITS:
        if (staging / split).is_dir():
            fsync_path(staging / split)
    fsync_path(staging)
    if out.exists():
        # Renamed aside before it is deleted: a crash part-way through deleting the old dataset
        # must not leave a directory at ``out`` that holds half of it.
        out.rename(aside)
        staging.rename(out)
        shutil.rmtree(aside)
    else:
        staging.rename(out)
    try:
        fsync_path(out.parent)  # the rename itself
    except OSError as exc:  # the dataset is whole and in place: only its durability is in doubt
        log.warning(f"data: {out} is prepared, but {out.parent} could not be flushed to the disk "
                    f"({exc.strerror or exc}); a crash of the machine now may lose the rename")
    return PrepareResult(manifest, up_to_date=False, seconds=time.perf_counter() - started)


def holds_token_shards(directory: Path) -> bool:
    return any(next((directory / split).glob(PREPARED_TOKEN_SHARDS), None) for split in SPLITS)


# What file browsers leave in a directory they showed: nobody's data, deleted with the dataset.
BROWSER_LITTER = (".DS_Store", "Thumbs.db", "desktop.ini")


def not_prepared_here(directory: Path) -> list[str]:
    """The entries of a prepared dataset's ``directory`` that ``prepare`` does not write (nor a
    file browser: a Finder's ``.DS_Store`` and its ``._`` AppleDouble files), sorted."""
    return sorted(entry.name for entry in directory.iterdir()
                  if entry.name not in (MANIFEST, SOURCES_FILE, *SPLITS, *BROWSER_LITTER)
                  and not (entry.name.startswith("._") and entry.is_file()))


def write_staging(options: PrepareOptions, sources: list[Source], source_entries: list[dict], digest: str,
                  tokenizer: Tokenizer, staging: Path, progress: bool) -> dict:
    """Every document's tokens into shards under ``staging``, then the manifest; the manifest."""
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {split: ShardWriter(staging / split, dtype, options.shard_tokens) for split in SPLITS}
    reading = Reading()
    with tqdm(desc="prepare", unit=" docs", disable=not progress, leave=False) as bar, ExitStack() as stack:
        work = batches(sources, options, bar, reading)
        if options.workers > 1:
            pool = stack.enter_context(ProcessPoolExecutor(
                options.workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker, initargs=(options.tokenizer,)))
            results = encoded_in_workers(pool, work, ahead=BATCHES_AHEAD * options.workers)
        else:
            results = (encode(tokenizer, batch) for batch in work)
        last_turn_only, spelled = 0, []
        for splits, encoded, last_only, spelling in results:
            last_turn_only += last_only
            spelled += spelling[:3 - len(spelled)]  # the first three named
            reading.spelled_special += len(spelling)
            for split, (ids, mask) in zip(splits, encoded):
                writers[split].add(ids, mask)
    if reading.spelled_special:
        # (found by the diff review: pre-rendered chat text lost its markers' tokens without a word)
        more = ", ..." if len(spelled) < reading.spelled_special else ""
        log.warning(f"data: {reading.spelled_special} text document(s) spell special tokens of "
                    f"{getattr(tokenizer, 'source', tokenizer.name)} ({', '.join(spelled)}{more}), read as "
                    "text (a quoted <|endoftext|> is no end of text); a conversation belongs in records of "
                    "`messages`, which the chat template renders with its tokens and trains on its answers")
    if last_turn_only:
        named = getattr(tokenizer, "source", tokenizer.name)
        log.warning(f"data: {last_turn_only} of {reading.conversations} conversations are trained on their "
                    f"last assistant turn alone: the chat template of {named} renders their earlier "
                    "turns otherwise in a prefix than in the whole (Qwen3's drops earlier turns' "
                    "reasoning), so those cannot be located; give each turn to be trained as a record "
                    "of its own ending with it")
    inputs = ", ".join(options.inputs)
    if not reading.documents:
        raise DataError(f"{inputs}: no documents (the input is empty)")
    if not reading.bytes:
        raise DataError(f"{inputs}: no text (the input is empty: {reading.documents} empty document(s))")
    entries = {split: writer.entry() for split, writer in writers.items()}
    train = writers["train"]
    if train.masked and train.documents and not train.targets:
        # Every step would find nothing to learn from (val_loss NaN too), skipped until the run stops.
        raise DataError(f"{inputs}: no token to train on: the records' completions (or assistant turns) "
                        "are all empty, and their prompts are not targets; give the records answers")
    # Before the manifest, which names it: a manifest is there only when all it names is.
    sources_bytes = write_durably(staging / SOURCES_FILE,
                                  (json.dumps(source_entries, indent=0) + "\n").encode())
    manifest = {
        "format": FORMAT, "version": VERSION, "fingerprint": digest,
        "tokenizer": tokenizer_entry(tokenizer), "dtype": np.dtype(dtype).name,
        "options": output_options(options),
        "sources": {"file": SOURCES_FILE, "count": len(source_entries), "bytes": sources_bytes},
        "splits": entries,
        # Whether the tokens depend on the chat template (a reader checks its model's only then:
        # prompt/completion records render none)
        "conversations": reading.conversations,
    }
    write_durably(staging / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest
