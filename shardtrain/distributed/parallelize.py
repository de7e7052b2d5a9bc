"""Apply FSDP2 to a model: wrap units, activation checkpointing, ``fully_shard`` bottom-up.

The order of the whole build (meta -> shard -> materialise) lives in ``sharded_model``; this module
decides the units and applies FSDP2 to them.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Shard
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shardtrain.accelerator import check_float8, pin_offloaded_memory
from shardtrain.config.plan import ShardingPlan, dtype_name
from shardtrain.distributed.embedding_exchange import (
    exchange_embedding_rows,
    exchangeable,
    exchanges_rows,
    plain_embedding,
)
from shardtrain.distributed.preconditions import (
    check_single_registration,
    check_tied_within_units,
    module_class_paths,
    resolve_wrap_classes,
)
from shardtrain.errors import ConfigError, ModelError
from shardtrain.models.lean_ops import checkpointed
from shardtrain.models.lora import is_adapter


@dataclass(frozen=True)
class Float8Training:
    """strategy.float8's torchao calls. They live in shardtrain.distributed.float8, which registers
    them here when imported: that module imports torchao, which costs every start-up 2.4 s and logs a
    line about its CUDA kernels on a CPU machine, so only a run that asks for float8 imports it (the
    command line does; a program calling Trainer.create itself imports shardtrain.distributed.float8
    first)."""

    # Swaps the eligible linear layers inside the named blocks (their weights gathered in float8 or
    # not); their names.
    convert: Callable[[nn.Module, Sequence[str], bool], list[str]]
    # Every converted weight's float8 scale in one pass and one all-reduce, for FSDP's next gathers:
    # without it each gather reduces an amax per weight (on an H200 the 1.1B Llama's float8 step was
    # bound by the host issuing those, docs/benchmarks.md).
    precompute_scales: Callable[[nn.Module], None]
    # A converted weight's local tensor as a plain tensor (the same storage), any other tensor as
    # it is: weights gathered in float8 are torchao's tensor subclass, which checkpoints must not
    # pickle (reading one back would need torchao imported: consolidate, eval, a resume without
    # float8 all failed to unpickle it).
    plain_tensor: Callable[[torch.Tensor], torch.Tensor]


float8_training: list[Float8Training] = []
FLOAT8_MULTIPLE = 16  # float8 matmuls (torch._scaled_mm) need both sizes of a weight to divide by it


def refresh_float8_scales(model: nn.Module) -> None:
    """The float8 scales of ``model``'s converted weights as they are now, for the next gathers."""
    float8_training[-1].precompute_scales(model)


