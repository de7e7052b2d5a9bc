"""A map-style dataset as the framework reads it: the global sample order, per-sample random draws,
collation, and a structure check that turns a mismatched item into one line instead of a crash (or a
hang) deep inside a collective.

Items are tensors, or dicts, lists and tuples of tensors (and plain numbers). Items of one dataset
must share their structure: the same keys, dtypes and numbers of dimensions; sizes (a list's length
among them) may vary when the task's ``collate`` pads them.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from shardtrain.data.batches import GlobalOrder, map_tensors
from shardtrain.errors import DataError

Draw = Callable[[Any, torch.Generator], Any]


def walk(item: Any, leaf: Callable[[Any], Any]) -> Any:
    """``item`` with every leaf (tensor, array, number) replaced by ``leaf(it)``; dicts by sorted key."""
    if isinstance(item, Mapping):
        return {key: walk(value, leaf) for key, value in sorted(item.items())}
    if isinstance(item, (list, tuple)):
        return [walk(value, leaf) for value in item]
    return leaf(item)


def kind_of(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"tensor[{str(leaf.dtype).removeprefix('torch.')}, {leaf.ndim}-d]"
    if isinstance(leaf, np.ndarray):
        return f"ndarray[{leaf.dtype}, {leaf.ndim}-d]"
    return type(leaf).__name__


def shape_of(leaf: Any) -> tuple[int, ...]:
    return tuple(getattr(leaf, "shape", ()))


def structure(item: Any) -> Any:
    """What must agree between the items of a dataset (not the sizes, which a collate may pad): a
    mapping's keys and a tuple's positions, each with its kind; a list is a sequence, whose length
    is a size (a Hugging Face dataset's row holds its token ids as a list of ints): the kinds of its
    elements, not their number."""
    if isinstance(item, Mapping):
        return {key: structure(value) for key, value in sorted(item.items())}
    if isinstance(item, tuple):
        return [structure(value) for value in item]
    if isinstance(item, list):
        return f"list[{' | '.join(sorted({str(structure(value)) for value in item}))}]"
    return kind_of(item)


EMPTY_LIST = "list[]"


def agrees(found: Any, expected: Any) -> bool:
    """Whether two ``structure``s are one: an empty list agrees with a list of any kind (a row with
    no labels beside rows with some)."""
    if isinstance(found, dict) and isinstance(expected, dict):
        return found.keys() == expected.keys() and all(agrees(found[k], expected[k]) for k in found)
    if isinstance(found, list) and isinstance(expected, list):
        return len(found) == len(expected) and all(agrees(f, e) for f, e in zip(found, expected))
    if isinstance(found, str) and isinstance(expected, str) and EMPTY_LIST in (found, expected):
        return found.startswith("list[") and expected.startswith("list[")
    return found == expected


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Every tensor of a (nested) batch moved to ``device``, a dataclass's fields and a mapping
    subclass's items included (``map_tensors``), an object with a ``.to`` of its own (a PyG ``Data``)
    by it; other leaves and the containers' types as they are. Such an object is moved blocking (not
    every ``.to`` takes the keyword), from page-locked memory where it has a ``pin_memory()`` of its
    own and the loader pins (``data.batches.pinned_object``)."""
    return map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=non_blocking),
                       lambda obj: obj.to(device))


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) batch, in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):  # as map_tensors sees it
        batch = [getattr(batch, field.name) for field in dataclasses.fields(batch)]
    elif isinstance(batch, Mapping):
        batch = list(batch.values())
    if not isinstance(batch, (list, tuple)):
        return []
    return [tensor for value in batch for tensor in tensors_of(value)]


def batch_size(batch: Any) -> int:
    """The leading size of the first tensor of a (nested) batch: its number of samples."""
    return next((int(t.shape[0]) for t in tensors_of(batch) if t.ndim), 0)


def draw_seed(seed: int, salt: int, key: int) -> int:
    return (seed * 1_000_003 + salt * 7_919 + zlib.crc32(key.to_bytes(8, "little", signed=True))
            * 2_654_435_761) % (2**63)


