"""Fixed-length token windows in one global order, cut into per-rank micro-batches.

The position in the data is a single global number (samples consumed), and every step takes the
next ``global_batch`` samples of the global order. How those samples are split over ranks and
micro-batches is decided here, by construction identical in count on every rank, so no rank can run
out of batches before the others (the classic hang), and a run can later resume at another world
size without repeating or skipping a sample.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import UserDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from shardtrain.config.schema import mixture_weights_valid
from shardtrain.errors import DataError, TooFewTokens

IGNORE_INDEX = -100


class Batch(NamedTuple):
    """One micro-batch: ``inputs`` and ``targets`` (B, T), and with document masking each token's
    position within its document (B, T), which the model turns into restarted positions and
    attention that stays inside each document; None without. ``lengths`` (B,): how many of each
    row's first inputs are tokens, the rest padding (a padding row's 0; None: every input is)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None
    lengths: torch.Tensor | None = None

    def token_mask(self) -> torch.Tensor | None:
        """(B, T) true at the inputs that are tokens, not padding; None where every input is."""
        if self.lengths is None:
            return None
        return torch.arange(self.inputs.shape[1], device=self.inputs.device) < self.lengths[:, None]


def padded_lengths(lengths: np.ndarray, seq_len: int) -> torch.Tensor | None:
    """``Batch.lengths`` of rows of ``lengths`` tokens out of ``seq_len``: None where every row is
    full (packed windows), so that nothing downstream masks what needs no mask."""
    return None if (lengths == seq_len).all() else torch.from_numpy(np.asarray(lengths, dtype=np.int64))


def positions_in_window(starts: np.ndarray, length: int) -> np.ndarray:
    """Each token's position within its document, for a window whose documents begin at offsets
    ``starts`` (0 < start < length). The window's first token counts as a start: a document cut by
    the window's edge is seen from there, so positions stay below the window length."""
    segment = np.zeros(length, dtype=np.int64)
    segment[starts] = starts
    return np.arange(length, dtype=np.int64) - np.maximum.accumulate(segment)


class SampleSource(Protocol):
    """What the framework reads a task's data through: ``num_samples`` samples, the global order
    over their ids, and ``batch(ids, keys)``, one micro-batch of the samples at ``ids`` (-1: padding,
    which contributes nothing). ``keys`` are the samples' positions in the global order, which seed
    per-sample random draws (``tasks/samples.py``); sources without draws ignore them."""

    num_samples: int
    sample_kind: str  # what a sample is, for messages ("samples", "windows of ... tokens")

    def order(self, seed: int) -> GlobalOrder | MixtureOrder: ...

    def batch(self, ids: np.ndarray, keys: np.ndarray | None = None) -> Any: ...


class TokenWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens; sample i starts at ``i * seq_len``.

    With ``document_mask`` (the tokens must be a prepared ``TokenStream``, which knows where its
    documents begin) each batch carries positions within documents, and a target that lies in
    another document than its input (the first token of the next document) is ignored: with
    attention kept inside each document, a packed window's losses are then those of its documents
    each run alone.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str = "data",
                 document_mask: bool = False) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.name = name
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise TooFewTokens(
                f"{name} has {len(tokens)} tokens, fewer than one window of trainer.seq_len+1="
                f"{seq_len + 1}; use more data or a shorter trainer.seq_len (eval: --seq-len)"
            )
        if document_mask and not hasattr(tokens, "document_starts"):
            raise DataError(f"data.document_mask=true needs to know where documents begin, and {name} is "
                            "plain tokens; use a prepared dataset (shardtrain prepare, data.source=prepared)")
        self.document_mask = document_mask

    @property
    def sample_kind(self) -> str:
        return f"windows of trainer.seq_len+1={self.seq_len + 1} tokens"

    @property
    def targets_masked(self) -> bool:
        """Whether some tokens are no targets (a fine-tuning record's prompt)."""
        return bool(getattr(self.tokens, "has_masks", False))

    def order(self, seed: int) -> GlobalOrder:
        return GlobalOrder(self.num_samples, seed)

    def span(self, i: int) -> slice:
        """The tokens of window ``i``: at most ``seq_len + 1``."""
        return slice(i * self.seq_len, i * self.seq_len + self.seq_len + 1)

    def inputs_in(self, count: int) -> int:
        """The input tokens of the first ``count`` windows (a record window's padding is none)."""
        spans = (self.span(i) for i in range(min(count, self.num_samples)))
        return sum(max(span.stop - span.start - 1, 0) for span in spans)

    def batch(self, ids: np.ndarray, keys: np.ndarray | None = None) -> Batch:
        """Inputs and targets for sample ``ids``; an id of -1 is padding (targets ignored), and so
        is a token the data marks as no target (a fine-tuning prompt: ``TokenStream.targets``) and
        the rest of a window its tokens do not fill (``RecordWindows``)."""
        x = np.zeros((len(ids), self.seq_len), dtype=np.int64)
        y = np.full((len(ids), self.seq_len), IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros((len(ids), self.seq_len), dtype=np.int64) if self.document_mask else None
        lengths = np.zeros(len(ids), dtype=np.int64)
        masked = self.targets_masked
        for row, i in enumerate(ids):
            if i < 0:
                continue
            span = self.span(int(i))
            if span.stop - span.start < 2:  # an empty record alone in a window: no input, no target
                continue  # (the byte tokenizer's empty document; it raised mid-run; found by a review)
            window = self.tokens[span]
            filled = lengths[row] = len(window) - 1
            x[row, :filled] = window[:-1]
            y[row, :filled] = window[1:]
            if masked:
                y[row, :filled][self.tokens.targets(span)[1:] == 0] = IGNORE_INDEX
            if positions is not None:
                # Documents beginning after the window's first token, up to its last target.
                starts = self.tokens.document_starts(span.start + 1, span.stop) - span.start
                y[row][starts - 1] = IGNORE_INDEX
                positions[row] = positions_in_window(starts[starts < self.seq_len], self.seq_len)
        self.check_ids(x, y, ids)
        return Batch(torch.from_numpy(x), torch.from_numpy(y),
                     None if positions is None else torch.from_numpy(positions),
                     padded_lengths(lengths, self.seq_len))

    def check_ids(self, inputs: np.ndarray, targets: np.ndarray, ids: np.ndarray) -> None:
        """No id at or past the tokenizer's vocabulary: a damaged shard's went to the embedding,
        an IndexError from inside torch (on a GPU, a device-side assertion; found by a trial)."""
        limit = getattr(self.tokens, "vocab_size", None)
        if limit is None or not len(ids):
            return
        top = max(int(inputs.max()), int(targets.max()))
        if top >= limit:
            row = int(np.flatnonzero((inputs >= limit).any(1) | (targets >= limit).any(1))[0])
            raise DataError(f"{self.name}: token id {top} in window {int(ids[row])}, and the tokenizer it "
                            f"was prepared with has {limit} ids: its files are damaged; prepare it again")


class RecordWindows(TokenWindows):
    """Windows of whole records (``data.packing=records``, what fine-tuning data gets by default):
    each window starts at a record and holds as many following records as fit in ``seq_len + 1``
    tokens, the rest padding that is no input anyone attends back to and no target. Cut at every
    ``seq_len`` tokens instead, a window starting inside a record trained its answer without its
    prompt (37% of the target tokens of a set of 100-900-token prompts at seq_len 2,048). A record
    longer than a window is cut to one window of its own, its tail left out (counted in
    ``truncated``, said at start-up)."""

    def __init__(self, tokens: Any, seq_len: int, name: str = "data", document_mask: bool = False) -> None:
        if not hasattr(tokens, "document_starts"):
            raise DataError(f"data.packing=records needs to know where records begin, and {name} is plain "
                            "tokens; use a prepared dataset (shardtrain prepare, data.source=prepared), or "
                            "data.packing=stream")
        starts = tokens.document_starts(0, len(tokens)).astype(np.int64)
        if len(tokens) < 2:  # one window of whole records needs a target, not seq_len + 1 tokens
            raise TooFewTokens(f"{name} has {len(tokens)} tokens: no record to train or evaluate on")
        self.starts, self.stops, self.truncated = pack_records(starts, len(tokens), seq_len + 1)
        self.records = len(starts)
        self.tokens, self.seq_len, self.document_mask, self.name = tokens, seq_len, document_mask, name
        self.num_samples = len(self.starts)

    @property
    def sample_kind(self) -> str:
        return f"windows of whole records up to trainer.seq_len+1={self.seq_len + 1} tokens"

    def span(self, i: int) -> slice:
        return slice(int(self.starts[i]), int(self.stops[i]))


def packing_of(windows: Any) -> str:
    """How ``windows`` were cut (data.packing resolved): "records" where any of its datasets' are
    whole records, else "stream"."""
    source = getattr(windows, "windows", windows)  # an InterleavedWindows holds a MixtureWindows
    parts = getattr(source, "parts", [source])
    return "records" if any(isinstance(part, RecordWindows) for part in parts) else "stream"


def pack_records(starts: np.ndarray, total: int, window: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Greedy, in order: the (start, stop) of each window of whole records of at most ``window``
    tokens (records beginning at ``starts``, the last ending at ``total``), and how many records
    were longer than a window (each then a window of its first ``window`` tokens).

    Where each record's window would end is found for every record at once; only the walk from
    window to window is a loop, with nothing per record in Python (a loop over every record, on
    every rank, held two Python ints a record: gigabytes at 100M records)."""
    count = len(starts)
    ends = np.append(starts[1:], total).astype(np.int64)
    # The record after the last one that fits in a window begun at each record (at least the next)
    after = np.maximum(np.searchsorted(ends, starts + window, side="right"), np.arange(1, count + 1))
    jumps = memoryview(after.astype(np.int64))
    firsts: list[int] = []
    record = 0
    while record < count:
        firsts.append(record)
        record = jumps[record]
    first = np.asarray(firsts, dtype=np.int64)
    begins = starts[first].astype(np.int64)
    stops = np.minimum(ends[after[first] - 1], begins + window)
    return begins, stops, int(np.count_nonzero(ends - starts > window))


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic): a well-mixed 64-bit hash."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class GlobalOrder:
    """An endless sequence of sample ids: one seeded permutation of ``range(num_samples)`` per epoch.

    The permutation is computed position by position by a keyed Feistel network over the smallest
    even number of bits that holds every id, walking cycles until the value falls inside the range
    (a permutation of ``[0, 2^bits)`` restricted this way is a permutation of ``[0, num_samples)``).
    Nothing is stored: memory does not grow with the dataset (a stored permutation of a billion
    samples would be 8 GB), and any position's id is computed directly, so a run resumes anywhere.
    """

    ROUNDS = 4

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples < 1:
            raise DataError("no samples to order")
        self.num_samples = num_samples
        self.seed = seed
        bits = max(2, (num_samples - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.low_mask = np.uint64((1 << int(self.half)) - 1)

    def _keys(self, epochs: np.ndarray) -> np.ndarray:
        """One 64-bit key per round for each of ``epochs``, from the seed and the epoch: [epochs, rounds]."""
        seed = np.array([self.seed], dtype=np.uint64)
        base = mix64(seed) ^ mix64(epochs.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
        return mix64(base[:, None] + np.arange(1, self.ROUNDS + 1, dtype=np.uint64)[None, :])

    def _feistel(self, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """``x`` through the rounds, each element with its own row of ``keys``."""
        left, right = x >> self.half, x & self.low_mask
        for round_ in range(self.ROUNDS):
            left, right = right, left ^ (mix64(right ^ keys[:, round_]) & self.low_mask)
        return (left << self.half) | right

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The ids at ``positions`` (any non-negative positions) of the endless order. Every epoch's
        in one pass: a step of a large batch over a tiny mixture dataset spans thousands of its
        epochs (found by review: one pass an epoch, 1.2 s a step at a global batch of 32,768)."""
        epochs, offsets = np.divmod(positions.astype(np.int64), self.num_samples)
        unique, which = np.unique(epochs, return_inverse=True)
        keys = self._keys(unique)[which.reshape(-1)]
        x = offsets.astype(np.uint64)
        outside = np.ones(len(x), dtype=bool)
        limit = np.uint64(self.num_samples)
        while outside.any():  # cycle-walking: until each value falls inside the range
            x[outside] = self._feistel(x[outside], keys[outside])
            outside = x >= limit
        return x.astype(np.int64)

    def take(self, start: int, count: int) -> np.ndarray:
        """The ids at positions ``start .. start + count - 1`` of the endless order."""
        return self.at(np.arange(start, start + count, dtype=np.int64))


# Positions per block of a mixture's order: each block holds every dataset a fixed number of times.
MIXTURE_BLOCK = 1024
DATASET_SHIFT = 40  # a mixture's sample id: dataset index << DATASET_SHIFT | the dataset's sample id
# A dataset whose share of a block is off its weight's by more than this is named at start-up.
MIXTURE_SHARE_TOLERANCE = 0.05


def block_counts(weights: list[float], block: int) -> np.ndarray:
    """Each dataset's share of a block, in whole samples (largest remainder; every weight > 0 gets
    at least one)."""
    share = np.asarray(weights, dtype=np.float64) / sum(weights) * block
    counts = np.maximum(np.floor(share).astype(np.int64), 1)
    # A share raised to its one sample still competes for a remainder's (a second one where its
    # fraction wins): changing that would change the order of mixtures saved before, unannounced.
    for index in np.argsort(-(share - np.floor(share)), kind="stable")[:max(block - counts.sum(), 0)]:
        counts[index] += 1
    return counts


class MixtureOrder:
    """The global order of a mixture of datasets: block ``b`` of the positions holds dataset ``d``
    exactly ``counts[d]`` times (its weight's share), in an order seeded by (seed, b); the k-th time
    dataset ``d`` comes up, it gives the k-th sample of its own global order. Everything is a
    function of the seed and the position: resumable anywhere, at any world size."""

    def __init__(self, sizes: list[int], weights: list[float], seed: int) -> None:
        self.counts = block_counts(weights, MIXTURE_BLOCK)
        self.block = int(self.counts.sum())
        self.seed = seed
        self.orders = [GlobalOrder(size, seed + 1_000_003 * (d + 1)) for d, size in enumerate(sizes)]
        self._choices = np.repeat(np.arange(len(sizes)), self.counts)

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``block``: the dataset of each slot, and each slot's position in its dataset."""
        datasets = np.random.default_rng([self.seed, block, 0x6D6978]).permutation(self._choices)
        local = np.empty(self.block, dtype=np.int64)
        for d, count in enumerate(self.counts):
            slots = np.flatnonzero(datasets == d)
            local[slots] = block * count + np.arange(len(slots))
        return datasets, local

    def take(self, start: int, count: int) -> np.ndarray:
        positions = np.arange(start, start + count, dtype=np.int64)
        blocks, slots = np.divmod(positions, self.block)
        datasets, local = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
        for block in np.unique(blocks):
            here = blocks == block
            block_datasets, block_local = self._block(int(block))
            datasets[here], local[here] = block_datasets[slots[here]], block_local[slots[here]]
        out = np.empty(count, dtype=np.int64)
        for d, order in enumerate(self.orders):
            mine = datasets == d
            out[mine] = (d << DATASET_SHIFT) | order.at(local[mine])
        return out


def part_sample_counts(windows: Any) -> list[int] | None:
    """A mixture's sample count of each dataset (its order depends on each); None for one dataset."""
    return [part.num_samples for part in windows.parts] if isinstance(windows, MixtureWindows) else None


class MixtureWindows:
    """Training windows of several datasets, drawn in proportion to ``weights`` (``MixtureOrder``)."""

    def __init__(self, parts: list[TokenWindows], weights: list[float]) -> None:
        # as data.weights is checked, for mixtures built in code (block_counts divides by the sum)
        if not mixture_weights_valid(weights, len(parts)):
            raise DataError(f"mixture weights {list(weights)}: one positive, finite weight per dataset "
                            f"({len(parts)}), their sum finite")
        self.parts = parts
        self.weights = weights
        self.seq_len = parts[0].seq_len
        self.num_samples = sum(part.num_samples for part in parts)
        self.sample_kind = parts[0].sample_kind

    def order(self, seed: int) -> MixtureOrder:
        return MixtureOrder([part.num_samples for part in self.parts], self.weights, seed)

    def describe(self, names: list[str]) -> str:
        """How many windows of each dataset (``names``) a block of the order holds, and where that
        is not the weight's share: a block holds whole windows, at least one of each dataset, so a
        weight under one window in 1,024 is raised to one (weights=[] by size: a small dataset
        beside large ones)."""
        counts = block_counts(self.weights, MIXTURE_BLOCK)
        block, total = int(counts.sum()), sum(self.weights)
        shares = ", ".join(f"{name} {count} ({weight / total:.2%})"
                           for name, count, weight in zip(names, counts, self.weights, strict=True))
        text = f"mixture, windows a block of {block:,} (weight's share): {shares}"
        off = [(name, count / block / (weight / total))
               for name, count, weight in zip(names, counts, self.weights, strict=True)
               if abs(count / block / (weight / total) - 1) > MIXTURE_SHARE_TOLERANCE]
        if off:
            text += "; " + ", ".join(f"{name} drawn {ratio:.2g}x as often as its weight says"
                                     for name, ratio in off)
            text += (" (a block holds whole windows, at least one of each dataset: give it a larger weight, "
                     "or leave it out)")
        return text

    def batch(self, ids: np.ndarray, keys: np.ndarray | None = None) -> Batch:
        x = torch.zeros((len(ids), self.seq_len), dtype=torch.int64)
        y = torch.full((len(ids), self.seq_len), IGNORE_INDEX, dtype=torch.int64)
        positions = torch.zeros_like(x) if self.parts[0].document_mask else None
        datasets = np.where(ids < 0, -1, ids >> DATASET_SHIFT)
        lengths = np.where(datasets < 0, 0, self.seq_len)
        for d, part in enumerate(self.parts):
            rows = np.flatnonzero(datasets == d)
            if len(rows):
                got = part.batch(ids[rows] & ((1 << DATASET_SHIFT) - 1))
                x[rows], y[rows] = got.inputs, got.targets
                if got.lengths is not None:
                    lengths[rows] = got.lengths.numpy()
                if positions is not None:
                    positions[rows] = got.positions
        return Batch(x, y, positions, padded_lengths(lengths, self.seq_len))


class InterleavedWindows:
    """Several datasets' validation windows as one source, each dataset's windows spread evenly
    through it: window j of a dataset of n sits at j / n of the way (ties in dataset order), so the
    first k positions hold the first window of each of the first k datasets, and any first m are
    every dataset's in proportion to its count. Evaluation reads the first ``trainer.eval_samples``:
    the datasets one after another gave the first dataset's alone."""

    def __init__(self, parts: list[TokenWindows]) -> None:
        self.counts = np.array([part.num_samples for part in parts], dtype=np.int64)
        self.windows = MixtureWindows(parts, [float(n) for n in self.counts])
        self.num_samples = int(self.counts.sum())
        self.seq_len = self.windows.seq_len
        self.sample_kind = self.windows.sample_kind
        self.targets_masked = any(part.targets_masked for part in parts)
        self.ids = np.zeros(0, dtype=np.int64)  # the mixture ids of the first positions, made as read

    def first(self, m: int) -> np.ndarray:
        """The mixture ids at positions 0 .. m - 1. A window j of dataset d is among the first m
        only if j * N / n_d < m (at least that many keys are smaller), so each dataset's candidates
        are its first ceil(m * n_d / N) + 1: about m of them in all, never the whole split."""
        total = self.num_samples
        ids, keys = [], []
        for d, n in enumerate(self.counts.tolist()):
            j = np.arange(min(n, -(-m * n // total) + 1), dtype=np.int64)
            ids.append((d << DATASET_SHIFT) | j)
            keys.append(j / n)  # correctly rounded: equal fractions are equal floats
        ids, keys = np.concatenate(ids), np.concatenate(keys)
        return ids[np.argsort(keys, kind="stable")[:m]]  # the datasets were concatenated in order

    def order(self, seed: int) -> GlobalOrder:
        return GlobalOrder(self.num_samples, seed)

    def batch(self, ids: np.ndarray, keys: np.ndarray | None = None) -> Batch:
        needed = max(int(ids.max(initial=-1)) + 1, 1)
        if needed > len(self.ids):  # grown by doubling: an evaluation reads its positions in order
            self.ids = self.first(min(self.num_samples, max(needed, 2 * len(self.ids))))
        return self.windows.batch(np.where(ids < 0, -1, self.ids[np.maximum(ids, 0)]))


@dataclass(frozen=True)
class BatchLayout:
    micro_batch_size: int
    grad_accum_steps: int
    dp_world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.dp_world_size

    def rank_slices(self, ids: np.ndarray, rank: int) -> list[np.ndarray]:
        """The micro-batches of one rank: micro-step k holds ranks' slices side by side."""
        per_micro = self.micro_batch_size * self.dp_world_size
        start = rank * self.micro_batch_size
        return [
            ids[k * per_micro + start : k * per_micro + start + self.micro_batch_size]
            for k in range(self.grad_accum_steps)
        ]


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor],
                movable: Callable[[Any], Any] | None = None) -> Any:
    """``batch`` (a tensor, or dataclasses, mappings, NamedTuples, lists and tuples of them) with every
    tensor replaced by ``fn(tensor)``; other leaves and the containers' types as they are. An object
    with a ``.to`` method of its own (a PyG ``Data``) becomes ``movable(it)`` (None: left as it is);
    any other object holding tensors in its attributes is refused (``other_object``)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    # Before Mapping: a dataclass may be a mapping too (transformers' ModelOutput), and its fields
    # hold what its items do and more.
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return map_fields(batch, fn, movable)
    if isinstance(batch, Mapping):
        return map_mapping(batch, fn, movable)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a NamedTuple keeps its type
        return type(batch)(*(map_tensors(value, fn, movable) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(value, fn, movable) for value in batch)
    return other_object(batch, movable)


def pinned_object(obj: Any) -> Any:
    """An object with a ``.to`` of its own (a PyG ``Data``) in page-locked memory by its own
    ``pin_memory()``, where it has one (its copy to the accelerator then goes at full speed); as it
    is otherwise."""
    pin = getattr(obj, "pin_memory", None)
    return pin() if callable(pin) else obj


def other_object(batch: Any, movable: Callable[[Any], Any] | None) -> Any:
    """A leaf that is none of the containers ``map_tensors`` rebuilds: moved by its own ``.to`` when
    it has one, kept when it holds no tensor (a number, a string); one line otherwise, as its tensors
    would silently stay where they are."""
    if callable(getattr(batch, "to", None)):
        return batch if movable is None else movable(batch)
    if holds_tensors(batch):
        raise DataError(f"a batch holds a {type(batch).__qualname__} with tensors in its attributes, "
                        "which the framework cannot move to the device; have the task's collate return "
                        "a dict, a tuple, a dataclass, or an object with a .to(device) method")
    return batch


def holds_tensors(obj: Any) -> bool:
    """A tensor among ``obj``'s attributes (``__dict__`` or ``__slots__``) or the items of a list,
    tuple or mapping among them; no deeper, so an object graph (cycles included) is never walked."""
    values = list(getattr(obj, "__dict__", {}).values())
    slots = getattr(type(obj), "__slots__", ())
    values += [getattr(obj, name) for name in ([slots] if isinstance(slots, str) else slots)
               if hasattr(obj, name)]
    return any(isinstance(inner, torch.Tensor) for value in values for inner in one_level(value))


def one_level(value: Any) -> Iterable[Any]:
    if isinstance(value, Mapping):
        return value.values()
    return value if isinstance(value, (list, tuple)) else (value,)


def map_fields(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor],
               movable: Callable[[Any], Any] | None = None) -> Any:
    """A dataclass rebuilt through its own ``__init__`` (``dataclasses.replace``, frozen ones too);
    fields it does not take (``init=False``) are mapped after, as ``__post_init__`` left them."""
    fields = dataclasses.fields(batch)
    mapped = dataclasses.replace(batch, **{field.name: map_tensors(getattr(batch, field.name), fn, movable)
                                           for field in fields if field.init})
    for field in fields:
        if not field.init and hasattr(mapped, field.name):
            object.__setattr__(mapped, field.name, map_tensors(getattr(mapped, field.name), fn, movable))
    return mapped


def map_mapping(batch: Mapping, fn: Callable[[torch.Tensor], torch.Tensor],
                movable: Callable[[Any], Any] | None = None) -> Any:
    """A mapping of the same type: a plain dict as such; a dict or ``UserDict`` subclass (transformers'
    ``BatchEncoding``) as a shallow copy with its values replaced, which keeps its attributes and
    attribute access; any other mapping through ``type(batch)(dict)``, or one line saying what to
    return instead."""
    values = {key: map_tensors(value, fn, movable) for key, value in batch.items()}
    if type(batch) is dict:
        return values
    try:
        if not isinstance(batch, (dict, UserDict)):
            return type(batch)(values)
        # copy.copy gives these their own storage (a UserDict copies .data): the batch is not changed.
        mapped = copy.copy(batch)
        for key, value in values.items():
            mapped[key] = value
        return mapped
    except Exception as exc:  # any constructor that does not take a dict of its items
        raise DataError(f"a batch holds a {type(batch).__qualname__}, a mapping that cannot be rebuilt "
                        f"from a dict of its items ({type(exc).__name__}), so its tensors cannot be "
                        "moved to the device; have the task's collate return a dict, a dataclass or "
                        "a NamedTuple of tensors") from exc


class TrainBatches:
    """Hands each rank its micro-batches for the next step and tracks the global position.

    The batches of the following step are made ahead, in a background thread, while the current
    step trains. They are a pure function of the position, so prefetching never changes what a step
    gets, and a position set from a checkpoint simply discards what was made ahead. ``wait_s`` is how
    long the last ``next_step`` waited for its batches. ``pin_memory`` (accelerators only): the
    thread also copies them into page-locked memory, so that the step's ``non_blocking`` copies to
    the device are asynchronous (from pageable memory CUDA waits for the stream before each copy).
    """

    def __init__(self, windows: SampleSource, layout: BatchLayout, rank: int, seed: int,
                 prefetch: bool = True, pin_memory: bool = False) -> None:
        if windows.num_samples < layout.global_batch:
            # One step would hold some samples twice (the order wraps into the next epoch).
            shorter = " or a shorter trainer.seq_len" if "seq_len" in windows.sample_kind else ""
            raise DataError(
                f"the training data has {windows.num_samples} {windows.sample_kind}, fewer than one "
                f"global batch of {layout.global_batch} (trainer.micro_batch_size="
                f"{layout.micro_batch_size} x trainer.grad_accum_steps={layout.grad_accum_steps} x "
                f"{layout.dp_world_size} data-parallel ranks); use more data, a smaller batch{shorter}")
        self.windows = windows
        self.layout = layout
        self.rank = rank
        self.order = windows.order(seed)
        self.consumed_samples = 0
        self.wait_s = 0.0
        self.pin_memory = pin_memory
        self._executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardtrain-data")
                          if prefetch else None)
        self._ahead: tuple[int, Future] | None = None  # (position, its batches being made)

    def step_ids(self) -> np.ndarray:
        """The global sample ids of the next step (a function of the seed and the position only)."""
        return self.order.take(self.consumed_samples, self.layout.global_batch)

    def batches_at(self, position: int) -> list[Any]:
        ids = self.order.take(position, self.layout.global_batch)
        keys = np.arange(position, position + self.layout.global_batch, dtype=np.int64)
        batches = [self.windows.batch(s, k) for s, k in zip(self.layout.rank_slices(ids, self.rank),
                                                            self.layout.rank_slices(keys, self.rank))]
        if self.pin_memory:
            batches = [map_tensors(batch, torch.Tensor.pin_memory, pinned_object) for batch in batches]
        return batches

    def next_step(self) -> list[Any]:
        started = time.perf_counter()
        position = self.consumed_samples
        if self._ahead is not None and self._ahead[0] == position:
            batches = self._ahead[1].result()
        else:
            batches = self.batches_at(position)
        self.wait_s = time.perf_counter() - started
        self.consumed_samples = position + self.layout.global_batch
        if self._executor is not None:
            following = self.consumed_samples
            self._ahead = (following, self._executor.submit(self.batches_at, following))
        return batches

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor, self._ahead = None, None


class EvalBatches(Sequence):
    """This rank's validation micro-batches as (batch, weight), each collated when it is read: a
    large validation set (a task's images) is not held collated in memory for the whole run. The
    first is collated at once, so that a data error is reported at start-up, not at the first
    evaluation."""

    def __init__(self, windows: SampleSource, parts: list[np.ndarray]) -> None:
        self.windows, self.parts = windows, parts
        if parts:
            windows.batch(parts[0])

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, index: int) -> tuple[Any, float]:
        part = self.parts[index]
        return self.windows.batch(part), float((part >= 0).any())


def eval_batches(windows: SampleSource, num_samples: int, micro_batch_size: int,
                 dp_world_size: int, rank: int) -> EvalBatches:
    """The first ``num_samples`` validation samples as (micro-batch, weight), padded so that every
    rank runs as many forwards (a rank with fewer would leave the others waiting in FSDP's
    all-gathers: torchtitan#1617).

    Padding contributes nothing (a token window's padding rows have only ignored targets; a batch
    that is only padding has weight 0), so the validation loss is the same at any world size.
    """
    n = min(num_samples, windows.num_samples)
    per_round = micro_batch_size * dp_world_size
    rounds = -(-n // per_round)
    ids = np.full(rounds * per_round, -1, dtype=np.int64)
    ids[:n] = np.arange(n)
    return EvalBatches(windows, [ids[r * per_round + rank * micro_batch_size:][:micro_batch_size]
                                 for r in range(rounds)])
