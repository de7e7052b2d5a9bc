"""``shardtrain plan``: per-rank memory for each strategy and world size, before renting a cluster.

States are computed exactly from the model's parameter shapes and FSDP2's layout (dim-0 chunks of
ceil(rows / shard group) rows per rank, the ``torch.chunk`` rule). Activations and communication
buffers are estimates. Formulas and sources: docs/memory-planner.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from fnmatch import fnmatch

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from shardtrain.accelerator import device_type
from shardtrain.config.compose import check_auto_accumulation
from shardtrain.config.plan import (
    ShardingPlan,
    check_auto_global_batch,
    resolve_plan,
    resolve_precision,
    with_global_batch,
)
from shardtrain.config.schema import Config
from shardtrain.config.sizes import counted, human_bytes
from shardtrain.config.strategy import AC_MODES, STRATEGIES, checkpointing_mode
from shardtrain.diagnostics.kept import kept_by_block, unmeasured_refusal
from shardtrain.distributed.embedding_exchange import exchangeable, exchanges_rows
from shardtrain.distributed.parallelize import (
    adapter_a_matrices,
    float8_eligible,
    last_projection_adapted,
    lora_rank_clash,
    nothing_in_float8,
    outermost_blocks,
    selective_clash_message,
)
from shardtrain.distributed.qlora import NF4_BLOCK, NF4_GRAIN, check_quantizable, quantized_linears
from shardtrain.errors import ConfigError
from shardtrain.models.dims import Dims
from shardtrain.models.experts import routed_expert_weights
from shardtrain.models.lora import add_adapters
from shardtrain.models.param_groups import no_decay_names
from shardtrain.models.registry import build_model
from shardtrain.tasks.language_model import output_head
from shardtrain.tasks.losses import chunk_tokens_for

ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, in the parameters' storage dtype
ADAM_STEP_BYTES = 4  # AdamW keeps one fp32 'step' scalar per parameter tensor


def rows_on_rank(rows: int, shard: int, rank: int) -> int:
    chunk = math.ceil(rows / shard) if rows else 0
    return max(0, min(chunk, rows - rank * chunk))


def module_matches(path: str, pattern: str) -> bool:
    """``parallelize_module``'s matching: token by token, each an fnmatch pattern (``layers.*.wq``)."""
    names, tokens = path.split("."), pattern.split(".")
    return len(names) == len(tokens) and all(fnmatch(n, t) for n, t in zip(names, tokens, strict=True))


def split_dims(style: ParallelStyle, module: nn.Module) -> dict[str, int]:
    """Which dimension of each of ``module``'s own parameters ``style`` splits over tp (the layouts
    torch's ``ColwiseParallel`` and ``RowwiseParallel`` give linear and embedding weights); every
    other style (``SequenceParallel``'s norms, ``PrepareModuleInput``) replicates them."""
    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return {"weight": 1} if embedding else {"weight": 0, "bias": 0}
    if isinstance(style, RowwiseParallel):
        return {"weight": 0} if embedding else {"weight": 1}  # a row-wise bias is replicated
    return {}


def tensor_parallel_styles(model: nn.Module, plan: ShardingPlan) -> dict[str, ParallelStyle]:
    """The model's own tensor-parallel plan for ``plan`` (``tensor_parallel_plan(sequence_parallel,
    tp)``), built once for all the planner reads of it; empty without tensor parallelism."""
    if plan.tensor_parallel == 1:
        return {}
    plan_of = getattr(model, "tensor_parallel_plan", None)
    if plan_of is None:
        raise ConfigError(f"the memory planner counts tensor parallelism from a model's "
                          f"tensor_parallel_plan(sequence_parallel, tp), which {type(model).__name__} "
                          "lacks; plan with strategy.tensor_parallel=1")
    return plan_of(plan.sequence_parallel, plan.tensor_parallel)


def tensor_parallel_shapes(model: nn.Module, tp: int,
                           styles: dict[str, ParallelStyle]) -> dict[int, tuple[int, ...]]:
    """Each parameter's shape on rank 0 of the tp group (by ``id``), from the model's plan
    (``tensor_parallel_styles``): the split dimension in ``tp`` chunks, rank 0's the largest
    (``torch.chunk``, as DTensor's ``Shard``). FSDP then shards each of these over the
    data-parallel ranks."""
    shapes = {id(p): tuple(p.shape) for p in model.parameters()}
    if tp == 1:
        return shapes
    modules = list(model.named_modules())
    for pattern, style in styles.items():
        for path, module in modules:
            if not module_matches(path, pattern):
                continue
            for name, dim in split_dims(style, module).items():
                param = getattr(module, name, None)
                if isinstance(param, nn.Parameter):
                    shape = list(param.shape)
                    shape[dim] = math.ceil(shape[dim] / tp)
                    shapes[id(param)] = tuple(shape)
    return shapes


@dataclass
class Estimate:
    """Rank 0's bytes during a training step: exact states, and the phase at which it peaks."""

    strategy: str
    world_size: int
    mesh: tuple[int, ...]
    checkpointed: bool
    params: int
    grads: int  # sharded gradients after backward
    optimizer: int
    accumulation: int  # full gradients held between micro-batches (unsharded accumulation)
    activations: int  # activation peak: saved activations and backward temporaries, most of any phase
    gathered: int  # unsharded parameters and collective buffers at the peak
    peak: int
    peak_phase: str
    # strategy.cpu_offload: the sharded parameters, gradients and optimizer state, in host memory
    # (then params, grads and optimizer, the device's, are 0)
    host: int = 0


def nf4_bytes(elements: int) -> int:
    """Bytes of ``elements`` NF4 values as torchao's ``to_nf4`` stores them: 4 bits each, an int8
    scale per block of 64 and an fp32 factor per 256 scales (QLoRA's double quantisation)."""
    return elements // 2 + elements // NF4_BLOCK + 4 * (elements // NF4_GRAIN)


