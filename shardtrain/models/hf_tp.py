"""Hugging Face models' tensor-parallel plans, read from transformers and applied with torch's
``torch.distributed.tensor.parallel`` styles by shardtrain (transformers' own ``from_pretrained(
tp_plan=...)`` machinery loads and shards the weights itself, which FSDP2 and our checkpoints must do).

Where the plan comes from: the causal-LM class's ``_tp_plan`` (its output head) and the config's
``base_model_tp_plan`` under the base model's prefix, as transformers composes them; e.g. Llama:
``model.layers.*.self_attn.{q,k,v}_proj: colwise``, ``o_proj: rowwise``, ``mlp.{gate,up}_proj:
colwise``, ``down_proj: rowwise``, ``lm_head: colwise_gather_output``. A family whose config declares
none (GPT-2, OPT, Falcon...) is refused.

What each of transformers' style names becomes (``stream``: the residual stream's layout between
blocks, ``Shard(1)`` along the sequence with sequence parallelism, else ``Replicate()``):

- ``colwise``: ``ColwiseParallel()``: output features split, local output. The attention's
  projections then hold ``heads / tp`` whole heads; transformers' attention views them with ``-1``
  heads (``hidden_shape = (*input_shape, -1, head_dim)``), so it computes on its local heads.
- ``rowwise``: ``RowwiseParallel(output_layouts=stream)``: input features split, the partial sums
  all-reduced (or reduce-scattered along the sequence).
- ``colwise_rep`` / ``colwise_gather_output`` elsewhere than the head: ``ColwiseParallel`` with a
  replicated (gathered) output; ``rowwise_rep`` / ``rowwise_split_input``: ``RowwiseParallel`` that
  splits a replicated input itself.
- ``embedding_rowwise`` / ``embedding_colwise``: the embedding split along the vocabulary
  (``RowwiseParallel``) or the hidden size (``ColwiseParallel``), output ``stream``. The input
  embeddings are split along the vocabulary when the plan does not name them, as transformers does.
- ``sequence_parallel``: ``SequenceParallel()`` (only with sequence parallelism).
- the output head, whatever its style (transformers gathers the logits, ``colwise_gather_output``):
  ``ColwiseParallel`` with logits left split along the vocabulary as a DTensor, and the loss taken on
  them with ``loss_parallel``, as for the built-in Llama: a gather would put the whole
  ``[tokens, vocab]`` logits (and their gradient) on every rank of the group.
- anything else (fused ``packed_*`` projections, ``replicated_with_grad_allreduce`` norms as Qwen3's,
  experts, ``local_params``...): refused, naming the entry; a task may apply its own plan instead.

Tied input and output embeddings (Qwen2's small models) are both split along the vocabulary
(``Shard(0)`` of a ``[vocab, hidden]`` weight) and share the one split weight again afterwards.

Sequence parallelism needs the Llama block layout (``input_layernorm``, ``self_attn``,
``post_attention_layernorm``, ``mlp`` and a final ``norm``: Llama, Mistral, Qwen2 and their kin):
the norms become ``SequenceParallel``, ``self_attn`` and ``mlp`` gather their input along the
sequence (``PrepareModuleInput``), the residual stream between them is a ``Shard(1)`` DTensor, so
that transformers' own code around the blocks (positions, masks, RoPE) sees whole-sequence shapes.
"""

from __future__ import annotations

import re
from pathlib import Path

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from transformers import PretrainedConfig, PreTrainedModel

from shardtrain.errors import ConfigError
from shardtrain.models.dims import Dims, even_tensor_parallel_degrees
from shardtrain.models.hf_directory import CONFIG_FILE

# transformers' style names (transformers.distributed.tensor_parallel) with a translation here.
TRANSLATED_STYLES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep",
                     "rowwise_split_input", "embedding_rowwise", "embedding_colwise", "sequence_parallel")
# The Llama block layout sequence parallelism is written for.
SEQUENCE_PARALLEL_BLOCK = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
FINAL_NORM = "norm"