def precompute_float8_scales_after_steps(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """After each of ``optimizer``'s steps, the float8 scales of ``model``'s converted weights for
    the next step's gathers (as torchtitan does). Until the first step each gather computes its
    weight's scale itself; weights changed other than by a step need ``refresh_float8_scales``."""
    optimizer.register_step_post_hook(lambda *_: refresh_float8_scales(model))


def plain_float8_weights(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a model's or optimizer's state dict, nested) with every float8-converted weight as
    a plain DTensor over the same storage, so that a checkpoint holds plain tensors whatever reads it
    (a load into the plain view fills the converted weight). ``state`` itself where no run in this
    process converted any."""
    if not float8_training:
        return state
    plain = float8_training[-1].plain_tensor

    def unwrapped(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: unwrapped(item) for key, item in value.items()}
        if not isinstance(value, DTensor):
            return value
        local = value.to_local()
        inner = plain(local)
        if inner is local:
            return value
        return DTensor.from_local(inner, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())

    return unwrapped(state)


def trains_any(model: nn.Module, modules: Sequence[str]) -> bool:
    """Whether any of ``model``'s ``modules`` (names) has a weight the optimizer updates."""
    return any(model.get_submodule(name).weight.requires_grad for name in modules)


def float8_eligible(model: nn.Module, name: str, module: nn.Module) -> bool:
    """Whether strategy.float8 converts ``module`` (``name`` in a block of ``model``): a linear layer
    of float8-able sizes, neither a LoRA adapter's (they train in fp32, and whether they divided by
    16 would depend on the rank) nor the output head, whose logits' precision matters most. Only the
    blocks' linears are asked: a head outside them is never converted, even where ``output_head``
    does not name it (a Hugging Face model that scales its logits) or its weight is the embedding's.
    Nor ``nn.MultiheadAttention``'s ``out_proj``, whose weight it reads without calling the layer (a
    float8 weight there failed in torchao's addmm at two ranks, and ran in fp32 uncounted at one)."""
    head_of = getattr(model, "output_head", None)
    return (isinstance(module, nn.Linear) and not isinstance(module, NonDynamicallyQuantizableLinear)
            and module.in_features % FLOAT8_MULTIPLE == 0
            and module.out_features % FLOAT8_MULTIPLE == 0 and not is_adapter(name + ".")
            and not (callable(head_of) and module is head_of()))

# strategy.activation_checkpointing=selective is a per-operator policy after torchtitan's: a block
# keeps the outputs of its attention and of every second matmul and recomputes everything else in
# backward. Keeping every matmul's output would keep more than no checkpointing with the built-in
# Llama's lean layers, which already keep only what is costly to recompute (models/lean_ops.py).
# Which second ones: torchtitan keeps the odd ones (the built-in Llama's wq, wv, w1, w2), but
# non-reentrant checkpointing stops the recomputation once backward has every tensor the block
# saved, and a plain matmul saves its inputs before it runs, so the block's last matmul (w2) is
# never rerun and its kept output never read: a hidden-size tensor a token held for nothing. Counted
# back from the one before the last (wk, wo, w3 kept; wq, wv, w1 rerun) the recomputation costs the
# same and keeps that much less (docs/benchmarks.md). A LoRA adapter's matmuls and a float8 linear
# (autograd Functions) save after the base matmul has run, so there the last one is rerun unless
# kept, and the count back from the last keeps it (torchtitan's choice for the built-in Llama).
SELECTIVE_MATMULS = frozenset({
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    # torch's float8 matmul, wherever the policy sees it as that (in eager mode a float8 linear's
    # matmul reaches the policy as aten.mm on torchao's tensor, counted above)
    torch.ops.aten._scaled_mm.default,
})
# Tensor parallelism's reduce-scatters (sequence parallel: the row-wise projections' outputs), kept as
# torchtitan keeps them: recomputed, each reran a collective on backward's critical path, as full
# checkpointing does (counted in a backward at tensor_parallel=2: 10 reduce-scatters for none's 7).
SELECTIVE_COLLECTIVES = frozenset({torch.ops._c10d_functional.reduce_scatter_tensor.default})
# transformers' eager attention: the scores (q @ k^T) and their product with the values, batched;
# told from other batched matmuls (rotary tables, experts) by their square T x T operand.
EAGER_ATTENTION_MATMULS = frozenset({torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default})
SELECTIVE_ATTENTION = frozenset({
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
})


def last_projection_adapted(block: nn.Module) -> bool:
    """Whether ``block``'s last projection carries a LoRA adapter: its last linear layer other than an
    adapter's, in registration order, which is the forward's for the built-in Llama and the Hugging
    Face layouts (w2, down_proj, dense_4h_to_h); PEFT's layer holds it as ``<name>.base_layer``."""
    names = [name for name, module in block.named_modules() if isinstance(module, nn.Linear)]
    base = [name for name in names if not is_adapter(name + ".")]
    if not base:
        return False
    owner = base[-1].removesuffix(".base_layer")
    return any(is_adapter(name + ".") and name.startswith(owner + ".") for name in names)


def adapter_a_matrices(block: nn.Module) -> list[nn.Linear]:
    """The A matrices of ``block``'s LoRA adapters (``<module>.lora_A.<adapter>``)."""
    return [module for name, module in block.named_modules()
            if isinstance(module, nn.Linear) and ".lora_A." in name + "."]


def adapter_ranks(block: nn.Module) -> frozenset[int]:
    """The ranks of ``block``'s LoRA adapters (their A matrices' output widths)."""
    return frozenset(module.out_features for module in adapter_a_matrices(block))


def nothing_in_float8(blocks: int) -> str:
    """strategy.float8's refusal of a model with no linear layer it converts in its ``blocks``."""
    return (f"strategy.float8=true found no linear layer to convert in the model's {blocks} blocks: float8 "
            f"takes nn.Linear layers whose sizes are multiples of {FLOAT8_MULTIPLE}, not the output head or "
            "LoRA's adapters; drop strategy.float8")


def lora_rank_clash(block: nn.Module) -> int | None:
    """The LoRA rank of ``block``'s adapters where it is also the width of one of its projections,
    else None: selective checkpointing tells an adapter's matmuls apart by that size."""
    widths = {size for name, module in block.named_modules()
              if isinstance(module, nn.Linear) and not is_adapter(name + ".")
              for size in (module.in_features, module.out_features)}
    clashes = adapter_ranks(block) & widths
    return min(clashes) if clashes else None


def selective_clash_message(rank: int) -> str:
    return (f"strategy.activation_checkpointing=selective tells LoRA's matmuls apart by the rank, and "
            f"finetune.rank={rank} is also a width of this block's projections; choose another "
            "finetune.rank, or activation_checkpointing=all")


def block_selective_contexts(block: nn.Module, float8: bool,
                             eager_attention: bool = False) -> Callable[[], tuple]:
    """``selective_contexts`` for ``block`` (``float8``: some of its linears are float8): every second
    of its projections kept counting back from the last, that one kept only where the recomputation
    would rerun it (an adapter on it, float8), the adapters' own matmuls recomputed and not counted.

    An adapter's matmuls are told apart by their size: one of the pair's sizes is the LoRA rank,
    which must then be no projection's width (refused otherwise). A size, unlike a forward hook,
    is what the compiler's graph still shows, so compiled and eager blocks keep the same outputs.
    ``eager_attention``: the block's attention is transformers' eager one, two batched matmuls a
    layer (``EAGER_ATTENTION_MATMULS``), told apart by their T x T operand (``attention_matmul``)."""
    if (rank := lora_rank_clash(block)) is not None:
        raise ConfigError(selective_clash_message(rank))
    linears = [name for name, module in block.named_modules() if isinstance(module, nn.Linear)]
    projections = sum(not is_adapter(name + ".") for name in linears)
    last_kept = 0 if last_projection_adapted(block) or float8 else 1  # (projections - matmul) % 2
    return functools.partial(selective_contexts, lambda matmul: (projections - matmul) % 2 == last_kept,
                             adapter_ranks=adapter_ranks(block), eager_attention=eager_attention)


def eager_attention(model: nn.Module) -> bool:
    """Whether ``model``'s attention is transformers' eager one (a family without SDPA: Gemma 2)."""
    return bool(getattr(getattr(model, "dims", None), "eager_attention", False))


def attention_matmul(op, args: tuple) -> str | None:
    """Which of eager attention's batched matmuls ``op(*args)`` is: ``scores`` (q @ k^T, a T x T
    output), ``output`` (the T x T probabilities times the values), ``either`` (a head size equal to
    the length makes both square), else None (another batched matmul, or not one)."""
    if op not in EAGER_ATTENTION_MATMULS:
        return None
    left, right = args[1:3] if op == torch.ops.aten.baddbmm.default else args[:2]
    square_input, square_output = left.shape[-2] == left.shape[-1], left.shape[-2] == right.shape[-1]
    if square_input and square_output:
        return "either"
    return "output" if square_input else "scores" if square_output else None


def matmul_sizes(op, args: tuple) -> tuple[int, int]:
    """The inner and output sizes of a matmul ``op`` of ``SELECTIVE_MATMULS`` called with ``args``."""
    with_input = op in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default)
    left, right = args[1:3] if with_input else args[:2]
    return left.shape[-1], right.shape[-1]