def sharded_state_bytes(shapes: list[tuple[int, ...]], shard: int, rank: int,
                        storage: torch.dtype) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes held by ``rank`` of a shard group of ``shard`` ranks."""
    size = storage.itemsize
    local = 0
    for shape in shapes:
        rest = math.prod(shape[1:]) if len(shape) > 1 else 1
        local += rows_on_rank(shape[0] if shape else 1, shard, rank) * rest
    optimizer = ADAM_MOMENTS * local * size + ADAM_STEP_BYTES * len(shapes)
    return local * size, local * size, optimizer


def adamw_foreach_temporary(model: nn.Module, shard: int, storage: torch.dtype,
                            shapes: dict[int, tuple[int, ...]] | None = None) -> int:
    """Bytes of the one temporary AdamW's foreach path (``trainer.optimizer_kernel=foreach``)
    allocates: the square root of a parameter group's second moments, all at once, for the larger of
    our two groups. ``shapes``: each parameter's shape before FSDP shards it (by ``id``; under
    tensor parallelism its tp shard's)."""
    skip = no_decay_names(model)
    groups: dict[bool, list[tuple[int, ...]]] = {True: [], False: []}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups[name in skip].append(shapes[id(param)] if shapes else tuple(param.shape))
    return max(sharded_state_bytes(shapes, shard, 0, storage)[0] for shapes in groups.values())


@dataclass
class ActivationModel:
    """Activation bytes of one micro-batch of the built-in Llama, by what holds them."""

    # Kept from each block's forward to its backward, block by block: everything it saves (no
    # checkpointing), its input (checkpointed in full), or its input and the outputs of its
    # attention and every second matmul (selective).
    saved_blocks: list[int]
    block: int  # everything one block saves for backward (recomputed in its backward under AC)
    block_backward: int  # gradients alive inside one block's backward
    # The final norm's tensors and the fp32 log-softmax output; with the chunked loss
    # (trainer.loss_chunk_tokens) instead the gradients it computed in forward: the hidden states'
    # and the head weight's.
    head_saved: int
    # The loss gradient w.r.t. the fp32 logits, in and out of log-softmax; chunked: one chunk's fp32
    # logits, made their gradient in place, beside their compute-dtype copy (backward scales the
    # gradients in place).
    head_backward: int
    # data.document_mask: the additive mask all blocks share, from the forward to the last backward.
    document_mask: int = 0
    # What the recomputation of the last block holds besides ``block``: selective checkpointing's
    # kept outputs autograd itself does not save (k or q before RoPE, wo's or w2's output back to
    # the residual stream); the lean feed-forward's SwiGLU product and the norms' outputs (kept
    # when recomputed).
    recompute_extra: int = 0
    chunked_loss: bool = False  # the head's gradient is complete before backward reaches it
    head_weight_grad: int = 0  # chunked: the head weight's gradient, part of ``head_saved``


def rms_norm_saved(dim: int, compute: int, lean: bool) -> int:
    """Per token, with the output (which the next matmul keeps). ``lean``: the built-in Llama's
    (models/lean_ops.py) keeps its input and an fp32 rsqrt. Otherwise autograd's RMSNorm (Hugging
    Face's) normalises in fp32 (the fp32 input, its rsqrt), then scales in the compute dtype (the
    cast input and the output); in fp32 the input is the fp32 input."""
    if lean:
        return compute * dim + 4 + compute * dim
    cast = compute * dim if compute != 4 else 4 * dim
    return 4 * dim + 4 + cast + compute * dim