def base_model_of(model: nn.Module) -> nn.Module:
    """The base model inside a transformers causal LM (``model`` itself where it has none): the
    child that holds it, as transformers composes the plans. Not ``base_model`` alone, which follows
    ``base_model_prefix``: Llama 4's causal LM gives it as "language_model" while its base model is
    ``model``, so that ``base_model`` is the causal LM itself (found by review: its plan was named
    under a module that does not exist, and its logits were taken for transformed). Cheap: the
    chunked loss asks at every forward."""
    base = getattr(model, "base_model", model)
    if base is not model:
        return base
    return next((child for child in model.children() if isinstance(child, PreTrainedModel)), model)


def base_model_name(model: nn.Module) -> str:
    """The name of ``base_model_of`` inside ``model`` ("": ``model`` itself)."""
    base = base_model_of(model)
    return "" if base is model else module_name(model, base)


def declared_plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan a transformers causal LM declares, as module-name patterns (``*``:
    a layer number) relative to ``model``: its class's ``_tp_plan`` and its config's
    ``base_model_tp_plan`` under the base model's name."""
    plan = dict(getattr(type(model), "_tp_plan", None) or {})
    base = getattr(model.config, "base_model_tp_plan", None) or {}
    prefix = base_model_name(model)
    plan.update({f"{prefix}.{key}" if prefix else key: style for key, style in base.items()})
    return plan


def pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def config_file(config: PretrainedConfig) -> str:
    path = getattr(config, "_name_or_path", "") or ""
    return str(Path(path) / CONFIG_FILE) if path else f"its {CONFIG_FILE}"


def check_split_sizes(config: PretrainedConfig, tp: int) -> None:
    """Heads, key/value heads, the feed-forward width and the vocabulary divisible by ``tp``."""
    dims = Dims.of_hf(config)
    sizes = (("num_attention_heads", dims.n_heads, "query heads"),
             ("num_key_value_heads", dims.n_kv_heads, "key/value heads"),
             ("intermediate_size", dims.ffn_hidden_dim, "the feed-forward width"),
             ("vocab_size", dims.vocab_size, "the vocabulary"))
    for key, size, what in sizes:
        if size % tp:
            degrees = ", ".join(map(str, even_tensor_parallel_degrees([s for _, s, _ in sizes], tp)))
            # GPT-2's 50,257 or a 32,001-token vocabulary divides by no degree: padding is the fix.
            fix = (f"; or pad the embeddings to a multiple of {tp} (model.resize_token_embeddings("
                   f"len(tokenizer), pad_to_multiple_of={tp}), then save_pretrained)"
                   if key == "vocab_size" else "")
            raise ConfigError(f"strategy.tensor_parallel={tp} must divide {what} ({key}={size} in "
                              f"{config_file(config)}); this model splits evenly at "
                              f"strategy.tensor_parallel={degrees}{fix}")