def selective_contexts(keeps_matmul: Callable[[int], bool],
                       adapter_ranks: frozenset[int] = frozenset(), eager_attention: bool = False) -> tuple:
    """Fresh (forward, recompute) contexts for every checkpointed call, as torch requires, that keep
    attention's outputs and those of the matmuls ``keeps_matmul`` picks by their 1-based order in
    the forward. torch 2.13 calls the policy in the forward only;
    earlier versions call it in the recomputation too, which must count afresh to pick the same
    ones (``ctx.is_recompute``). A matmul with an inner or output size in ``adapter_ranks`` (a LoRA
    adapter's low-rank pair) is recomputed and not counted, so the projections' order is the base
    model's and no adapter output as large as its projection's is kept beside it. With
    ``eager_attention``: the scores (recomputed) and their product with the values (kept, as SDPA's
    output is), neither counted."""
    matmuls = {False: 0, True: 0}  # by ctx.is_recompute
    ambiguous = {False: 0, True: 0}  # eager attention's matmuls both square: scores, output, ...

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ARG001
        if op in SELECTIVE_ATTENTION or op in SELECTIVE_COLLECTIVES:
            return CheckpointPolicy.MUST_SAVE
        if eager_attention and (part := attention_matmul(op, args)) is not None:
            if part == "either":
                ambiguous[ctx.is_recompute] += 1
                part = "output" if ambiguous[ctx.is_recompute] % 2 == 0 else "scores"
            return CheckpointPolicy.MUST_SAVE if part == "output" else CheckpointPolicy.PREFER_RECOMPUTE
        if op in SELECTIVE_MATMULS:
            if adapter_ranks and not adapter_ranks.isdisjoint(matmul_sizes(op, args)):
                return CheckpointPolicy.PREFER_RECOMPUTE
            matmuls[ctx.is_recompute] += 1
            if keeps_matmul(matmuls[ctx.is_recompute]):
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def enable_activation_checkpointing(module: nn.Module, contexts: Callable[[], tuple] | None = None) -> None:
    """Recompute this module's activations in backward: all of them, or (with ``contexts``, a
    selective-checkpointing context factory such as ``block_selective_contexts`` returns) all but
    the outputs its policy keeps from the forward.

    The instance's ``forward`` is replaced instead of wrapping the module, so parameter names (and
    therefore checkpoints) do not change with the activation-checkpointing setting. FSDP's hooks sit
    on ``__call__`` and still run around it.
    """
    inner = module.forward
    options = {"context_fn": contexts} if contexts is not None else {}
    norms = [m for m in module.modules() if getattr(m, "track_running_stats", False)]

    def run(*args, **kwargs):
        # In the forward and in the recomputation alike: the lean layers leave what is saved to
        # the checkpoint (models/lean_ops.py). Compiled, the compiler decides that (and recomputes
        # no buffer's update).
        if torch.compiler.is_compiling():
            return inner(*args, **kwargs)
        with checkpointed():
            return inner(*args, **kwargs)

    def counted(*args, **kwargs):
        """``run`` for a block with running statistics, called once a forward and once a
        recomputation, which it tells apart by a count kept outside it."""
        calls[-1] += 1
        with checkpointed(), running_stats_kept(norms, recompute=calls[-1] > 1):
            return inner(*args, **kwargs)

    calls = [0]

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not norms:
            return checkpoint(run, *args, use_reentrant=False, **options, **kwargs)
        calls[-1] = 0  # this forward's count (its recomputation comes in the backward, after it)
        return checkpoint(counted, *args, use_reentrant=False, **options, **kwargs)

    module.forward = forward


