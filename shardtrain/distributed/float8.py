"""``strategy.float8=true``: torchao's float8 training for the blocks' linear layers.

Importing this module registers the conversion with ``parallelize`` (it imports torchao, which only
runs that ask for float8 pay for: see ``parallelize.Float8Training``). As torchtitan does it:
tensor-wise dynamic scaling, applied before ``fully_shard``; where FSDP2 shards the weights over
more than one rank (``ShardingPlan.gathers_float8``) it all-gathers the converted ones in float8
(half the bytes of bf16), and after each optimizer step every converted weight's scale is computed
in one pass and one all-reduce for the next step's gathers. Only the blocks' linear layers are
converted: the output head keeps the compute dtype (the logits' precision matters most), and so do
LoRA adapters and any linear layer whose sizes are not multiples of 16, which float8 matmuls need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torchao.float8 import (
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from shardtrain.distributed import parallelize
from shardtrain.distributed.parallelize import FLOAT8_MULTIPLE, Float8Training, float8_eligible
from shardtrain.errors import TrainingError


def convert_linears(model: nn.Module, blocks: Sequence[str], gather_in_float8: bool) -> list[str]:
    """Swap the eligible linear layers inside ``model``'s ``blocks`` (their names) for torchao's
    ``Float8Linear``, in place; returns their names. ``gather_in_float8``: FSDP gathers their weights
    in float8 (else in the compute dtype, each cast in its linear's forward)."""
    converted: list[str] = []
    prefixes = tuple(block + "." for block in blocks)

    def chosen(module: nn.Module, name: str) -> bool:
        if not (name.startswith(prefixes) and float8_eligible(model, name, module)):
            return False
        converted.append(name)
        return True

    convert_to_float8_training(model, module_filter_fn=chosen,
                               config=Float8LinearConfig(enable_fsdp_float8_all_gather=gather_in_float8))
    for name in converted:
        model.get_submodule(name).register_forward_pre_hook(refuse_uneven_tokens(name))
    return converted


def refuse_uneven_tokens(name: str) -> Callable[[nn.Module, tuple], None]:
    """A forward pre-hook for the float8 linear ``name``: each weight gradient contracts over the
    rows of its input (a micro-batch's tokens), and CUDA's float8 matmul needs them in multiples of
    16. The language model's are checked with the config; a task's batches are checked here, in
    the forward of the first micro-batch that has such a count, not in a GPU kernel's error in its
    backward."""
    def check(module: nn.Module, args: tuple) -> None:
        rows = args[0].numel() // max(args[0].shape[-1], 1)
        # A frozen weight's gradient is not computed where compiled (AOTAutograd drops the matmul;
        # tests/test_float8.py counts them); eager, torchao's backward still computes it.
        needed = module.weight.requires_grad or not torch.compiler.is_compiling()
        if torch.is_grad_enabled() and rows % FLOAT8_MULTIPLE and needed:
            raise TrainingError(
                f"strategy.float8=true: {name} got {rows} tokens (rows of its input), and its float8 "
                f"weight gradient, which contracts over them, needs a multiple of {FLOAT8_MULTIPLE} (CUDA's "
                "float8 matmul); give the task's micro-batches a multiple of 16 tokens (pad them, or "
                "change trainer.micro_batch_size), or drop strategy.float8")
    return check


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A weight gathered in float8 (torchao's ``WeightWithDynamicFloat8CastTensor``) as the plain
    tensor it wraps; any other tensor as it is."""
    return tensor._tensor if isinstance(tensor, WeightWithDynamicFloat8CastTensor) else tensor


parallelize.float8_training.append(Float8Training(
    convert=convert_linears, precompute_scales=precompute_float8_dynamic_scale_for_fsdp,
    plain_tensor=plain_tensor))
