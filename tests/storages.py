"""What operators allocate and how much of it is alive, counted by storage (tests' helper).

Real tensors on the CPU, no allocator statistics needed: a dispatch mode sees every tensor an
operator makes and keeps a weak reference to its storage."""

from __future__ import annotations

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class StoragesMade(TorchDispatchMode):
    """Weak references to the storage of every tensor an operator makes while active (a view of a
    tensor made before is not one); with ``track_peak``, also the most bytes of them alive at once,
    read after each operator."""

    def __init__(self, track_peak: bool = False) -> None:
        super().__init__()
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}
        self.earlier: dict[int, StorageWeakRef] = {}  # storages made before, seen as operators' inputs
        self.track_peak = track_peak
        self.peak_bytes = 0

    @staticmethod
    def _alive(table: dict, key: int) -> bool:
        entry = table.get(key)
        ref = entry[0] if isinstance(entry, tuple) else entry
        return ref is not None and not ref.expired()

    def alive_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.made.values() if not ref.expired())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Keys are storages' addresses, which a freed storage hands on: an entry counts while its
        # weak reference lives.
        for tensor in tree_flatten((args, kwargs))[0]:
            if isinstance(tensor, torch.Tensor):
                ref = StorageWeakRef(tensor.untyped_storage())
                if not self._alive(self.made, ref.cdata):
                    self.earlier[ref.cdata] = ref
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                ref = StorageWeakRef(storage)
                if not self._alive(self.earlier, ref.cdata) and not self._alive(self.made, ref.cdata):
                    self.made[ref.cdata] = (ref, storage.nbytes())
        if self.track_peak:
            self.peak_bytes = max(self.peak_bytes, self.alive_bytes())
        return out


def kept_bytes(run, exclude: tuple[torch.Tensor, ...]) -> int:
    """Bytes of the distinct storages ``run()`` makes that are alive once it returned, but for its
    result's and those of ``exclude`` (parameters, tables: a transpose of a weight is a new tensor
    on its storage): what its autograd graph keeps for backward (whoever keeps it: not only what
    passes through saved-tensor hooks, which a layer's own hooks would hide)."""
    with StoragesMade() as mode:
        result = run()
    gc.collect()
    alive = {key: nbytes for key, (ref, nbytes) in mode.made.items() if not ref.expired()}
    for tensor in (result, *exclude):
        alive.pop(StorageWeakRef(tensor.untyped_storage()).cdata, None)
    return sum(alive.values())


def peak_bytes(run) -> int:
    """The most bytes alive at once, after any operator, of the storages ``run()``'s operators make."""
    with StoragesMade(track_peak=True) as mode:
        run()
    return mode.peak_bytes