@contextlib.contextmanager
def running_stats_kept(norms: Sequence[nn.Module], recompute: bool) -> Iterator[None]:
    """BatchNorm-style ``norms`` (``track_running_stats``) in training mode leave their running
    statistics as a ``recompute`` found them: a recomputation's forward must not move them a second
    time (found by a trial: num_batches_tracked 8 after 4 checkpointed steps, and evaluation changed
    with activation_checkpointing). Put back afterwards rather than left out of the call: without
    them it saves other tensors than the forward did, which the checkpoint refuses. The forward
    makes the same copies (and copies each statistic onto itself): selective checkpointing replays
    a recomputation's operators against the forward's, one for one."""
    # (read as they may be there: a module of one's own that says track_running_stats need not
    # hold BatchNorm's three; found by review)
    stats = [buffer for norm in norms if norm.training
             for buffer in (getattr(norm, name, None) for name in ("running_mean", "running_var",
                                                                   "num_batches_tracked"))
             if isinstance(buffer, torch.Tensor)]
    with torch.no_grad():
        kept = [buffer.clone() for buffer in stats]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(stats, kept, strict=True):
                buffer.copy_(value if recompute else buffer)


def largest_first(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """A grouped unit's modules, the one with the most parameter elements first and the smallest
    last. FSDP2's reduce-scatter (``foreach_reduce``, torch 2.11-2.13) keeps the unit's last gradient
    alive until the collective is done (a loop variable still names it), beside the collective's
    buffers: let that be the final norm's, not the output head's (62 MiB a rank at the ablation's
    32k vocabulary, when every block's activations are still alive). The order changes nothing else:
    each parameter is sharded on its own, so the shards, checkpoints and optimizer are the same."""
    return sorted(modules, key=lambda m: sum(p.numel() for p in m.parameters()), reverse=True)


@dataclass
class ShardingReport:
    units: list[str] = field(default_factory=list)
    # The classes the wrap policy resolved to (``auto``: the model's block_classes; a task's own).
    wrap_classes: list[str] = field(default_factory=list)
    wrap_policy: list[str] = field(default_factory=list)  # the policy's entries, as given
    wrap_source: str = "strategy.wrap_policy"  # what gave it (a task's wrap_policy())
    fp32_norms: list[str] = field(default_factory=list)  # norm layers in fp32 units of their own
    checkpointed: list[str] = field(default_factory=list)
    # Parameters (global element count) per unit, the root's own last.
    unit_params: dict[str, int] = field(default_factory=dict)
    float8_linears: list[str] = field(default_factory=list)  # strategy.float8's converted layers
    # Whether their scales are worth computing after each optimizer step for the next gathers: not
    # where they are gathered in the compute dtype (ShardingPlan.gathers_float8), nor with
    # strategy.cpu_offload, where FSDP copies each shard to the device before its gather and
    # torchao's copy drops the precomputed scale (each gather computes its own anyway).
    float8_scales_precomputed: bool = False
    # Under tensor parallelism: each parameter's layout over tp (blocks' names as ``layers.*``).
    tensor_parallel: dict[str, str] = field(default_factory=dict)
    # Embeddings looked up by exchanging rows, not FSDP units (strategy.embedding_lookup=exchange).
    exchanged_embeddings: list[str] = field(default_factory=list)
    # Trainable parameters the model was built with in another dtype than the storage's, cast to it:
    # elements by their dtype as built.
    upcast: dict[str, int] = field(default_factory=dict)


# A task's own tensor-parallel plan: ``parallelize_tensors(model, tp_mesh, sequence_parallel)``
# applies it to the unsharded model in place.
TensorPlan = Callable[[nn.Module, DeviceMesh, bool], None]


def extra_groups(model: nn.Module) -> list[list[nn.Module]]:
    """The model's units beside its blocks (``extra_shard_groups``: the embedding, the final norm
    with the head), the empty ones left out (a model whose embeddings are a block class)."""
    return [group for group in getattr(model, "extra_shard_groups", list)() if group]


def outermost_blocks(model: nn.Module, wrap: tuple[type, ...]) -> list[tuple[str, nn.Module]]:
    """The modules of the ``wrap`` classes, as (name, module), that lie inside no other such module
    and are no extra group's member: units may not overlap (FSDP refused nested matches sharded
    parent first, "overlapping meshes", and a module sharded twice); a class inside another's blocks
    (a Hugging Face attention listed beside its decoder layer) is sharded with them. Blocks inside a
    group's module (an encoder made one group) stay units of their own, sharded before it."""
    grouped = {id(module) for group in extra_groups(model) for module in group}
    taken: list[str] = []
    found = []
    for name, module in model.named_modules():
        if module is model or not isinstance(module, wrap) or id(module) in grouped:
            continue
        if any(name.startswith(prefix) for prefix in taken):
            continue
        found.append((name, module))
        taken.append(f"{name}.")
    return found


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: ShardingPlan,
                wrap_policy: Sequence[str | type], tensor_plan: TensorPlan | None = None,
                before_sharding: Callable[[nn.Module], set[nn.Parameter]] | None = None) -> ShardingReport:
    """Shard ``model`` in place, bottom-up: every matched block, the model's extra groups, the root.
    ``tensor_plan``: the task's tensor-parallel plan, used instead of the model's own.
    ``before_sharding``: a conversion of the model's parameters in their storage dtype that FSDP must
    see when it shards them (QLoRA's NF4 base); it returns the parameters FSDP must leave alone."""
    check_single_registration(model)
    wrap = resolve_wrap_classes(model, wrap_policy)
    names = {m: n for n, m in model.named_modules()}
    groups = extra_groups(model)
    blocks = outermost_blocks(model, wrap)
    if wrap and not blocks:
        # What it matched are the extra groups' members (the embedding, the head): the blocks would
        # be in the root unit, gathered whole, with nothing checkpointed or compiled (found by review)
        raise ModelError(
            f"wrap policy [{', '.join(c.__qualname__ for c in wrap)}] matches only modules of the model's "
            f"extra shard groups (the embedding, the head), which are units of their own, so no block of "
            f"{type(model).__name__} would be one; name its block class, one of: "
            + ", ".join(module_class_paths(model)))
    # A group's members inside a block are the block's: a model's groups follow its own block
    # classes, and a wrap policy naming others (Electra's layers, which it does not declare) left the
    # layers' linears in the head's group too, sharded twice ("Cannot concatenate overlapping
    # meshes": found by a trial)
    inside = {id(m) for _, block in blocks for m in block.modules()}
    groups = [kept for group in groups if (kept := [m for m in group if id(m) not in inside])]
    # Units as (name, modules, reshard_after_forward). By convention the last extra group holds the
    # output head: its weights are needed again at once in backward, and so are the last block's,
    # so (like torchtitan) neither is resharded after forward, which would only gather them again.
    last = len(blocks) - 1
    units = [(name, [block], False if index == last and plan.reshard_after_forward is True
              else plan.reshard_after_forward) for index, (name, block) in enumerate(blocks)]
    units += [("+".join(names[m] for m in group), group,
               False if index == len(groups) - 1 else plan.reshard_after_forward)
              for index, group in enumerate(groups)]

    given = [entry if isinstance(entry, str) else f"{entry.__module__}.{entry.__qualname__}"
             for entry in wrap_policy]
    report = ShardingReport(wrap_classes=[cls.__qualname__ for cls in wrap], wrap_policy=given,
                            wrap_source=getattr(wrap_policy, "source", "strategy.wrap_policy"))
    seen: set[int] = set()
    for name, modules, _ in units:
        params = {id(p): p for m in modules for p in m.parameters() if id(p) not in seen}
        seen.update(params)
        report.unit_params[name] = sum(p.numel() for p in params.values())
    report.unit_params["<root>"] = sum(p.numel() for p in model.parameters() if id(p) not in seen)
    check_tied_within_units(model, [name for name, _, _ in units])
    if plan.tensor_parallel > 1:
        # Tensor parallelism first: fully_shard then shards each TP shard over the data-parallel
        # dimensions, giving 2-D (or 3-D) DTensor parameters on the one mesh.
        apply_tensor_parallel(model, mesh["tp"], plan.sequence_parallel, tensor_plan)
        report.tensor_parallel = tensor_parallel_layout(model)
        mesh = mesh[plan.data_parallel_dims]

    norms = fp32_norms(model, plan, [modules for _, modules, _ in units])
    if plan.storage_dtype != torch.float32:
        # Parameters only: buffers such as RoPE tables keep their own (fp32) precision. LoRA
        # adapters stay fp32 (their updates are small against their values; FSDP2 gathers a unit
        # of mixed dtypes in param_dtype) and so does their Adam state; so do the norms above.
        in_norms = {id(param) for norm in norms for param in norm.parameters()}
        for name, param in model.named_parameters():
            if not is_adapter(name) and id(param) not in in_norms:
                param.data = param.data.to(plan.storage_dtype)
    else:
        # A model built in bf16 (from_pretrained(torch_dtype=...), .half()) would train with bf16
        # master weights, gradients and Adam state under a precision that promises fp32 ones:
        # trainable parameters are stored as the plan says; frozen ones (a LoRA base, a frozen
        # encoder) keep the dtype they were given.
        for param in model.parameters():
            if param.requires_grad and param.is_floating_point() and param.dtype != plan.storage_dtype:
                built = dtype_name(param.dtype)
                report.upcast[built] = report.upcast.get(built, 0) + param.numel()
                param.data = param.data.to(plan.storage_dtype)
    mp = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
    common = dict(mesh=mesh, mp_policy=mp)
    if plan.cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_offloaded_memory(mesh.device_type))

    if plan.float8:
        check_float8(torch.device(mesh.device_type))
        if not float8_training:
            raise ConfigError("strategy.float8=true: import shardtrain.distributed.float8 before building "
                              "the model (it loads torchao; shardtrain train does it for you)")
        # Before fully_shard, which then gathers the converted weights in float8 where they are sharded.
        report.float8_linears = float8_training[-1].convert(model, [name for name, _ in blocks],
                                                            plan.gathers_float8)
        if not report.float8_linears:  # it trained on in the compute dtype, the start-up line saying float8
            raise ConfigError(nothing_in_float8(len(blocks)))
        report.float8_scales_precomputed = plan.gathers_float8 and not plan.cpu_offload
    if before_sharding is not None and (ignored := before_sharding(model)):
        common["ignored_params"] = ignored
    for index, (name, block) in enumerate(blocks):
        if plan.checkpointed(index):
            contexts = None
            if plan.activation_checkpointing == "selective":
                float8 = any(layer.startswith(name + ".") for layer in report.float8_linears)
                contexts = block_selective_contexts(block, float8, eager_attention(model))
            enable_activation_checkpointing(block, contexts)
            report.checkpointed.append(name)
    if exchanges_rows(plan):
        kept = []
        for unit in units:
            name, modules, _ = unit
            if not exchangeable(model, modules):
                kept.append(unit)
                continue
            weight = exchange_embedding_rows(modules[0], mesh, plan.param_dtype)
            common["ignored_params"] = common.get("ignored_params", set()) | {weight}
            report.exchanged_embeddings.append(name)
        units = kept
    in_fp32 = {**common, "mp_policy": MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=plan.reduce_dtype, cast_forward_inputs=False)}
    norm_ids, members = {id(norm) for norm in norms}, {id(m) for _, modules, _ in units for m in modules}
    for norm in norms:  # before the units that hold them: FSDP2 shards children first
        if id(norm) not in members:  # (a unit of norms alone is sharded so below)
            fully_shard(norm, reshard_after_forward=plan.reshard_after_forward, **in_fp32)
            report.fp32_norms.append(names[norm])
    for name, modules, reshard in units:
        if plan.tensor_parallel > 1:
            for module in modules:  # before fully_shard's own hook, after the tensor-parallel style's
                module.register_forward_hook(output_own_storage)
        norms_alone = all(id(m) in norm_ids for m in modules)
        fully_shard(largest_first(modules) if len(modules) > 1 else modules[0], reshard_after_forward=reshard,
                    **(in_fp32 if norms_alone else common))
        if norms_alone:
            report.fp32_norms.append(name)
        if reshard and all(plain_embedding(m) for m in modules):
            # An embedding's backward reads the token ids, never its weight: gathering the table
            # again for backward would cost an all-gather of it, and its memory, every step.
            modules[0].set_unshard_in_backward(False)
        report.units.append(name)
    fully_shard(model, **common)
    report.units.append("<root>")
    # Forward order: the blocks, then the head's group (the convention above). A tied model's one
    # group holds the embeddings, gathered before any block and kept, so it needs no prefetch.
    prefetch_in_forward([block for _, block in blocks] + ([groups[-1][0]] if len(groups) > 1 else []))
    return report


