"""Reading a prepared dataset (``data/prepare.py``): each split's shards memory-mapped as one token
stream, so a process's resident memory does not grow with the dataset, only with what it reads.

Shard files are opened when first read, through one bounded cache of memory maps per process
(``OPEN_SHARD_FILES``), and sizes come from the manifest: opening a dataset reads its manifest and
lists its split directories, never a shard, and a process's open descriptors do not grow with the
number of shards (each map holds one: an unbounded set exhausts the common 1,024-descriptor limit
at about 100B tokens, and makes every rank open every shard on the filesystem's metadata server at
start-up)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardtrain.data.prepare import FORMAT, MANIFEST, SPLITS, VERSION, absent, tokenizer_entry
from shardtrain.data.tokenizer import Tokenizer
from shardtrain.errors import DataError

log = logging.getLogger("shardtrain")

# Shard files (tokens, document starts, target masks) a process keeps memory-mapped at once, over
# all the datasets it reads. Each holds a descriptor, so this bounds the data's share of the
# process's limit (often 1,024, shared with sockets); a random window of a dataset with more files
# than this opens its shard again (one open and one map per window in the worst case).
OPEN_SHARD_FILES = 128

# A .npy file's header readers by format version (np.save writes 1.0, or 2.0 for huge headers).
HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


class DatasetDirectory:
    """A prepared dataset's directory, held open: shards are opened relative to it, so a run keeps
    reading the directory it started with even if the path is renamed or prepared again (its old
    files then fail to open, with a line saying so, instead of mixing two preparations)."""

    _ids = itertools.count()

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.id = next(self._ids)
        # Dropping the dataset releases its maps at once rather than when the cache evicts them.
        weakref.finalize(self, _release, self.id, self.fd)

    def listing(self, parent: str) -> set[str]:
        """The regular files (or links to them) directly inside ``parent`` ('' for the directory
        itself): one directory read where a check of each name would stat every shard."""
        try:
            fd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return set()
        try:
            with os.scandir(fd) as entries:
                return {entry.name for entry in entries if entry.is_file()}
        finally:
            os.close(fd)

    def missing(self, names: list[str]) -> list[str]:
        """The ``names`` (relative, '/'-separated) that are not files, in order."""
        return absent(names, self.listing)

    def map(self, name: str, dtype: np.dtype | None, length: int) -> np.memmap:
        """``name`` memory-mapped (what ``np.load(mmap_mode="r")`` returns), checked against the
        manifest's ``length`` (and ``dtype`` when given), since offsets are computed from it."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            raise DataError(f"{self.path}: {name} is gone (the dataset was deleted or prepared again "
                            "while this process read it); restart on the new data") from None
        # The map keeps its own descriptor; this one is closed on leaving.
        with open(fd, "rb") as file:
            try:
                version = np.lib.format.read_magic(file)
                if version not in HEADER_READERS:
                    raise ValueError(f".npy format version {version[0]}.{version[1]}")
                shape, fortran, found = HEADER_READERS[version](file)
                array = np.memmap(file, dtype=found, mode="r", shape=shape, offset=file.tell(),
                                  order="F" if fortran else "C")
            except (ValueError, OSError) as exc:
                raise DataError(f"{self.path}: {name} is not a readable .npy file ({exc}); prepare the "
                                "dataset again") from None
        if len(array) != length or (dtype is not None and array.dtype != dtype):
            raise DataError(f"{self.path}: {name} holds {len(array)} values of {array.dtype} but "
                            f"{MANIFEST} says {length}{'' if dtype is None else f' of {dtype}'}; "
                            "prepare the dataset again")
        return array