def activation_model(cfg: Config, m: Dims, micro_batch: int, compute_dtype: torch.dtype,
                     plan: ShardingPlan, last_adapted: bool | None = None,
                     head: str = "linear") -> ActivationModel:
    """What autograd keeps for the built-in Llama (counted tensor by tensor in
    docs/memory-planner.md; SDPA keeps q, k, v, its output and a log-sum-exp, no score matrix).
    Hugging Face models of the same layout (Llama, Qwen2, Mistral) keep what autograd's plain
    norms, SwiGLU and attention keep (the built-in Llama's lean layers keep less); other layouts
    (GPT-NeoX's LayerNorm and GELU MLP) are estimated as if they had Llama's. ``head``: how the loss
    gets the logits (``logits_path``): "linear" (a head it may apply chunk by chunk), "whole" (the
    model's logits, all at once) or "transformed" (those, after one more element-wise map: Gemma 2's
    soft-cap keeps its tanh's output)."""
    tokens = micro_batch * cfg.trainer.seq_len
    b = compute_dtype.itemsize
    builtin = cfg.model.name == "llama"
    lean = builtin and cfg.model.lean_layers  # models/lean_ops.py
    # Tensor parallelism (models/llama_tp.py) splits the attention by heads and the feed-forward by
    # width over tp; sequence parallelism splits the residual stream and the norms by tokens (seq),
    # and the norms' outputs are gathered whole again for the next matmul, which keeps them.
    tp = plan.tensor_parallel
    seq = tp if plan.sequence_parallel else 1
    head_dim, queries = m.head_dim, m.attention_width
    # With the document mask, keys and values reach SDPA repeated to every query head (models/llama).
    kv = head_dim * (m.n_heads if cfg.data.document_mask else m.n_kv_heads)
    ffn = m.ffn_hidden_dim
    # q k v, lse, output and wo's input: the same tensor for the built-in Llama (SDPA writes it in
    # the query's (B, T, H, D) order), a copy for Hugging Face's (queries rotated as (B, H, T, D)).
    attention = b * (queries + 2 * kv) + 4 * m.n_heads + (1 if builtin else 2) * b * queries
    if m.eager_attention:  # transformers' eager attention (a Hugging Face family without SDPA)
        # Each head's T x T scores: the softmax's fp32 output, its compute-dtype copy (the matmul
        # with the values keeps it) and a soft-cap's tanh output; keys and values repeated to every
        # query head, no log-sum-exp. Attention dropout (0 in the families known) is not counted.
        score = 4 + (b if b != 4 else 0) + (b if m.softcapped_scores else 0)
        attention += score * m.n_heads * cfg.trainer.seq_len + 2 * b * head_dim * (m.n_heads - m.n_kv_heads)
        attention -= 4 * m.n_heads
    # w1 and w3 outputs, their product (and silu's output). The lean feed-forward recomputes the
    # product for w2's backward, except under tensor parallelism (w2 keeps its DTensor) and in a
    # checkpoint's recomputation (the checkpoint's own hooks see every tensor the block saves).
    product_recomputed = lean and tp == 1
    swiglu = (2 if product_recomputed else 3 if lean else 4) * b * ffn
    # A norm's output, which the next projections keep: recomputed for their backward from the lean
    # norm's input and rsqrt (models/lean_ops.project), the same exceptions as the product.
    norm_output_recomputed = product_recomputed
    norm = (rms_norm_saved(m.dim, b, lean) - b * m.dim) // seq + (0 if norm_output_recomputed else b * m.dim)
    block = tokens * (2 * norm + (attention + swiglu) // tp)
    # Selective (parallelize.block_selective_contexts): the input, SDPA's output and log-sum-exp, and
    # every second projection's output in (wq, wk, wv, wo, w1, w3, w2) counted back from the one
    # before the last: wk (before RoPE and any repetition), wo (whole: under tp a partial sum, before
    # its reduction) and w3. With an adapter on the last projection or float8 linears, whose
    # recomputation reruns the last one unless kept, counted back from the last: wq (before RoPE),
    # wv, w1 and w2 (whole).
    projected_kv = head_dim * m.n_kv_heads
    # ``last_adapted``: whether the block's last projection has an adapter (None: any LoRA run's has).
    last_kept = (cfg.finetune.method != "none" if last_adapted is None else last_adapted) or plan.float8
    kept_projections = queries + projected_kv + ffn + last_kept * queries
    # Under sequence parallelism also the two row-wise projections' reduce-scatter outputs, a slice
    # of the sequence each (parallelize.SELECTIVE_COLLECTIVES: rerun, each reran its collective).
    reduce_scattered = 2 * b * m.dim // tp if plan.sequence_parallel else 0
    selective = tokens * (b * (m.dim // seq + m.dim) + (b * kept_projections + 4 * m.n_heads) // tp
                          + reduce_scattered)
    # Inside a block's backward, in its feed-forward's: the incoming gradient, three hidden-size
    # gradients of the SwiGLU and two FFN weights' gradients (w2's, and w1's or w3's), which FSDP
    # reduces only after the whole block's backward. Counting one was within 7% of plan --simulate
    # while the blocks kept more; with the lean blocks it was 9-12% low under full checkpointing.
    ffn_weight_grads = 2
    block_backward = tokens * b * (m.dim + 3 * ffn // tp) + ffn_weight_grads * b * m.dim * ffn // tp
    if m.eager_attention:  # the softmax's fp32 gradient, as large as its scores (plan --simulate)
        block_backward += tokens * 4 * m.n_heads * cfg.trainer.seq_len // tp
    # Under tp the loss is never chunked: it runs on the vocabulary-split logits (loss_parallel).
    # Nor where the model gives its logits only whole (tasks/language_model.py's loss_choice).
    chunked = tp == 1 and head == "linear"
    chunk = min(chunk_tokens_for(cfg.trainer.loss_chunk_tokens, m.vocab_size), tokens) if chunked else 0
    if chunk > 0:  # tasks/losses.py: one chunk's fp32 logits (and their compute-dtype copy) at a time
        head_weight_grad = b * m.vocab_size * m.dim
        head_saved = tokens * (rms_norm_saved(m.dim, b, lean) + b * m.dim) + head_weight_grad
        head_backward = chunk * m.vocab_size * (4 + (b if b != 4 else 0))
    else:
        # Under tp the logits stay split along the vocabulary; loss_parallel's backward holds one
        # more fp32 tensor of their size than the fused kernel does.
        head_weight_grad = 0  # computed in backward, reduced with the head unit
        head_saved = tokens * (norm + 4 * m.vocab_size // tp)
        if head == "transformed":
            head_saved += tokens * b * m.vocab_size // tp
        head_backward = tokens * (8 if tp == 1 else 12) * m.vocab_size // tp
    selective_mode = plan.activation_checkpointing == "selective"
    # the kept outputs autograd does not save itself: wo's or w2's, and k or q before RoPE
    kept_unsaved = m.dim + (queries if last_kept else projected_kv) // tp
    recompute_extra = tokens * b * kept_unsaved if selective_mode else 0
    if product_recomputed and plan.checkpointed(m.n_layers - 1):
        recompute_extra += tokens * b * (ffn + 2 * m.dim)
    kept = selective if selective_mode else tokens * b * m.dim // seq
    return ActivationModel(
        saved_blocks=[kept if plan.checkpointed(i) else block for i in range(m.n_layers)],
        block=block,
        block_backward=block_backward,
        head_saved=head_saved,
        head_backward=head_backward,
        document_mask=tokens * cfg.trainer.seq_len * b if cfg.data.document_mask else 0,
        recompute_extra=recompute_extra,
        chunked_loss=chunk > 0,
        head_weight_grad=head_weight_grad,
    )


def logits_path(model: nn.Module) -> str:
    """How the language-model loss gets ``model``'s logits, for ``activation_model``'s ``head``:
    without an output head it may apply (``output_head``), from the model's whole logits, which
    the planner counted as one chunk's (found by review: Gemma 2 at a 32k vocabulary planned 0.5
    GiB where the step held 2.1, and an auto micro-batch did not fit)."""
    if output_head(model) is not None:
        return "linear"
    # A soft-cap keeps its tanh's output; a scale (Cohere's, Granite's) keeps nothing (found by review)
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return "transformed" if softcap else "whole"


def plan_splits_blocks(model: nn.Module, styles: dict[str, ParallelStyle]) -> bool:
    """Whether the model's tensor-parallel plan (``tensor_parallel_styles``) splits a linear (or
    embedding) inside its blocks (a family may declare a plan that splits its embeddings only:
    Bamba's)."""
    blocks = tuple(f"{name}." for name, module in model.named_modules()
                   if isinstance(module, getattr(model, "block_classes", ())))
    inside = {name for name, _ in model.named_modules() if name.startswith(blocks)}
    # A Hugging Face plan names modules; the built-in Llama's has a few patterns (layers.*.wq).
    return any(isinstance(style, (ColwiseParallel, RowwiseParallel))
               and (pattern in inside if "*" not in pattern
                    else any(module_matches(name, pattern) for name in inside))
               for pattern, style in styles.items())


def split_block_bytes(measured: int, whole_formula: int, split_formula: int, micro_batch: int) -> int:
    """What a measured block (bytes per sequence) keeps under tensor parallelism: the larger of the
    block less what TP takes from a Llama block of the same sizes (heads and feed-forward width over
    tp, the norms over tokens with sequence parallelism) and the block scaled as that Llama block
    scales. The first fits a family whose extra tensors tp leaves whole (Gemma 2's four norms: 1.00
    of plan --simulate at TP 2), the second one whose layers keep less than Llama's where tp splits
    (GPT-NeoX's GELU MLP, where the first went negative at TP 8)."""
    less = measured - (whole_formula - split_formula) // micro_batch
    scaled = measured * split_formula // whole_formula
    return max(less, scaled)


def without_tensor_parallel(plan: ShardingPlan) -> ShardingPlan:
    """``plan`` with its tp dimension left out (and sequence parallelism with it)."""
    kept = [(name, size) for name, size in zip(plan.mesh_dim_names, plan.mesh_shape, strict=True)
            if name != "tp"]
    return replace(plan, mesh_dim_names=tuple(name for name, _ in kept),
                   mesh_shape=tuple(size for _, size in kept), sequence_parallel=False)


def with_blocks_measured(act: ActivationModel, per_sequence: list[int], micro_batch: int,
                         plan: ShardingPlan) -> ActivationModel:
    """``act`` with what each block keeps without checkpointing measured (``diagnostics/kept.py``,
    bytes per sequence): a checkpointed block still keeps what the formula says (its input, or
    selective's outputs), and recomputes the measured block in its backward."""
    if len(per_sequence) != len(act.saved_blocks):
        return act
    measured = [kept * micro_batch for kept in per_sequence]
    saved = [formula if plan.checkpointed(index) else measured[index]
             for index, formula in enumerate(act.saved_blocks)]
    return replace(act, saved_blocks=saved, block=max(measured))


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks as ``parallelize`` makes units of them: the outermost modules of its
    ``block_classes`` (none for a model without them)."""
    return [blk for _, blk in outermost_blocks(model, tuple(getattr(model, "block_classes", ())))]


def float8_block_params(model: nn.Module) -> int:
    """Parameters of the largest block that ``strategy.float8`` converts (gathered in float8)."""
    return max((sum(m.weight.numel() for n, m in blk.named_modules() if float8_eligible(model, n, m))
                for blk in model_blocks(model)), default=0)


def unit_param_counts(model: nn.Module, shapes: dict[int, tuple[int, ...]] | None = None,
                      trainable: bool = False, shard_group: int = 1,
                      gathered: Callable[[nn.Parameter, int], int] | None = None,
                      ) -> tuple[list[int], list[int]]:
    """Elements of each FSDP unit's all-gather (and reduce-scatter) buffer: (every block, the
    model's extra groups (embeddings, head)); either may be empty. ``shapes``: as
    ``adamw_foreach_temporary``'s (a unit's tp shard). ``trainable``: only those with gradients
    (FSDP2 reduce-scatters those). FSDP2 pads each parameter's dim 0 to a multiple of the
    ``shard_group``: a LoRA A of rank 16 at 1,024 ranks takes 64 times its size there (counted
    unpadded, the planner's peak was 17% low for Llama 3.2 1B with LoRA at 1,024 ranks).
    ``gathered(param, elements)``: what a parameter of that many (padded) elements counts as
    (``gathered_elements``)."""
    def padded(shape: tuple[int, ...]) -> int:
        rows = -(-shape[0] // shard_group) * shard_group if shape else 1
        return rows * math.prod(shape[1:])

    def count(params) -> int:
        unique = {id(p): p for p in params}  # a tied weight is one parameter, gathered once
        counted = gathered or (lambda param, elements: elements)
        return sum(counted(p, padded(tuple(shapes[id(p)]) if shapes else tuple(p.shape)))
                   for p in unique.values() if p.requires_grad or not trainable)

    blocks = [count(blk.parameters()) for blk in model_blocks(model)]
    groups = [count(p for m in group for p in m.parameters())
              for group in getattr(model, "extra_shard_groups", list)()]
    return blocks, groups


def check_float8_converts(cfg: Config, model: nn.Module) -> None:
    """strategy.float8 on a model with no linear layer it converts: refused, as the build refuses it."""
    if cfg.strategy.float8 and not float8_block_params(model):
        raise ConfigError(nothing_in_float8(len(model_blocks(model))))


def planned_model(cfg: Config) -> nn.Module:
    """The model the planner counts, on the meta device: with ``finetune=lora`` its adapters on a
    frozen base (the adapters have gradients and Adam state, the base neither)."""
    with torch.device("meta"):
        model = build_model(cfg.model)
        return add_adapters(model, cfg.finetune) if cfg.finetune.method != "none" else model


def check_planned_batch(cfg: Config) -> None:
    if not isinstance(cfg.trainer.micro_batch_size, int):
        raise ConfigError(f"the planner needs a number of sequences: trainer.micro_batch_size="
                          f"{cfg.trainer.micro_batch_size} is chosen only when training starts; set "
                          "trainer.micro_batch_size=N to plan for N")


def estimate(cfg: Config, model: nn.Module, strategy: str, world_size: int, local: int,
             checkpointed: bool | None = None, accelerated: bool | None = True) -> Estimate:
    """Rank 0's memory for ``strategy`` at ``world_size``; ``checkpointed`` overrides the config's
    activation checkpointing (all blocks or none); ``accelerated``: ``mixed_precision=auto`` means
    what it means on an accelerator (bf16-mixed), else on a CPU (fp32); None: on this machine."""
    check_planned_batch(cfg)
    cfg = with_global_batch(cfg, world_size)  # what is held between micro-batches depends on it
    # A shard group size the world does not divide is the row's "not possible", never another group.
    strategy_cfg = replace(cfg.strategy, sharding_strategy=strategy)
    if checkpointed is not None:
        strategy_cfg = replace(strategy_cfg, activation_checkpointing="all" if checkpointed else "none")
    # It plans for accelerators, wherever it runs: mixed_precision=auto means bf16-mixed there.
    plan = resolve_plan(strategy_cfg, world_size, min(local, world_size), accelerated=accelerated)
    # Layouts the build refuses are refused here too (found by review: planned as any other row)
    if cfg.finetune.method == "qlora":  # (float8's refusal is the whole model's: choose_batch and the tables)
        check_quantizable(model, plan.shard_group)
    # Under tensor parallelism FSDP shards each tp shard (2-D/3-D DTensors): rank 0's of both.
    styles = tensor_parallel_styles(model, plan)
    local_shapes = tensor_parallel_shapes(model, plan.tensor_parallel, styles)
    # Gradients and optimizer state: the trainable parameters' only (finetune=lora: the adapters).
    trainable = [local_shapes[id(p)] for p in model.parameters() if p.requires_grad]
    # finetune=qlora: the frozen linears but the head hold NF4 (distributed/qlora.py).
    nf4 = ({id(m.weight) for _, m in quantized_linears(model)} if cfg.finetune.method == "qlora"
           else set())
    frozen = [local_shapes[id(p)] for p in model.parameters() if not p.requires_grad and id(p) not in nf4]
    quantized = [local_shapes[id(p)] for p in model.parameters() if id(p) in nf4]
    # LoRA adapters are stored in fp32 whatever the storage dtype (distributed/parallelize.py).
    trainable_dtype = torch.float32 if cfg.finetune.method != "none" else plan.storage_dtype
    params, grads, optim = sharded_state_bytes(trainable, plan.shard_group, 0, trainable_dtype)
    # A frozen base is stored in the storage dtype, or in finetune.base_dtype=bf16.
    base_dtype = torch.bfloat16 if cfg.finetune.base_dtype == "bf16" else plan.storage_dtype
    params += sharded_state_bytes(frozen, plan.shard_group, 0, base_dtype)[0]
    params += nf4_bytes(sharded_state_bytes(quantized, plan.shard_group, 0, torch.uint8)[0])
    if cfg.trainer.ema_decay:  # the weights' average: fp32, sharded as the parameters (train/ema.py)
        optim += sharded_state_bytes(trainable, plan.shard_group, 0, torch.float32)[0]
    host = 0
    if plan.cpu_offload and (accelerated if accelerated is not None else device_type() != "cpu"):
        # FSDP2's CPUOffloadPolicy keeps the sharded parameters, their gradients and AdamW's state in
        # host memory (copied to the device for each gather, back after each reduce-scatter): the
        # device holds the gathered units, the collective buffers and the step's tensors only. On a
        # CPU the device is the host: they stay in its peak.
        host, params, grads, optim = params + grads + optim, 0, 0, 0
    compute, reduce = plan.param_dtype.itemsize, plan.reduce_dtype.itemsize

    def gathered_elements(param: nn.Parameter, elements: int) -> int:
        """A parameter's elements in its unit's all-gather, in compute-dtype elements: QLoRA's NF4
        weights are gathered as NF4 (torchao's fsdp_pre_all_gather hands FSDP2 the 4-bit values
        and their scales), counted in the compute dtype the planner was 2x high under SHARD_GRAD_OP
        and NO_SHARD (found by review)."""
        return -(-nf4_bytes(elements) // compute) if id(param) in nf4 else elements

    total_params = sum(gathered_elements(p, math.prod(local_shapes[id(p)]))
                       for p in {id(p): p for p in model.parameters()}.values())
    accumulation = 0
    accumulating = cfg.trainer.grad_accum_steps > 1
    if plan.grad_accumulation == "unsharded" and accumulating and (plan.shard_group > 1 or host):
        # Between micro-batches every rank holds each trainable parameter's full gradient, kept in
        # the reduce dtype, besides the sharded one; with CPU offload on the device too, whatever the
        # shard group (found by review: a single GPU's offloaded run planned without them, 0.39x
        # plan --simulate's peak, and micro_batch_size=auto chose a batch that could not fit).
        accumulation = sum(math.prod(s) for s in trainable) * plan.reduce_dtype.itemsize
    elif host and accumulating and plan.size("dp_replicate") > 1:
        # A hybrid layout's reduce-scatter output is summed on the device until the last micro-batch's
        # all-reduce across replicas (FSDP2's partial reduce output; traced from torch's source),
        # before it is copied to the host.
        accumulation = sharded_state_bytes(trainable, plan.shard_group, 0, plan.reduce_dtype)[0]

    checkpoint_all = plan.activation_checkpointing != "none"
    blocks = model_blocks(model)
    act = activation_model(cfg, model.dims, cfg.trainer.micro_batch_size, plan.param_dtype, plan,
                           last_projection_adapted(blocks[0]) if blocks else None, logits_path(model))
    if cfg.model.name == "hf" and blocks:
        # A Hugging Face family's blocks keep what its code keeps: measured, not the Llama formula.
        kept = kept_by_block(cfg.model, cfg.trainer.seq_len, plan.param_dtype, cfg.data.document_mask)
        if kept is not None and plan.tensor_parallel > 1 and plan_splits_blocks(model, styles):
            whole = activation_model(cfg, model.dims, cfg.trainer.micro_batch_size, plan.param_dtype,
                                     without_tensor_parallel(plan))
            kept = [split_block_bytes(bytes_kept, whole.block, act.block, cfg.trainer.micro_batch_size)
                    for bytes_kept in kept]
        if kept is not None:
            act = with_blocks_measured(act, kept, cfg.trainer.micro_batch_size, plan)
    if cfg.finetune.method != "none" and cfg.finetune.dropout > 0 and blocks:
        # PEFT's LoRA dropout keeps its output (lora_A's input, a copy of the layer's input each) and
        # its mask for every adapted linear, in every block not checkpointed (found by review: the
        # activations 2.5x low at dropout 0.1 without checkpointing, and an auto micro-batch that
        # would not fit). The mask in the compute dtype, as torch's dropout keeps it outside CUDA's
        # fused kernel and plan --simulate measures it (CUDA's is one byte: the safe side).
        dropped = (cfg.trainer.micro_batch_size * cfg.trainer.seq_len * 2 * plan.param_dtype.itemsize
                   * max(sum(a.in_features for a in adapter_a_matrices(block)) for block in blocks))
        # A checkpointed block's backward recomputes them: about half are held at its peak, as the
        # adapted linears' backward frees them in turn (plan --simulate: 0.54 of them for Llama 1B)
        act = replace(act, block=act.block + dropped // 2,
                      saved_blocks=[saved if plan.checkpointed(i) else saved + dropped
                                    for i, saved in enumerate(act.saved_blocks)])
    # A mixture of experts' stacked expert weights get their whole gradient in one block's backward,
    # all experts at once, in the compute dtype, held until the block's reduce-scatter (found by
    # review: counted as two dense FFN weights, the peak 0.89-0.91x plan --simulate's for a Qwen3-MoE
    # 30B-A3B at 64-128 ranks)
    expert_grads = max((sum(math.prod(local_shapes[id(param)]) for param, _ in routed_expert_weights(block)
                            if param.requires_grad) for block in blocks), default=0)
    if expert_grads:
        act = replace(act, block_backward=act.block_backward + expert_grads * plan.param_dtype.itemsize)
    blocks, groups = unit_param_counts(model, local_shapes, shard_group=plan.shard_group,
                                       gathered=gathered_elements)
    layers = len(blocks)
    saved = act.saved_blocks if layers else []
    # Without blocks or groups the root is the one unit.
    block_units = max(blocks, default=total_params)
    head_unit = groups[-1] if groups else total_params
    # Reduce-scatter inputs: the gradients of a unit's trainable parameters (all, but with LoRA).
    trainable_blocks, trainable_groups = unit_param_counts(model, local_shapes, trainable=True,
                                                           shard_group=plan.shard_group)
    total_trainable = sum(math.prod(s) for s in trainable)
    block_reduced = max(trainable_blocks, default=total_trainable)
    head_reduced = trainable_groups[-1] if trainable_groups else total_trainable
    # strategy.float8: a block's converted linears are gathered in float8, one byte a parameter,
    # where they are sharded (a linear's cast of its weight is freed when its matmul has run).
    float8_saved = float8_block_params(model) * (compute - 1) if plan.gathers_float8 else 0
    # The reduce-scatter input held in a late block's backward: the previous block's, and with the
    # chunked loss in the last block's the head unit's (its whole gradient in the reduce dtype;
    # plan --simulate: 1.96 GiB for Llama-3 8B, more than a block's 0.81).
    # With tied embeddings the head unit also holds the input embeddings, whose backward comes last:
    # the chunked loss's head gradient is then held through the whole backward and reduced with the
    # embeddings' at its end, the unit gathered again for that (plan --simulate, Llama-3 8B tied at 8
    # ranks: peaks 5-12% high and activations 16% low before, within 3% since).
    head_reduced_last = act.chunked_loss and groups and head_reduced > 0 and any(
        isinstance(m, nn.Embedding) for m in model.extra_shard_groups()[-1])
    held_head_grad = act.head_weight_grad if head_reduced_last else 0
    in_flight = max(head_reduced if act.chunked_loss and not head_reduced_last else 0, block_reduced) * reduce
    # strategy.embedding_lookup=exchange: an embedding alone in its unit is never gathered.
    exchanged = sum(p.numel() for group in (model.extra_shard_groups() if exchanges_rows(plan) else [])
                    if exchangeable(model, group) for p in group[0].parameters())
    if plan.reshard_after_forward is False:
        # Every unit stays gathered from its forward until its backward, and is resharded after it:
        # in the last block's backward all but the head unit; in the first block's, the embeddings,
        # the block and its reduce-scatter input.
        gathered_start = (total_params - exchanged) * compute - layers * float8_saved
        gathered_block = gathered_start - head_unit * compute + in_flight
        gathered_end = ((groups[0] if groups and not exchanged else 0) * compute + block_units * compute
                        + block_reduced * reduce - float8_saved)
    else:
        # The head unit, and the last block under full resharding, are not resharded after forward
        # (parallelize); in a block's backward, the block, the prefetched next one and the block's
        # reduce-scatter input.
        last_block = block_units if plan.reshard_after_forward is True and blocks else 0
        gathered_start = (head_unit + last_block) * compute - (float8_saved if last_block else 0)
        gathered_block = block_units * 2 * compute + in_flight - 2 * float8_saved
        gathered_end = block_units * 2 * compute + block_reduced * reduce - 2 * float8_saved
    # An int reshard_after_forward k: each unit but the head keeps 1/k of its parameters from its
    # forward until its backward (resharded to groups of k ranks, not the whole shard group). Made in
    # forward, FSDP2's memory tracker counts them with the activations, and so does this column.
    # Counted as true, the peak was 19-26% low (plan --simulate: Llama 3.2 1B at 8 ranks, k=2; Llama-3
    # 8B at 64 ranks, k=8).
    k = plan.reshard_after_forward if plan.reshard_after_forward not in (True, False) else 0
    kept = (total_params - head_unit - exchanged) * compute // k if k else 0
    kept_block = block_units * compute // k if k else 0
    kept_embeddings = (groups[0] if groups and not exchanged else 0) * compute // k if k else 0
    # Sharded gradients of previous micro-batches; under unsharded accumulation none exist before the
    # last micro-batch's reduce-scatters, which free the full gradients unit by unit: those are held
    # through backward, the sharded ones from its end (both counted at once, the peak was 20% high).
    earlier = grads if accumulating and not accumulation else 0
    during_backward = earlier + accumulation
    first_block = act.block + act.recompute_extra + act.block_backward + act.document_mask
    # Phases as (gradients held, activations and backward temporaries, gathered, optimizer temporaries).
    phases = {
        "backward start": (during_backward, sum(saved) + act.head_saved + act.head_backward
                           + act.document_mask + kept, gathered_start, 0),
        # The head unit's gradients are reduced: the loss's tensors are gone, the buffers are not.
        # Its reduce-scatter input is made before any block's backward has begun, and FSDP2's
        # memory tracker counts it with the step's temporaries: so does this column (with the
        # built-in Llama's lean blocks under full checkpointing, this is the activation peak).
        "head reduced": (during_backward, sum(saved) + act.document_mask + head_reduced * reduce + kept,
                         gathered_start + head_unit * compute, 0),
        # The model's last block: every earlier block's saved tensors are still held.
        "block backward": (during_backward, sum(saved[:-1]) + first_block + held_head_grad + kept
                           - kept_block, gathered_block, 0),
        "backward end": (grads, first_block + held_head_grad + kept_embeddings, gathered_end, 0),
        # Fused AdamW updates each tensor in place: no group-sized temporary. Nor with CPU offload
        # (host tensors).
        "optimizer step": (grads, 0, 0, 0 if plan.cpu_offload or cfg.trainer.optimizer_kernel != "foreach"
                           else adamw_foreach_temporary(model, plan.shard_group, plan.storage_dtype,
                                                             local_shapes)),
    }
    if head_reduced_last:
        # After the embeddings' backward: the tied unit gathered again, its gradient (the head's
        # part still held) reduced in the reduce dtype, the first block's reduce-scatter in flight.
        del phases["head reduced"]
        phases["embeddings reduced"] = (grads, held_head_grad, head_unit * compute + head_reduced * reduce
                                        + block_reduced * reduce, 0)
    if plan.tensor_parallel > 1 and groups:
        # The vocabulary-split embedding's gradient: DTensor computes it whole ([vocab, dim], from
        # the gathered incoming gradient) and then keeps this rank's rows, beside the embedding unit
        # and the last reduce-scatter.
        dims = model.dims
        tokens = cfg.trainer.micro_batch_size * cfg.trainer.seq_len
        phases["embedding backward"] = (grads, tokens * compute * dims.dim,
                                        (groups[0] + dims.vocab_size * dims.dim) * compute
                                        + block_units * reduce, 0)
    name, phase = max(phases.items(), key=lambda kv: sum(kv[1]))
    peak = params + optim + sum(phase)
    gathered = phase[2]
    activations = max(phase[1] for phase in phases.values())
    return Estimate(plan.strategy, world_size, plan.mesh_shape, checkpoint_all, params, grads, optim,
                    accumulation, activations, gathered, peak, name, host)


@dataclass
class BatchChoice:
    """What ``trainer.micro_batch_size=auto`` chose, and the planner's figures behind it."""

    micro_batch_size: int
    grad_accum_steps: int
    activation_checkpointing: str
    estimate: Estimate  # the planner's figures for the choice
    budget: int  # bytes the planner's peak had to stay within: limit less margin less held
    limit: int  # trainer.memory_limit_gib, or the device's memory
    held: int  # what the process held when it chose (CPU: its resident set)
    rejected: list[tuple[int, str, int]]  # (micro-batch, checkpointing, planned peak) over the budget

    def describe(self, world_size: int, margin: float) -> str:
        """The start-up report's line; ``world_size``: the data-parallel ranks."""
        global_batch = self.micro_batch_size * self.grad_accum_steps * world_size
        why = (f"the planner's peak {human_bytes(self.estimate.peak)} ({self.estimate.peak_phase}) is "
               f"within {human_bytes(self.budget)}: the limit {human_bytes(self.limit)} less "
               f"{margin:.0%} margin less {human_bytes(self.held)} held at start")
        over = ", ".join(f"{micro} with {ac} {human_bytes(peak)}" for micro, ac, peak in self.rejected[-3:])
        return (f"trainer.micro_batch_size=auto: {self.micro_batch_size} per micro-batch x "
                f"{counted(self.grad_accum_steps, 'micro-batch')} x "
                f"{counted(world_size, 'data-parallel rank')} = {global_batch} sequences, "
                f"activation_checkpointing={self.activation_checkpointing}; {why}"
                + (f"; over it: {over}" if over else ""))


class NothingFits(ConfigError):
    """No micro-batch fits under any activation checkpointing; ``smallest_peak``: the planner's
    peak for one sequence with every block recomputed."""

    def __init__(self, message: str, smallest_peak: int):
        super().__init__(message)
        self.smallest_peak = smallest_peak


def choose_batch(cfg: Config, model: nn.Module, world_size: int, local: int, limit: int, held: int,
                 accelerated: bool | None) -> BatchChoice:
    """``trainer.micro_batch_size=auto``: the cheapest activation checkpointing, from the configured
    mode up (``AC_MODES``' order), under which some micro-batch fits the budget, and the largest
    micro-batch that does under it; every candidate divides the global batch's share of a rank.

    Recomputation costs a fixed share of every step's compute (a third more FLOPs for full
    checkpointing), a smaller micro-batch only per-micro-batch overheads: hence checkpointing is
    the first thing to save, the micro-batch the second. Under tensor parallelism the ranks of a
    ``tp`` group share their micro-batches: a data-parallel rank's share is the global batch over
    ``world_size / tensor_parallel``."""
    t = cfg.trainer
    check_auto_accumulation(t)
    check_float8_converts(cfg, model)
    data_parallel = world_size // cfg.strategy.tensor_parallel
    check_auto_global_batch(t.global_batch_size, data_parallel)
    per_rank = t.global_batch_size // data_parallel
    usable = int(limit * (1 - t.memory_margin))
    budget = usable - held
    if budget <= 0:
        raise ConfigError(
            f"trainer.micro_batch_size=auto: nothing fits: the process already holds {human_bytes(held)} "
            f"at start, which leaves nothing of the limit {human_bytes(limit)} less {t.memory_margin:.0%} "
            f"margin ({human_bytes(usable)}); raise trainer.memory_limit_gib or lower trainer.memory_margin")
    sizes = [n for n in range(per_rank, 0, -1) if per_rank % n == 0]
    rejected: list[tuple[int, str, int]] = []
    cheapest = AC_MODES.index(checkpointing_mode(cfg.strategy))
    modes = list(AC_MODES[cheapest:])
    clash = next((rank for block in model_blocks(model) if (rank := lora_rank_clash(block)) is not None),
                 None) if "selective" in modes else None
    if clash is not None:
        # The build refuses it (found by review: chosen here, then refused after launch): passed
        # over from none, refused where the config asks for it
        if modes[0] == "selective":
            raise ConfigError(selective_clash_message(clash))
        modes.remove("selective")
    for ac in modes:
        for micro in sizes:
            trainer = replace(t, micro_batch_size=micro, grad_accum_steps=per_rank // micro)
            trial = replace(cfg, trainer=trainer, strategy=replace(cfg.strategy, activation_checkpointing=ac))
            planned = estimate(trial, model, cfg.strategy.sharding_strategy, world_size, local,
                               accelerated=accelerated)
            if planned.peak <= budget:
                return BatchChoice(micro, per_rank // micro, ac, planned, budget, limit, held, rejected)
            rejected.append((micro, ac, planned.peak))
    raise NothingFits(
        f"trainer.micro_batch_size=auto: nothing fits: one sequence with activation_checkpointing=all "
        f"needs {human_bytes(rejected[-1][2])} by the planner, over {human_bytes(budget)} (the limit "
        f"{human_bytes(limit)} less {t.memory_margin:.0%} margin less {human_bytes(held)} held); raise "
        "trainer.memory_limit_gib, shard over more ranks or shorten trainer.seq_len", rejected[-1][2])


def strategies_at(world: int) -> list[str]:
    """The strategies the plan tables list at ``world`` ranks: the hybrid ones from two ranks on
    (where their shard groups do not divide the world, the row says so)."""
    return [s for s in STRATEGIES if world >= 2 or not s.startswith("HYBRID")]


def run_shape(cfg: Config, local: int) -> str:
    """The plan tables' header: precision, float8, processes per node, tensor parallelism."""
    precision = resolve_precision(cfg.strategy.mixed_precision, accelerated=True)
    if cfg.strategy.mixed_precision.lower() == "auto":  # planned for GPUs, whatever this machine is
        precision += " (mixed_precision=auto on GPUs; on CPUs it trains in fp32)"
    return (f"precision {precision}"
            + ("; float8 linears, gathered in float8 where a shard group has more than one rank"
               if cfg.strategy.float8 else "")
            + f"; {local} process{'es' if local > 1 else ''} per node"
            + (f"; tensor parallel {cfg.strategy.tensor_parallel} (sequence parallel "
               f"{'on' if cfg.strategy.sequence_parallel else 'off'}), FSDP over the other ranks"
               if cfg.strategy.tensor_parallel > 1 else ""))


def auto_batch_table(cfg: Config, world_sizes: list[int], device_memory: int | None, local: int) -> str:
    """``shardtrain plan`` with ``trainer.micro_batch_size=auto``: what a run would choose for each
    world size and strategy against ``trainer.memory_limit_gib`` where set (the run's limit then,
    whatever the device has), else ``device_memory``, as the trainer chooses it at start-up on an
    accelerator that holds nothing yet."""
    limit = int(cfg.trainer.memory_limit_gib * 2**30) or device_memory
    if not limit:
        raise ConfigError("shardtrain plan with trainer.micro_batch_size=auto needs the memory it plans "
                          "against: add --device-memory 80GB (or set trainer.memory_limit_gib)")
    t = cfg.trainer
    if int(limit * (1 - t.memory_margin)) < 1:
        given = "trainer.memory_limit_gib" if t.memory_limit_gib else "--device-memory"
        raise ConfigError(f"{given} of {human_bytes(limit)} less {t.memory_margin:.0%} margin leaves nothing "
                          "to plan in; give the device's memory, e.g. --device-memory 80GB")
    check_auto_accumulation(t)
    model = planned_model(cfg)
    check_float8_converts(cfg, model)
    tp = cfg.strategy.tensor_parallel
    lines = [f"trainer.micro_batch_size=auto: global batch {t.global_batch_size} sequences of {t.seq_len} "
             f"tokens, against {human_bytes(limit)} a process"
             + (" (trainer.memory_limit_gib: the run's limit)" if t.memory_limit_gib and device_memory
                else "")
             + f" less {t.memory_margin:.0%} margin "
             f"(nothing held before the model is built); {run_shape(cfg, local)}",
             "ranks x strategy: micro-batch x accumulation, activation checkpointing, planned peak GiB"]
    for world in world_sizes:
        for strategy in strategies_at(world):
            if world % tp:
                lines.append(f"  {world:>4} x {strategy:<19} not possible: tensor-parallel groups of {tp} "
                             f"need a multiple of {tp} ranks")
                continue
            data_parallel = world // tp
            if t.global_batch_size % data_parallel:
                lines.append(f"  {world:>4} x {strategy:<19} not possible: {t.global_batch_size} sequences "
                             f"do not divide over {data_parallel} data-parallel ranks")
                continue
            trial = replace(cfg, strategy=replace(cfg.strategy, sharding_strategy=strategy))
            try:
                choice = choose_batch(trial, model, world, local, limit, held=0, accelerated=True)
            except NothingFits as exc:
                lines.append(f"  {world:>4} x {strategy:<19} nothing fits (one sequence, every block "
                             f"recomputed: {exc.smallest_peak / 2**30:.2f})")
                continue
            except (ConfigError, ValueError) as exc:  # a layout this world size cannot take
                lines.append(f"  {world:>4} x {strategy:<19} not possible: {exc}")
                continue
            lines.append(f"  {world:>4} x {strategy:<19} {choice.micro_batch_size:>3} x "
                         f"{choice.grad_accum_steps:<4} {choice.activation_checkpointing:<10} "
                         f"{choice.estimate.peak / 2**30:8.2f}")
    if (refusal := unmeasured_refusal(cfg.model)) is not None:
        # train refuses it: a table of choices no run makes (found by review)
        raise ConfigError(refusal)
    return "\n".join(lines)


def plan_table(cfg: Config, world_sizes: list[int], device_memory: int | None, local: int) -> str:
    if cfg.trainer.micro_batch_size == "auto":
        return auto_batch_table(cfg, world_sizes, device_memory, local)
    check_planned_batch(cfg)
    model = planned_model(cfg)
    check_float8_converts(cfg, model)  # once for the table, not as every row's refusal
    n = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapters = (f" ({trained / 1e6:.2f}M trainable: finetune={cfg.finetune.method} adapters, the base "
                "frozen without gradients or optimizer state)" if trained < n else "")
    offload = ("; strategy.cpu_offload: parameters, gradients and optimizer state in host memory (host GiB "
               "a rank at the end of each row), not the device's" if cfg.strategy.cpu_offload else "")
    lines = [f"model: {n / 1e6:.1f}M parameters{adapters}; micro-batch {cfg.trainer.micro_batch_size} x "
             f"{cfg.trainer.seq_len} tokens; {run_shape(cfg, local)}{offload}",
             "per-rank GiB (rank 0, the largest shard): params | grads | optimizer | activation peak "
             "(no AC / AC) | peak (no AC / AC)" + (" | fits" if device_memory else "")]
    gib = 2**30
    for world in world_sizes:
        for strategy in strategies_at(world):
            try:
                plain, checkpointed = (estimate(cfg, model, strategy, world, local, checkpointed=ac)
                                       for ac in (False, True))
            except (ConfigError, ValueError) as exc:  # a layout this world size cannot take (a bug raises)
                lines.append(f"  {world:>4} x {strategy:<19} not possible: {exc}")
                continue
            fit = ""
            if device_memory:
                ok, ok_ac = plain.peak <= device_memory, checkpointed.peak <= device_memory
                fit = " | " + ("yes" if ok else "with AC" if ok_ac else "no")
            g = [x / gib for x in (plain.params, plain.grads + plain.accumulation, plain.optimizer,
                                    plain.activations, checkpointed.activations, plain.peak,
                                    checkpointed.peak)]
            host = f" | host {plain.host / gib:.2f}" if cfg.strategy.cpu_offload else ""
            lines.append(f"  {world:>4} x {strategy:<19} {g[0]:8.2f} {g[1]:8.2f} {g[2]:9.2f}   "
                         f"{g[3]:7.2f} / {g[4]:<7.2f}   {g[5]:8.2f} / {g[6]:<8.2f}{fit}{host}")
    return "\n".join(lines)