def check_declared_plan(model: nn.Module, blocks: tuple[type, ...], tp: int,
                            sequence_parallel: bool) -> None:
    """Everything that keeps the declared plan from applying to ``model`` (a transformers causal
    LM with decoder-layer classes ``blocks``), one line: raised before any weight is split."""
    config = model.config
    family = config.model_type
    plan = declared_plan(model)
    fix = ("set strategy.tensor_parallel=1, or give the task a parallelize_tensors(model, tp_mesh, "
           "sequence_parallel) method with your own plan (docs/parallelism.md)")
    if not (getattr(config, "base_model_tp_plan", None) or {}):
        raise ConfigError(f"a Hugging Face {family} model declares no tensor-parallel plan "
                          f"(base_model_tp_plan in its transformers config); {fix}")
    for key, style in plan.items():
        if style not in TRANSLATED_STYLES:
            raise ConfigError(f"the {family} plan's {key}: {style!r} (transformers' style) has no "
                              f"translation onto torch's tensor-parallel styles here; {fix}")
    head = module_name(model, model.get_output_embeddings())
    if not any(pattern(key).fullmatch(head) for key in plan):
        raise ConfigError(f"the {family} plan does not split its output head {head}; {fix}")
    embeddings = module_name(model, model.get_input_embeddings())
    style = next((s for key, s in plan.items() if pattern(key).fullmatch(embeddings)), "embedding_rowwise")
    if model.get_input_embeddings().weight is model.get_output_embeddings().weight and \
            style != "embedding_rowwise":
        raise ConfigError(f"tied input and output embeddings need the embedding split along the "
                          f"vocabulary as the head is, the {family} plan says {embeddings}: {style!r}; "
                          "untie them (tie_word_embeddings=false) or set strategy.tensor_parallel=1")
    check_split_sizes(config, tp)
    check_fused_groups(model, family, tp)
    check_whole_parameters_beside_split_ones(model, plan, family, fix)
    # GPT-J and CodeGen name theirs attn_pdrop (found by review: let through)
    for key in ("attention_dropout", "attn_pdrop"):
        if (getattr(config, key, 0.0) or 0.0) > 0:
            # The ranks of a group share one random stream (their replicated regions must draw alike):
            # head h and head h + heads/tp would get one mask, where one process draws two (a review).
            raise ConfigError(f"{key}={getattr(config, key):g} ({config_file(config)}) under "
                              f"strategy.tensor_parallel={tp} would draw the same mask for the heads of "
                              f"every rank of a group; set {key} to 0 in config.json, or "
                              "strategy.tensor_parallel=1")
    if sequence_parallel:
        found = [m for m in model.modules() if isinstance(m, blocks)]
        layout = [name for name, child in found[0].named_children()] if found else []
        norm = getattr(base_model_of(model), FINAL_NORM, None)
        if not found or not set(SEQUENCE_PARALLEL_BLOCK) <= set(layout) or norm is None or any(
                any(True for _ in child.parameters())
                for block in found for name, child in block.named_children()
                if name not in SEQUENCE_PARALLEL_BLOCK):
            raise ConfigError(f"strategy.sequence_parallel=true needs Llama's block layout ("
                              f"{', '.join(SEQUENCE_PARALLEL_BLOCK)}; a final {FINAL_NORM}), a {family} "
                              f"block has {', '.join(layout) or 'none'}; "
                              "set strategy.sequence_parallel=false")
        # Only a row-wise split turns the attention's and the MLP's outputs back into the
        # sequence-split stream: a plan that splits the embedding alone (gpt_oss, diffllama) failed
        # in the first forward, adding a plain tensor to a DTensor (found by review)
        block = module_name(model, found[0])
        rowwise = [name for name, _ in model.named_modules() for key, style in plan.items()
                   if style.startswith("rowwise") and pattern(key).fullmatch(name)]
        whole = [part for part in ("self_attn", "mlp") if not any(
            name.startswith(f"{block}.{part}.") for name in rowwise)]
        if whole:
            raise ConfigError(f"strategy.sequence_parallel=true needs the {family} plan to split the output "
                              f"projection of each block's {' and '.join(whole)} row-wise; it does not "
                              f"({config_file(config)}'s base_model_tp_plan); set "
                              "strategy.sequence_parallel=false")


def check_fused_groups(model: nn.Module, family: str, tp: int) -> None:
    """A fused query/key/value projection laid out in ``mp_num`` groups (CodeGen's: query, value and
    key of a quarter of the heads each, from the 4-way model parallelism it was trained with) splits
    column-wise into whole groups only where ``tp`` divides their number; otherwise the first forward
    failed reshaping a rank's part of a group (found by review)."""
    groups = {m.mp_num for m in model.modules() if isinstance(getattr(m, "mp_num", None), int)}
    for count in sorted(groups):
        if count % tp:
            fits = ", ".join(str(d) for d in range(2, count + 1) if count % d == 0)
            raise ConfigError(f"the {family} attention's fused query/key/value projection is laid out in "
                              f"{count} groups (mp_num), which strategy.tensor_parallel={tp} would split "
                              f"inside; use strategy.tensor_parallel={fits} (or 1)")