class ShardMaps:
    """The process's open shard files: a least-recently-used cache of at most ``limit`` memory
    maps, shared by every dataset and thread (batches are made ahead in a background thread while
    evaluation reads in the main one). A map the cache drops stays valid for as long as an array
    handed out from it lives: only the cache's own reference goes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.maps: OrderedDict[tuple[int, str], np.memmap] = OrderedDict()
        # Re-entrant: a dataset dropped by a garbage collection that runs inside ``get`` forgets
        # its maps from the same thread.
        self.lock = threading.RLock()

    def get(self, directory: DatasetDirectory, name: str, dtype: np.dtype | None,
            length: int) -> np.memmap:
        key = (directory.id, name)
        with self.lock:
            array = self.maps.get(key)
            if array is not None:
                self.maps.move_to_end(key)
                return array
            array = directory.map(name, dtype, length)
            self.maps[key] = array
            while len(self.maps) > self.limit:
                self.maps.popitem(last=False)
            return array

    def forget(self, directory_id: int) -> None:
        with self.lock:
            for key in [key for key in self.maps if key[0] == directory_id]:
                del self.maps[key]


SHARD_MAPS = ShardMaps(OPEN_SHARD_FILES)


def _release(directory_id: int, fd: int) -> None:
    SHARD_MAPS.forget(directory_id)
    os.close(fd)


@dataclass(frozen=True)
class Shard:
    """One shard of a split as its manifest describes it; its files are mapped when read."""

    directory: DatasetDirectory
    tokens_file: str
    docs_file: str
    mask_file: str | None  # fine-tuning shards only; None: every token is a target
    tokens: int
    documents: int
    dtype: np.dtype  # its dataset's token dtype: a mixture's datasets may hold others


class TokenStream:
    """A split's tokens, shard after shard, read through memory maps. Supports ``len`` and slicing
    with a step of 1 (a slice across a shard boundary is joined into one array)."""

    def __init__(self, directory: DatasetDirectory, entry: dict, dtype: np.dtype,
                 vocab_size: int | None = None) -> None:
        self.shards = [Shard(directory, shard["tokens_file"], shard["docs_file"], shard.get("mask_file"),
                             int(shard["tokens"]), int(shard["documents"]), np.dtype(dtype))
                       for shard in entry["shards"]]
        self.documents = int(entry["documents"])
        self.vocab_size = vocab_size  # the tokenizer's: no id read may reach it (a damaged shard)
        self._index()

    def _index(self) -> None:
        sizes = [shard.tokens for shard in self.shards]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.has_masks = any(shard.mask_file is not None for shard in self.shards)
        # The widest of its shards' (a mixture of uint16 and uint32 datasets read the uint32 one's
        # files as uint16, and blamed its manifest: found by review).
        dtypes = [shard.dtype for shard in self.shards]
        self.dtype = np.result_type(*dtypes) if dtypes else np.dtype(np.uint16)

    @classmethod
    def concat(cls, streams: list[TokenStream]) -> TokenStream:
        """Several streams as one (the validation splits of a mixture), still memory-mapped."""
        joined = cls.__new__(cls)
        joined.shards = [shard for s in streams for shard in s.shards]
        joined.documents = sum(s.documents for s in streams)
        sizes = [s.vocab_size for s in streams if s.vocab_size is not None]
        joined.vocab_size = max(sizes) if sizes else None
        joined._index()
        return joined

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def size(self) -> int:
        return len(self)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """Every token in memory at once: for tests and small data, never the training path."""
        whole = self[0:len(self)]
        return whole if dtype is None else whole.astype(dtype)

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a TokenStream is read by contiguous slices")
        return self._read(self._tokens, index, self.dtype)

    def targets(self, index: slice) -> np.ndarray | None:
        """1 where a token of ``index`` is a training target, 0 where not (a fine-tuning prompt);
        None when every token of the stream is a target."""
        if not self.has_masks:
            return None
        return self._read(self._mask, index, np.uint8)

    def _tokens(self, number: int) -> np.ndarray:
        shard = self.shards[number]
        return SHARD_MAPS.get(shard.directory, shard.tokens_file, shard.dtype, shard.tokens)

    def _mask(self, number: int) -> np.ndarray | None:
        shard = self.shards[number]
        if shard.mask_file is None:
            return None
        return SHARD_MAPS.get(shard.directory, shard.mask_file, None, shard.tokens)

    def _starts(self, number: int) -> np.ndarray:
        shard = self.shards[number]
        return SHARD_MAPS.get(shard.directory, shard.docs_file, None, shard.documents)

    def _read(self, array_of, index: slice, dtype) -> np.ndarray:
        start, stop, _ = index.indices(len(self))
        if stop <= start:
            return np.empty(0, dtype=dtype)
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        if stop <= self.offsets[first + 1]:  # one shard: a view of its map, as before
            array = array_of(first)
            low = self.offsets[first]
            return array[start - low:stop - low] if array is not None else np.ones(stop - start, dtype=dtype)
        # Across shards, copied piece by piece: views of every shard at once would keep every
        # shard's map (and descriptor) alive past the cache's bound.
        out = np.empty(stop - start, dtype=dtype)
        at = 0
        while start < stop:
            low, high = self.offsets[first], self.offsets[first + 1]
            end = min(stop, high)
            array = array_of(first)
            out[at:at + end - start] = array[start - low:end - low] if array is not None else 1
            at, start, first = at + end - start, end, first + 1
        return out

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """The offsets in ``[start, stop)`` at which a document begins (for document masking); only
        the shards the range touches are read."""
        found = []
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while first < len(self.shards) and self.offsets[first] < stop:
            low = int(self.offsets[first])
            local = self._starts(first)
            inside = local[np.searchsorted(local, start - low):np.searchsorted(local, stop - low)]
            found.append(inside.astype(np.int64) + low)
            first += 1
        return np.concatenate(found) if found else np.empty(0, dtype=np.int64)


@dataclass
class PreparedDataset:
    path: Path
    manifest: dict
    train: TokenStream
    val: TokenStream


def open_prepared(path: str | Path, tokenizer: Tokenizer | None = None, warn: bool = True) -> PreparedDataset:
    """A prepared dataset, checked to be whole and made with ``tokenizer`` (when given); ``warn``:
    what is worth a warning is said (on rank 0; a launcher's check before the ranks start says
    nothing, the training will)."""
    path = Path(path).expanduser()
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is not a prepared dataset (no readable {MANIFEST}); make one with "
                        "shardtrain prepare INPUTS --out DIR") from exc
    if not (isinstance(manifest, dict) and manifest.get("format") == FORMAT
            and manifest.get("version") == VERSION):
        raise DataError(f"{path}: {MANIFEST} is not a version-{VERSION} shardtrain prepared dataset")
    if tokenizer is not None:
        made_with = manifest["tokenizer"]
        if made_with["name"] != tokenizer.name:
            # Named by where they were read (the names are digests of the vocabularies)
            given = manifest.get("options", {}).get("tokenizer", made_with["name"])
            raise DataError(
                f"{path} was prepared with the tokenizer {given} ({made_with['vocab_size']} tokens), but the "
                f"model's is {tokenizer.source} ({tokenizer.vocab_size} tokens), another vocabulary; prepare "
                "it again with the model's tokenizer (shardtrain prepare ... --tokenizer MODEL_DIR)")
        rank_zero = int(os.environ.get("RANK", "0")) == 0
        if warn and rank_zero and made_with.get("eos_id", tokenizer.eos_id) != tokenizer.eos_id:
            # One tokenizer.json, two end-of-text tokens (a base model's and its instruct model's):
            # the model learns the data's separator, and generation stops at the other one.
            ends = lambda eos: "no end-of-text token" if eos is None else f"token {eos}"  # noqa: E731
            log.warning(f"data: {path} ends its documents with {ends(made_with['eos_id'])} but the "
                        f"model's tokenizer ends text with {ends(tokenizer.eos_id)}; generation will "
                        "not stop where training documents ended (prepare it again with the model's "
                        "tokenizer)")
    if "dtype" not in manifest:
        raise DataError(f"{path}: {MANIFEST} names no token dtype; prepare it again")
    if tokenizer is not None and manifest["tokenizer"]["vocab_size"] != tokenizer.vocab_size:
        # The same tokenizer file, another vocab_size: an older shardtrain counted a tokenizer whose
        # ids skip numbers by its tokens, not its largest id. Its dtype may still hold them all.
        stored = manifest["dtype"]
        if stored not in ("uint16", "uint32") or np.iinfo(stored).max < tokenizer.vocab_size - 1:
            raise DataError(f"{path} was prepared by an older shardtrain, which stored this tokenizer's "
                            f"ids (up to {tokenizer.vocab_size - 1}) as {stored}: larger ones were cut; "
                            "prepare it again")
    directory = DatasetDirectory(path)
    shards = [shard for split in SPLITS for shard in manifest["splits"][split]["shards"]]
    # Datasets prepared before 2026-11-30 do not count their conversations: any fine-tuning records.
    rendered = manifest.get("conversations", any("mask_file" in shard for shard in shards))
    if tokenizer is not None and rendered:
        # Conversations were rendered with the chat template (and trained on its assistant turns):
        # a model whose tokenizer renders them otherwise would learn a format it is not prompted in.
        # Prompt/completion records render none, whatever either tokenizer's template.
        recorded = manifest["tokenizer"].get("chat_template", "unrecorded")
        now = tokenizer_entry(tokenizer)["chat_template"]
        if recorded not in (None, "unrecorded") and now is None:
            raise DataError(f"{path} holds conversations rendered with a chat template, and the model's "
                            f"tokenizer ({tokenizer.source}) has none: it would be prompted in no format "
                            "at all; train a model whose tokenizer has that template (a chat model's "
                            "tokenizer_config.json or chat_template.jinja), or prepare the data as "
                            "prompt/completion records")
        if recorded not in ("unrecorded", now):
            raise DataError(f"{path} holds conversations rendered with another chat template than the "
                            f"model's tokenizer's ({tokenizer.source}); prepare it again with the model's "
                            "tokenizer (shardtrain prepare ... --tokenizer MODEL_DIR)")
    # Masks are checked after the other files so that the message names the same files as ever
    # when tokens or document starts are missing.
    missing = (directory.missing([shard[key] for shard in shards for key in ("tokens_file", "docs_file")])
               or directory.missing([shard["mask_file"] for shard in shards if "mask_file" in shard]))
    if missing:
        raise DataError(f"{path} is incomplete: {', '.join(missing[:3])} missing; prepare it again")
    dtype = np.dtype(manifest["dtype"])
    # The larger of the recorded and the tokenizer's own count (an older shardtrain recorded some
    # tokenizers' token count, below their largest id, above)
    vocab = max(manifest["tokenizer"].get("vocab_size") or 0,
                tokenizer.vocab_size if tokenizer is not None else 0) or None
    return PreparedDataset(path, manifest, TokenStream(directory, manifest["splits"]["train"], dtype, vocab),
                           TokenStream(directory, manifest["splits"]["val"], dtype, vocab))
