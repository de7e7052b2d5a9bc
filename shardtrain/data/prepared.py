"""Reading a prepared dataset (``data/prepare.py``): each split's shards memory-mapped as one token
stream, so a process's resident memory does not grow with the dataset, only with what it reads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardtrain.data.prepare import FORMAT, MANIFEST, SPLITS, VERSION
from shardtrain.data.tokenizer import Tokenizer
from shardtrain.errors import DataError


class TokenStream:
    """A split's tokens, shard after shard, read through memory maps. Supports ``len`` and slicing
    with a step of 1 (a slice across a shard boundary is joined into one array)."""

    def __init__(self, directory: Path, entry: dict) -> None:
        self.shards = [np.load(directory / shard["tokens_file"], mmap_mode="r") for shard in entry["shards"]]
        self.documents = int(entry["documents"])
        # Each shard's document starts (offsets within the shard), memory-mapped like its tokens.
        self.starts = [np.load(directory / shard["docs_file"], mmap_mode="r") for shard in entry["shards"]]
        # Fine-tuning shards say which tokens are targets; None: every token of the shard is one.
        self.masks = [np.load(directory / shard["mask_file"], mmap_mode="r") if "mask_file" in shard
                      else None for shard in entry["shards"]]
        self._index()

    def _index(self) -> None:
        sizes = [len(shard) for shard in self.shards]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.has_masks = any(mask is not None for mask in self.masks)
        self.dtype = self.shards[0].dtype if self.shards else np.dtype(np.uint16)

    @classmethod
    def concat(cls, streams: list[TokenStream]) -> TokenStream:
        """Several streams as one (the validation splits of a mixture), still memory-mapped."""
        joined = cls.__new__(cls)
        joined.shards = [shard for s in streams for shard in s.shards]
        joined.masks = [mask for s in streams for mask in s.masks]
        joined.starts = [starts for s in streams for starts in s.starts]
        joined.documents = sum(s.documents for s in streams)
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
        return self._read(self.shards, index, self.dtype)

    def targets(self, index: slice) -> np.ndarray | None:
        """1 where a token of ``index`` is a training target, 0 where not (a fine-tuning prompt);
        None when every token of the stream is a target."""
        if not self.has_masks:
            return None
        return self._read(self.masks, index, np.uint8)

    def _read(self, arrays: list, index: slice, dtype) -> np.ndarray:
        start, stop, _ = index.indices(len(self))
        if stop <= start:
            return np.empty(0, dtype=dtype)
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pieces = []
        while start < stop:
            low, high = self.offsets[first], self.offsets[first + 1]
            end = min(stop, high)
            array = arrays[first]
            pieces.append(array[start - low:end - low] if array is not None
                          else np.ones(end - start, dtype=dtype))
            start, first = end, first + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """The offsets in ``[start, stop)`` at which a document begins (for document masking); only
        the shards the range touches are read."""
        found = []
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while first < len(self.starts) and self.offsets[first] < stop:
            low = int(self.offsets[first])
            local = self.starts[first]
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


def open_prepared(path: str | Path, tokenizer: Tokenizer | None = None) -> PreparedDataset:
    """A prepared dataset, checked to be whole and made with ``tokenizer`` (when given)."""
    path = Path(path).expanduser()
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is not a prepared dataset (no readable {MANIFEST}); make one with "
                        "shardtrain prepare INPUTS --out DIR") from exc
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise DataError(f"{path}: {MANIFEST} is not a version-{VERSION} shardtrain prepared dataset")
    if tokenizer is not None:
        made_with = manifest["tokenizer"]
        if made_with["name"] != tokenizer.name or made_with["vocab_size"] != tokenizer.vocab_size:
            raise DataError(
                f"{path} was prepared with tokenizer {made_with['name']} ({made_with['vocab_size']} tokens) "
                f"but the model's is {tokenizer.name} ({tokenizer.vocab_size} tokens); prepare it again "
                "with the model's tokenizer (shardtrain prepare ... --tokenizer MODEL_DIR)")
    missing = [shard[key] for split in SPLITS for shard in manifest["splits"][split]["shards"]
               for key in ("tokens_file", "docs_file") if not (path / shard[key]).is_file()]
    if missing:
        raise DataError(f"{path} is incomplete: {', '.join(missing[:3])} missing; prepare it again")
    return PreparedDataset(path, manifest, TokenStream(path, manifest["splits"]["train"]),
                           TokenStream(path, manifest["splits"]["val"]))