def draw_name(draw: Draw) -> str:
    """``<Task>.draw`` for a task's bound method (possibly in ``Task.draw_hook``'s partial), else the
    function's own name."""
    func = draw.func if isinstance(draw, functools.partial) else draw
    owner = getattr(func, "__self__", None)
    if owner is not None:
        return f"{type(owner).__name__}.{func.__name__}"
    return getattr(func, "__qualname__", "draw")


class MapSamples:
    """A map-style dataset in the framework's data protocol (``data.batches.SampleSource``).

    ``batch(ids, keys)`` collates the items at ``ids``; an id of -1 is padding (evaluation gives
    every rank as many batches): padding rows are left out, and a batch that is only padding holds
    item 0, which the evaluation weighs zero, so every rank runs the same forwards. ``draw(item,
    generator)``, when given, makes each item's random draws from a generator seeded by (seed,
    salt, key): a sample's key is its position in the global order in training and its index in
    validation, so the draws do not depend on the world size or the micro-batch split.
    """

    sample_kind = "samples"

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any], name: str,
                 draw: Draw | None = None, seed: int = 0, salt: int = 0, if_empty: str = "") -> None:
        try:
            self.num_samples = len(dataset)
        except TypeError as exc:
            raise DataError(f"{name} ({type(dataset).__name__}) has no len(): the framework needs a "
                            "map-style dataset (__len__ and __getitem__)") from exc
        if not hasattr(dataset, "__getitem__"):  # a DataLoader has a len() too
            raise DataError(f"{name} ({type(dataset).__name__}) cannot be indexed: return the dataset "
                            "itself (__len__ and __getitem__); the framework batches it "
                            "(trainer.micro_batch_size) and collates it (Task.collate)")
        if self.num_samples < 1:
            raise DataError(f"{name} is empty{if_empty}")
        self.dataset = dataset
        self.collate = collate
        self.name = name
        self.draw = draw
        self.seed = seed
        self.salt = salt
        first = dataset[0]
        self.expected = structure(first)
        # The type item 0's draw returns: every draw must return it (default_collate cannot mix
        # types); drawn once here, so a draw returning None stops the run before the model is built.
        self.drawn_type: type | None = None
        if draw is not None:
            self.drawn_type = type(self.drawn(first, 0, None))

    def order(self, seed: int) -> GlobalOrder:
        return GlobalOrder(self.num_samples, seed)

    def item(self, index: int, key: int | None) -> Any:
        item = self.dataset[index]
        found = structure(item)
        if not agrees(found, self.expected):
            raise DataError(f"{self.name}: item {index} is {found}, item 0 is {self.expected}; every "
                            "item needs the same keys, dtypes and numbers of dimensions")
        return self.drawn(item, index, key)

    def drawn(self, item: Any, index: int, key: int | None) -> Any:
        """``item`` (at ``index``) as the draw makes it, with the generator of ``key`` (validation:
        None, the index's); the item itself without a draw."""
        if self.draw is not None:
            generator = torch.Generator().manual_seed(
                draw_seed(self.seed, self.salt, index if key is None else key))
            drawn = self.draw(item, generator)
            if drawn is None or (self.drawn_type is not None and type(drawn) is not self.drawn_type):
                raise DataError(self.bad_draw(drawn, index))
            item = drawn
        return item

    def bad_draw(self, drawn: Any, index: int) -> str:
        name = draw_name(self.draw)
        if drawn is None:
            return f"{name} returned None for item {index}; return the (augmented) item"
        return (f"{name} returned a {type(drawn).__name__} for item {index} and a "
                f"{self.drawn_type.__name__} for item 0; return the same type for every item")

    def batch(self, ids: np.ndarray, keys: np.ndarray | None = None) -> Any:
        real = [(int(i), None if keys is None else int(k))
                for i, k in zip(ids, keys if keys is not None else ids) if i >= 0]
        if not real:
            real = [(0, None)]  # weighed zero by the evaluation; the forward keeps ranks in step
        items = [self.item(i, key) for i, key in real]
        try:
            return self.collate(items)
        except RuntimeError as exc:
            if "equal size" not in str(exc):  # default_collate's torch.stack of unequal sizes
                raise
            shapes = sorted({str(walk(item, shape_of)) for item in items})[:2]
            raise DataError(f"{self.name}: items of different shapes in one batch ({' vs '.join(shapes)}); "
                            "give the task a collate(items) that pads them") from exc