def fp32_norms(model: nn.Module, plan: ShardingPlan, units: Sequence[Sequence[nn.Module]]) -> list[nn.Module]:
    """The BatchNorm-style layers (``track_running_stats``, with a weight or bias) of ``model`` that
    keep fp32 parameters in a unit of their own where the plan computes or stores in another dtype,
    as FSDP1's mixed precision kept ``_BatchNorm`` layers: their running statistics are fp32
    buffers, beside which bf16 weights failed in the forward ("expected scalar type BFloat16 but
    found Float", bf16-mixed and bf16-pure alike; found by a trial). Their input and output stay in
    the compute dtype. A norm the wrap policy makes a unit is one (found by review: left in bf16);
    not one grouped in a unit with other modules, nor the model itself."""
    if plan.param_dtype == torch.float32 and plan.storage_dtype == torch.float32:
        return []

    def is_norm(module: nn.Module) -> bool:
        return (bool(getattr(module, "track_running_stats", False))
                and any(True for _ in module.parameters(recurse=False)))

    # A norm listed beside other modules in one group would be gathered in their dtype: its forward
    # failed as above (found by review); refused, naming the fix
    names = {id(module): name for name, module in model.named_modules()}
    for modules in units:
        norm = next(filter(is_norm, modules), None)
        # (gathered in fp32, under bf16-pure with param_dtype=fp32, it is fine)
        if (norm is not None and len(modules) > 1 and not all(map(is_norm, modules))
                and plan.param_dtype != torch.float32):
            name = names.get(id(norm), type(norm).__name__)
            others = ", ".join(names.get(id(m), type(m).__name__) for m in modules if m is not norm)
            raise ConfigError(f"{name} ({type(norm).__name__}) keeps fp32 running statistics and shares "
                              f"an FSDP unit with {others}, whose weights are gathered in "
                              f"{dtype_name(plan.param_dtype)}: its forward would fail; give it an extra "
                              "shard group of its own (extra_shard_groups)")
    grouped = {id(m) for modules in units if not all(map(is_norm, modules)) for m in modules}
    return [module for module in model.modules()
            if module is not model and is_norm(module) and id(module) not in grouped]


