"""What autograd keeps from each block's forward, measured on a stand-in without data.

The planner counts the built-in Llama's activations tensor by tensor (docs/memory-planner.md). A
Hugging Face family's layers keep what its code keeps: per-head query and key norms (Qwen3, OLMo2,
Gemma 3), four norms a block (Gemma 2 and 3), fp32 upcasts inside its norms, an eager attention's
T x T scores, a state-space scan's chunks. Counted as if they were Llama's, one block's bytes came
out 15% (Qwen3) to 43% (Gemma 3) under what the block keeps in bf16. So for them the planner runs the
model's forward once on fake tensors (shapes only: no memory, no arithmetic) at the run's length and
counts the storages still alive when it has returned, which its autograd graph holds for backward,
by the block whose forward made them.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardtrain.config.schema import ModelConfig
from shardtrain.distributed.parallelize import outermost_blocks
from shardtrain.models.registry import build_model

log = logging.getLogger("shardtrain")


@contextmanager
def fake_tensor_errors_unlogged() -> Iterator[None]:
    """torch's fake tensors log an operator that fails with its whole traceback before raising; the
    callers here say in one line that a probe on fake tensors failed."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


PLAIN, MASK, SCORES = "plain", "mask", "scores"


class StoragesByBlock(TorchDispatchMode):
    """The storage of every tensor an operator makes while a block runs (not a view or an in-place
    result of one of its inputs), with the block's index and its kind: a 4-D tensor T x T in its last
    two dimensions is a mask (one for all heads) or scores (per head); weakly referenced, so that
    what is alive later is what something still holds."""

    def __init__(self, seq_len: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.running: list[int] = []  # the blocks whose forward is running, innermost last
        self.made: dict[int, tuple[StorageWeakRef, int, int, str]] = {}

    def kind(self, tensor: torch.Tensor) -> str:
        if tensor.dim() != 4 or tuple(tensor.shape[-2:]) != (self.seq_len, self.seq_len):
            return PLAIN
        return MASK if tensor.shape[1] == 1 else SCORES

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.running:
            return out
        inputs = {StorageWeakRef(t.untyped_storage()).cdata
                  for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in inputs:
                    self.made[ref.cdata] = (ref, storage.nbytes(), self.running[-1], self.kind(tensor))
        return out

    def alive_by_block(self, blocks: int, counted: Callable[[int, str], bool]) -> list[int]:
        """Bytes alive per block, of the kinds ``counted(block, kind)`` accepts."""
        kept = [0] * blocks
        for ref, nbytes, block, kind in self.made.values():
            if not ref.expired() and counted(block, kind):
                kept[block] += nbytes
        return kept


def block_tagging_hooks(blocks: list[nn.Module], mode: StoragesByBlock) -> list:
    """Hooks that tell ``mode`` which block is running."""
    def enter(index: int) -> Callable:
        def hook(module, args):  # noqa: ARG001
            mode.running.append(index)
        return hook

    def leave(module, args, output):  # noqa: ARG001
        mode.running.pop()

    return [handle for index, block in enumerate(blocks)
            for handle in (block.register_forward_pre_hook(enter(index)), block.register_forward_hook(leave))]


_measured: dict[tuple, list[int] | None] = {}
_unmeasured: dict[tuple[str, str | None], str] = {}  # (model name, path) -> why it could not be measured


def unmeasured(model_cfg: ModelConfig) -> str | None:
    """Why this process could not measure the blocks of ``model_cfg``'s model (``kept_by_block``
    then counted them as Llama blocks), or None."""
    return _unmeasured.get((model_cfg.name, model_cfg.path))


def unmeasured_refusal(model_cfg: ModelConfig) -> str | None:
    """Why ``trainer.micro_batch_size=auto`` is refused for this model, where its blocks could not be
    measured (``unmeasured``): planned from the Llama formula, which may be under what the family
    keeps, a choice could run out of memory mid-run. Said by train and plan alike."""
    why = unmeasured(model_cfg)
    if why is None:
        return None
    return (f"trainer.micro_batch_size=auto: the memory planner could not measure the blocks of "
            f"{model_cfg.path} ({why}), and its Llama estimate may be under what they keep; set "
            "trainer.micro_batch_size=N (shardtrain plan --simulate measures a real step)")


def kept_by_block(model_cfg: ModelConfig, seq_len: int, dtype: torch.dtype,
                  document_mask: bool = False) -> list[int] | None:
    """Bytes each block of ``model_cfg``'s model keeps from its forward to its backward for one
    sequence of ``seq_len`` tokens, parameters in ``dtype`` (FSDP's compute dtype; buffers keep
    theirs, as under its mixed precision). A micro-batch keeps that many times its sequences.

    Eager attention's T x T tensors all count (its scores). In an SDPA layer only a mask does, where a
    real run's layer has one: under fake tensors transformers makes every SDPA layer a causal mask
    (it cannot tell that none is needed), while a real run makes one only where a sliding window is
    shorter than the sequence or packed documents need one (``layers_with_a_mask``); per-head scores
    there are what the CPU's math kernel keeps, not an accelerator's fused one, which the planner
    plans for. (A per-head tensor whose head size equals the sequence length would be taken for
    scores: not a length the planner is for.) Measured once per model, length,
    dtype and masking in a process (a second for a 70B model). None, with one warning, where the
    model's code cannot run on fake tensors."""
    key = (model_cfg.name, model_cfg.path, seq_len, dtype, document_mask)
    if key not in _measured:
        try:
            _measured[key] = measure_or_scale(model_cfg, seq_len, dtype, document_mask)
        except Exception as exc:  # the family's own code, on fake tensors: any error type
            _unmeasured[(model_cfg.name, model_cfg.path)] = (
                f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
            log.warning("the memory planner could not measure the blocks of %s on fake tensors (%s: %s); "
                        "it counts them as Llama blocks, which may be under what they keep: check with "
                        "shardtrain plan --simulate", model_cfg.path, type(exc).__name__,
                        (str(exc).splitlines() or [""])[0])
            _measured[key] = None
    return _measured[key]


def fake_kernel_wants_bf16(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's fake grouped_mm (transformers' MoE experts) refusing a dtype other
    than bf16, which its real kernel takes."""
    return isinstance(exc, RuntimeError) and str(exc).strip().startswith("Expected inputs of BF16 type")


def measure_or_scale(model_cfg: ModelConfig, seq_len: int, dtype: torch.dtype,
                     document_mask: bool) -> list[int]:
    """``measure``; where a kernel's fake version takes bf16 only (transformers' grouped_mm experts
    of a MoE model), measured in bf16 and scaled to ``dtype``'s element size (the few tensors a model
    computes in fp32 whatever its dtype, such as router probabilities, are then over-counted: an
    upper bound, where the fallback to Llama blocks missed the experts' activations)."""
    try:
        return measure(model_cfg, seq_len, dtype, document_mask)
    except RuntimeError as exc:
        if not fake_kernel_wants_bf16(exc) or dtype == torch.bfloat16:
            raise
    scale = torch.empty((), dtype=dtype).element_size() / 2
    return [round(kept * scale) for kept in measure(model_cfg, seq_len, torch.bfloat16, document_mask)]


def measure(model_cfg: ModelConfig, seq_len: int, dtype: torch.dtype, document_mask: bool) -> list[int]:
    """What each block keeps for one sequence of ``seq_len`` tokens (``kept_by_block``)."""
    with torch.device("meta"):
        model = build_model(model_cfg)
    blocks = [module for _, module in outermost_blocks(model, tuple(model.block_classes))]
    eager = bool(getattr(getattr(model, "dims", None), "eager_attention", False))
    masked = model.layers_with_a_mask(seq_len, document_mask)
    if len(masked) != len(blocks):
        raise ValueError(f"{len(blocks)} blocks, but {len(masked)} layers in the config")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    mode = StoragesByBlock(seq_len)
    hooks = block_tagging_hooks(blocks, mode)
    try:
        with fake, fake_tensor_errors_unlogged():
            model.to_empty(device="cpu")
            for param in model.parameters():
                if param.is_floating_point():
                    param.data = param.data.to(dtype)
            tokens = torch.zeros(1, seq_len, dtype=torch.long)
            with mode:
                logits = model(tokens)
        gc.collect()
        kept = mode.alive_by_block(len(blocks), lambda block, kind: (
            kind == PLAIN or eager or (kind == MASK and masked[block])))
        del logits
    finally:
        for hook in hooks:
            hook.remove()
    return kept
