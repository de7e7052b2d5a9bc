"""What autograd keeps from each block's forward, measured on a stand-in without data.

The planner counts the built-in Llama's activations tensor by tensor (docs/memory-planner.md). A
Hugging Face family's layers keep what its code keeps: per-head query and key norms (Qwen3, OLMo2,
Gemma 3), four norms a block (Gemma 2 and 3), fp32 upcasts inside its norms, an eager attention's
T x T scores. Counted as if they were Llama's, one block's bytes came out 15% (Qwen3) to 43% (Gemma
3) under what the block keeps in bf16. So for them the planner runs the model's forward once on fake
tensors (shapes only: no memory, no arithmetic) and counts the storages still alive when it has
returned, which its autograd graph holds for backward, by the block whose forward made them.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardtrain.config.schema import ModelConfig
from shardtrain.models.registry import build_model

log = logging.getLogger("shardtrain")


class StoragesByBlock(TorchDispatchMode):
    """The storage of every tensor an operator makes while a block runs (not a view or an in-place
    result of one of its inputs), with the block's index; weakly referenced, so that what is alive
    later is what something still holds."""

    def __init__(self) -> None:
        super().__init__()
        self.block: int | None = None
        self.made: dict[int, tuple[StorageWeakRef, int, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.block is None:
            return out
        inputs = {StorageWeakRef(t.untyped_storage()).cdata
                  for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in inputs:
                    self.made[ref.cdata] = (ref, storage.nbytes(), self.block)
        return out

    def alive_by_block(self, blocks: int) -> list[int]:
        kept = [0] * blocks
        for ref, nbytes, block in self.made.values():
            if not ref.expired():
                kept[block] += nbytes
        return kept


def block_tagging_hooks(blocks: list[nn.Module], mode: StoragesByBlock) -> list:
    """Hooks that tell ``mode`` which block is running."""
    def enter(index: int) -> Callable:
        def hook(module, args):  # noqa: ARG001
            mode.block = index
        return hook

    def leave(module, args, output):  # noqa: ARG001
        mode.block = None

    return [handle for index, block in enumerate(blocks)
            for handle in (block.register_forward_pre_hook(enter(index)), block.register_forward_hook(leave))]


# Two short lengths: a block keeps a + c * T bytes a token at T tokens (c: attention's T x T tensors).
PROBE_LENGTHS = (32, 64)


@dataclass
class Measured:
    base: list[float]  # per block, bytes a token whatever the length
    per_length: list[float]  # per block, bytes a token per token of the length (T x T tensors)
    eager: bool  # eager attention: its scores are T x T in every layer
    layers_with_a_mask: Callable[[int, bool], list[bool]] | None  # (seq_len, document_mask)


_measured: dict[tuple, Measured | None] = {}


def kept_by_block(model_cfg: ModelConfig, seq_len: int, dtype: torch.dtype,
                  document_mask: bool = False) -> list[int] | None:
    """Bytes each block of ``model_cfg``'s model keeps from its forward to its backward for one
    sequence of ``seq_len`` tokens, parameters in ``dtype`` (FSDP's compute dtype; buffers keep
    theirs, as under its mixed precision). A micro-batch keeps that many times its sequences.

    Measured at two short lengths and extended: per token, a constant and a term in the length,
    the T x T tensors: eager attention's scores, and the mask an SDPA layer keeps where it needs one
    (a sliding window shorter than the sequence, packed documents). Under fake tensors transformers
    makes every SDPA layer a mask (it cannot tell that none is needed): where a real run's layer has
    none, that term is left out. Measured once per model and dtype in a process (a second for a 70B
    model). None, with one warning, where the model's code cannot run on fake tensors."""
    key = (model_cfg.name, model_cfg.path, dtype)
    if key not in _measured:
        try:
            (short, eager, masks), (long, _, _) = (measure(model_cfg, length, dtype)
                                                   for length in PROBE_LENGTHS)
        except Exception as exc:  # the family's own code, on fake tensors: any error type
            log.warning("the memory planner could not measure the blocks of %s on fake tensors (%s: %s); "
                        "it counts them as Llama blocks, which may be under what they keep: check with "
                        "shardtrain plan --simulate", model_cfg.path, type(exc).__name__,
                        (str(exc).splitlines() or [""])[0])
            _measured[key] = None
        else:
            t1, t2 = PROBE_LENGTHS
            per_length = [(k2 / t2 - k1 / t1) / (t2 - t1) for k1, k2 in zip(short, long)]
            base = [k1 / t1 - c * t1 for k1, c in zip(short, per_length)]
            _measured[key] = Measured(base, per_length, eager, masks)
    m = _measured[key]
    if m is None:
        return None
    masked = m.layers_with_a_mask(seq_len, document_mask) if m.layers_with_a_mask else []
    if len(masked) != len(m.base):
        masked = [document_mask] * len(m.base)
    return [round(seq_len * (a + (c * seq_len if m.eager or mask else 0)))
            for a, c, mask in zip(m.base, m.per_length, masked)]


def measure(model_cfg: ModelConfig, seq_len: int, dtype: torch.dtype
            ) -> tuple[list[int], bool, Callable[[int, bool], list[bool]] | None]:
    """What each block keeps for one sequence of ``seq_len`` tokens; whether the model runs eager
    attention; which of its layers get a mask (``HFCausalLM.layers_with_a_mask``)."""
    with torch.device("meta"):
        model = build_model(model_cfg)
    blocks = [module for module in model.modules() if isinstance(module, model.block_classes)]
    eager = bool(getattr(getattr(model, "dims", None), "eager_attention", False))
    masks = getattr(model, "layers_with_a_mask", None)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    mode = StoragesByBlock()
    hooks = block_tagging_hooks(blocks, mode)
    try:
        with fake:
            model.to_empty(device="cpu")
            for param in model.parameters():
                if param.is_floating_point():
                    param.data = param.data.to(dtype)
            tokens = torch.zeros(1, seq_len, dtype=torch.long)
        with fake, mode:
            logits = model(tokens)
        gc.collect()
        kept = mode.alive_by_block(len(blocks))
        del logits
    finally:
        for hook in hooks:
            hook.remove()
    return kept, eager, masks