def register_forward_methods(model: nn.Module, names: Sequence[str]) -> None:
    """Methods a task's loss calls instead of the model itself (CLIP's ``encode_image``, a VAE's
    ``encode``/``decode``): FSDP gathers a unit's parameters around its forward only, so each FSDP
    unit that has such a method gathers for it too (``register_fsdp_forward_method``). A name no
    unit has is one line."""
    for name in ((names,) if isinstance(names, str) else names):  # one name alone, not its letters
        units = [module for module in model.modules()
                 if isinstance(module, FSDPModule) and callable(getattr(module, name, None))]
        if not units:
            raise ConfigError(f"forward_methods names {name!r}, which neither {type(model).__name__} nor any "
                              "of its FSDP units has; name the model's methods the loss calls in place of "
                              "model(...)")
        for unit in units:
            register_fsdp_forward_method(unit, name)


def prefetch_in_forward(units: Sequence[nn.Module]) -> None:
    """Each FSDP unit of ``units`` (in forward order) gathers the next one's parameters as soon as
    its own have arrived, rather than the next unit at its own forward.

    FSDP2 issues a unit's all-gather from that unit's forward pre-hook, which hides the gather
    behind compute only while the host runs ahead of the device (CUDA streams); with a host that
    keeps the GPU waiting (small models, eager), each block's forward starts by waiting for its own
    gather. FSDP2 documents a one-unit prefetch as its default overlap issued earlier from the host,
    so it costs no memory beyond it (two units gathered at a time, as the planner counts). On a CPU
    with gloo the gather blocks the host either way, so no overlap is claimed there."""
    for unit, following in zip(units, units[1:]):
        unit.set_modules_to_forward_prefetch([following])


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
                          tensor_plan: TensorPlan | None = None) -> None:
    """The task's tensor-parallel plan (``tensor_plan``) when it has one, else the model's own
    (``parallelize_tensors(tp_mesh, sequence_parallel)``: the built-in Llama's, a Hugging Face
    model's declared plan). Weights tied before it stay tied (``keep_ties``)."""
    ties = tied_places(model)
    if tensor_plan is not None:
        tensor_plan(model, tp_mesh, sequence_parallel)
    else:
        plan = getattr(model, "parallelize_tensors", None)
        if plan is None:
            raise ConfigError(f"{type(model).__name__} has no tensor-parallel plan (a "
                              "parallelize_tensors(tp_mesh, sequence_parallel) method, or the task's "
                              "parallelize_tensors(model, tp_mesh, sequence_parallel)); set "
                              "strategy.tensor_parallel=1")
        plan(tp_mesh, sequence_parallel)
    keep_ties(model, ties)
    for module in model.modules():
        if isinstance(module, nn.Embedding) and isinstance(module.weight, DTensor) and any(
                placement == Shard(0) for placement in module.weight.placements):
            module.register_forward_pre_hook(check_token_ids, prepend=True)