def check_whole_parameters_beside_split_ones(model: nn.Module, plan: dict[str, str], family: str,
                                             fix: str) -> None:
    """No parameter the plan leaves whole inside a module whose projections it splits column-wise
    (an attention's heads): such a weight (Phi's q/k layer norms, Cohere's per-head q/k norms) works
    on its rank's heads alone, so its gradient would be theirs alone, never summed over the
    tensor-parallel group, and its copies would drift apart (found by a review: Phi with
    qk_layernorm trained that way without a word; Cohere's failed in the first forward)."""
    patterns = [(pattern(key), style) for key, style in plan.items()]
    styled = {name: style for name, _ in model.named_modules()
              for key, style in patterns if key.fullmatch(name)}
    parents = {name.rpartition(".")[0] for name, style in styled.items() if style == "colwise"}
    for parent in sorted(parents):
        for name, _ in model.get_submodule(parent).named_parameters():
            owner = f"{parent}.{name.rpartition('.')[0]}".rstrip(".")
            if owner not in styled:
                raise ConfigError(f"the {family} plan splits {parent}'s heads over tensor_parallel but "
                                  f"leaves {parent}.{name} whole: it would see its rank's heads alone and "
                                  f"its gradient would never be summed over the group; {fix}")


def translate(style: str, stream: Replicate | Shard, local: bool) -> ParallelStyle:
    """torch's style for a module of transformers' ``style`` (not the output head)."""
    if style == "colwise":
        return ColwiseParallel()
    if style in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel(output_layouts=stream, use_local_output=local)
    if style in ("rowwise_rep", "rowwise_split_input"):
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=stream, use_local_output=local)
    if style == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=stream, use_local_output=local)
    if style == "embedding_colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=stream, use_local_output=local)
    if style == "sequence_parallel":
        return SequenceParallel()
    raise ConfigError(f"transformers' tensor-parallel style {style!r} has no translation here")


def hf_tensor_parallel_styles(model: nn.Module, blocks: tuple[type, ...], tp: int,
                              sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The translated plan for a transformers causal LM with decoder-layer classes ``blocks``: torch's
    style for each module it splits, by module name (what ``parallelize_hf`` applies, and what the
    memory planner reads); refused in one line where it cannot apply at ``tp``."""
    check_declared_plan(model, blocks, tp, sequence_parallel)
    stream = Shard(1) if sequence_parallel else Replicate()
    # With sequence parallelism the stream is a DTensor outside the blocks' matmuls (transformers'
    # code around them reads whole-sequence shapes); without, a plain replicated tensor.
    local = not sequence_parallel
    plan = declared_plan(model)
    embeddings = module_name(model, model.get_input_embeddings())
    head = module_name(model, model.get_output_embeddings())
    if not any(pattern(key).fullmatch(embeddings) for key in plan):
        plan = {embeddings: "embedding_rowwise", **plan}
    styles: dict[str, ParallelStyle] = {}
    for name, _ in model.named_modules():
        style = next((s for key, s in plan.items() if pattern(key).fullmatch(name)), None)
        if name == head:
            # Logits split along the vocabulary, for loss_parallel (whatever transformers gathers).
            styles[name] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1),
                                           use_local_output=False)
        elif style is not None and (style != "sequence_parallel" or sequence_parallel):
            styles[name] = translate(style, stream, local)
    if sequence_parallel:
        styles[module_name(model, getattr(base_model_of(model), FINAL_NORM))] = SequenceParallel()
        for name, module in model.named_modules():
            if isinstance(module, blocks):
                styles |= {
                    f"{name}.input_layernorm": SequenceParallel(),
                    f"{name}.post_attention_layernorm": SequenceParallel(),
                    # transformers' decoder layers pass the attention its input by keyword.
                    f"{name}.self_attn": PrepareModuleInput(
                        input_kwarg_layouts={"hidden_states": Shard(1)},
                        desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=True),
                    f"{name}.mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                                      desired_input_layouts=(Replicate(),),
                                                      use_local_output=True),
                }
    return styles


def parallelize_hf(model: nn.Module, blocks: tuple[type, ...], tp_mesh: DeviceMesh,
                   sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Apply the translated plan (``hf_tensor_parallel_styles``) to a transformers causal LM in place
    (before ``fully_shard``); returns what was applied, by module name."""
    styles = hf_tensor_parallel_styles(model, blocks, tp_mesh.size(), sequence_parallel)
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    parallelize_module(model, tp_mesh, styles)
    if tied:
        # Each style distributed its module's weight into a parameter of its own; a vocabulary-split
        # embedding (Shard(0)) and head (Shard(0) of [vocab, hidden]) lie alike: share it again.
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return styles