def tied_places(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Where each parameter registered in more than one place sits: (module path, attribute)."""
    places: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((module_name, attr))
    return [where for where in places.values() if len(where) > 1]


def keep_ties(model: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
    """Tie again what a tensor-parallel plan untied: each style distributes its module's weight into
    a parameter of its own, so a tied embedding and head come out as two equal parameters that then
    train apart (the model's own plans tie them again; a task's plan did not, found by review, and
    its checkpoint no longer resumed without tensor parallelism). Two that lie alike share the first
    again; lying differently over tp they cannot be one tensor, which is refused."""
    for where in ties:
        params = [getattr(model.get_submodule(module_name), attr) for module_name, attr in where]
        if all(param is params[0] for param in params):
            continue
        layouts = [(param.device_mesh, tuple(param.placements)) if isinstance(param, DTensor) else None
                   for param in params]
        if all(layout == layouts[0] and param.shape == params[0].shape
               for layout, param in zip(layouts, params)):
            for module_name, attr in where[1:]:
                setattr(model.get_submodule(module_name), attr, params[0])
            continue
        names = ", ".join(f"{'.'.join(filter(None, place))} "
                          f"({'whole' if layout is None else ', '.join(map(repr, layout[1]))})"
                          for place, layout in zip(where, layouts))
        raise ConfigError(f"the tensor-parallel plan splits one tied weight differently: {names}; split "
                          "its modules alike (an nn.Embedding with RowwiseParallel and a head with "
                          "ColwiseParallel both split the vocabulary), leave them all whole, or untie them")


def check_token_ids(module: nn.Embedding, args: tuple) -> None:
    """A vocabulary-split embedding looks an id outside its rows up as every rank's "other" row, a
    zero vector, where a whole table fails: checked without a host read (an accelerator's assertion
    is asynchronous), before the style's own hook makes the ids a DTensor."""
    ids = args[0]
    if isinstance(ids, torch.Tensor) and not isinstance(ids, DTensor) and ids.numel():
        torch._assert_async(((ids >= 0) & (ids < module.num_embeddings)).all(),
                            f"a token id is outside the embedding's {module.num_embeddings} rows: the "
                            "tokenizer and the model's vocabulary size disagree")


def output_own_storage(module: nn.Module, args: Any, output: Any) -> Any:
    """A unit's output as a tensor of its own where a tensor-parallel style handed back a view
    (``DTensor.to_local``, the embedding's): FSDP hooks its backward on the output, and an in-place
    op on a view would drop that hook (torch 2.13 warns of it). One activation copied a step."""
    return output.clone() if isinstance(output, torch.Tensor) and output._base is not None else output


def tensor_parallel_layout(model: nn.Module) -> dict[str, str]:
    """How each parameter lies over tp, once for all blocks: ``Shard(0)`` (split by output rows),
    ``Shard(1)`` (by input columns), ``Replicate()``, or ``whole`` (a plain tensor: every rank
    computes it alike)."""
    layout = {}
    for name, param in model.named_parameters():
        key = re.sub(r"\.\d+\.", ".*.", name)
        layout[key] = repr(param.placements[0]) if isinstance(param, DTensor) else "whole"
    return layout


def reshard_all(model: nn.Module) -> None:
    """Return every FSDP unit to its sharded state after forwards without a backward.

    Evaluation runs forward only. Units that keep parameters unsharded after forward
    (SHARD_GRAD_OP, the head unit) or reshard to a smaller group (an int reshard_after_forward) would
    otherwise stay that way: memory stays high and the registered parameters are not the sharded
    DTensors that the optimizer and checkpoints expect.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def sum_gradients(model: nn.Module, include_unused: bool = False) -> None:
    """Make FSDP sum gradients instead of averaging them: the loss carries the normalisation.

    The loss is divided by the global token count. Plain SUM collectives (no PREMUL_SUM, which gloo
    lacks) so that gloo, NCCL and others take the same path. ``include_unused``
    (strategy.reduce_unused_params): each rank reduces a gradient for every trainable parameter of a
    unit, zeros for those its step did not use, so ranks that used different parameters send
    collectives of the same size.
    """
    if include_unused and not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        raise ConfigError("strategy.reduce_unused_params=true needs FSDP2's "
                          f"set_reduce_scatter_unused_params, which torch {torch.__version__} lacks: use "
                          "a newer torch")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            if include_unused:
                module.set_reduce_scatter_unused_params(True, recurse=False)
