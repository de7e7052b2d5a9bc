"""Any local Hugging Face transformers causal LM, speaking the protocol shardtrain asks of a model.

``model.name=hf model.path=DIR`` builds ``AutoModelForCausalLM.from_config(DIR/config.json)`` (on the
meta device when the framework builds it; nothing is downloaded) inside ``HFCausalLM``, which adds what
the framework needs and transformers does not say in one place:
- FSDP units: the classes the model lists in ``_no_split_modules`` (its decoder layers); the input
  embeddings and the final norm + head as their own units, a tied embedding and head in one.
- ``init_parameter``: from scratch (``model.pretrained=false``), what the family's own
  ``_init_weights`` does to each parameter (Gemma's zero-centred norms, GPT-2's scaled projections,
  Mamba's ``A_log`` and ``D``), followed on a stand-in without data (``models/hf_init.py``): drawn
  element by element, so shards initialise independently, but for a few small parameters the family
  computes, which are computed whole; a parameter whose rule cannot be followed is refused.
- ``init_buffers``: non-persistent buffers (RoPE ``inv_freq``, Gemma's ``embed_scale``) are not in
  any weight file and are garbage after meta-device materialisation; a module owning them is built
  again on CPU from the model config and its buffers copied over, or, where it holds parameters, the
  family's ``_init_weights`` sets them with the parameters marked as already initialised.
- a KV cache for generation: transformers' own ``DynamicCache``.
Parameter names are transformers' under the ``hf.`` prefix; ``models/hf_directory.hf_name`` strips it
for export.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PretrainedConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.initialization import guard_torch_init_functions
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from shardtrain.config.schema import ModelConfig
from shardtrain.errors import ModelError, json_object
from shardtrain.models.dims import Dims
from shardtrain.models.experts import inactive_expert_params
from shardtrain.models.hf_directory import CONFIG_FILE, PREFIX, hf_name, model_directory
from shardtrain.models.hf_init import FamilyInitialisation
from shardtrain.models.hf_tp import (
    base_model_name,
    base_model_of,
    check_declared_plan,
    hf_tensor_parallel_styles,
    module_name,
    parallelize_hf,
)


def read_config(cfg: ModelConfig) -> PretrainedConfig:
    """The transformers config of ``model.path``, from the local files only."""
    directory = model_directory(cfg)
    raw = json_object(directory / CONFIG_FILE, ModelError, "write it again with save_pretrained")
    if "auto_map" in raw:
        raise ModelError(f"{directory / CONFIG_FILE} asks for the model's own Python code (auto_map); "
                         "shardtrain builds only model types transformers ships")
    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (ValueError, KeyError) as exc:
        raise ModelError(f"{directory / CONFIG_FILE}: transformers {transformers.__version__} cannot "
                         f"read it ({str(exc).splitlines()[0]})") from exc


# Layer kinds (config ``layer_types`` / ``layers_block_type`` / ``block_types``) that mix tokens only
# through attention, or not at all; any other kind (linear attention, recurrent, convolution, a
# Mamba hybrid) carries state along the sequence, across document boundaries.
ATTENTION_ONLY_KINDS = {"attention", "full_attention", "sliding_attention", "chunked_attention", "mlp", "moe"}
# Encoder families transformers also builds as causal LMs, decoders only with is_decoder: true.
BIDIRECTIONAL_MODEL_TYPES = {"bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "electra", "bert-generation",
                             "roberta-prelayernorm", "camembert", "data2vec-text", "ernie", "xmod",
                             "roformer", "megatron-bert", "rembert", "roc_bert", "big_bird", "qdqbert",
                             "nezha"}
# Model types whose layers carry such state and whose configs name no layer kinds.
SEQUENCE_STATE_MODEL_TYPES = {"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "lfm2", "lfm2_moe"}
# Families whose modeling code builds its causal mask without the restarting position_ids, so
# transformers never sees the packed documents (measured with transformers 5.24: OPT's second
# document 0.17 off in its logits, BioGPT's 2e-2, GPT-OSS's 0.27, Bloom's 0.38, MPT's 2.6, XGLM's
# 0.48; about 30 other families were exact; AfMoE's and GraniteMoeHybrid's code builds it the same
# way). A base model whose forward takes no position_ids at all is refused by its signature.
MASK_WITHOUT_POSITIONS_MODEL_TYPES = {"opt", "biogpt", "gpt_oss", "afmoe", "granitemoehybrid", "bloom", "mpt",
                                      "xglm"}


def attention_spans(config: PretrainedConfig, seq_len: int) -> list[int]:
    """Per decoder layer, the keys a query attends to, for the attention's FLOPs: ``seq_len`` for
    full attention (a Zamba "hybrid" layer's shared attention too), a sliding window or chunk shorter
    than that, 0 for a layer without softmax attention (a hybrid's Mamba, linear-attention or MLP-only
    layers). Found by review: every layer was counted at full attention, a Jamba's MFU some 8% high
    (4 of 32 layers attend) and a sliding window's ignored."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    kinds = next((found for name in ("layer_types", "layers_block_type", "block_types")
                  if isinstance(found := getattr(config, name, None), list) and len(found) == layers), None)
    if kinds is None:
        kinds = ["sliding_attention" if window else "full_attention"] * layers
    limits = {"sliding_attention": window, "chunked_attention": getattr(config, "attention_chunk_size", None)}
    # (Zamba's "hybrid" layers run a shared attention block beside their Mamba: found by the diff review)
    return [seq_len if kind in ("attention", "full_attention", "hybrid")
            else min(limits[kind] or seq_len, seq_len) if kind in limits else 0 for kind in kinds]


def sequence_state_reason(config: PretrainedConfig) -> str | None:
    """Why some layer of the model carries state along the sequence (so that an attention mask does
    not separate packed documents), read from its config; None when none is known to."""
    values = config.to_dict()
    if config.model_type in SEQUENCE_STATE_MODEL_TYPES:
        return f"a {config.model_type} model mixes tokens through recurrent or convolution layers"
    if config.model_type in MASK_WITHOUT_POSITIONS_MODEL_TYPES:
        return (f"a {config.model_type} model builds its causal mask without the documents' positions, "
                "so its attention crosses them")
    ssm_keys = sorted(key for key in values if key.startswith(("mamba_", "ssm_")))
    if ssm_keys:
        return f"its config has state-space (Mamba) layers ({ssm_keys[0]})"
    for field_name in ("layer_types", "layers_block_type", "block_types"):
        kinds = values.get(field_name)
        other = sorted(set(kinds) - ATTENTION_ONLY_KINDS) if isinstance(kinds, list) else []
        if other:
            return f"its {field_name} include {', '.join(map(str, other))}"
    return None


def transforms_head_output(source: str, head_name: str, base_name: str) -> bool:
    """Whether a causal LM's ``forward`` (its source) does anything to the logits but apply the head
    named ``head_name`` to its base model's last hidden state, sliced at most: a scaling of the hidden
    states (MiniCPM3 divides them) or of the logits, on the head's line (HyperCLOVAX) or after it
    (Cohere, Granite), a soft-cap (Gemma 2). Anything not of that one plain shape counts as a transform."""
    # Statements, not the ``logits=logits,`` keyword of the output's constructor.
    logits = [value for value in re.findall(r"^\s*logits\s*=\s*(.+)$", source, flags=re.MULTILINE)
              if not value.rstrip().endswith(",")]
    hidden = [value for value in re.findall(r"^\s*hidden_states\s*=\s*(.+?)\s*$", source, flags=re.MULTILINE)
              if not value.endswith(",")]
    # After the base model's output, only slicing to the positions whose logits are kept.
    slicing = r"slice_logits_to_keep\(hidden_states, \w+\)|hidden_states\[[^\]]*\]"
    # ``.float()`` after the head is what the plain loss does anyway (Blt writes it).
    plain_head = rf"self\.{re.escape(head_name)}\(hidden_states(\[[^\]]*\])?\)(\.float\(\))?\s*(#.*)?"
    return (len(logits) != 1 or re.fullmatch(plain_head, logits[0].strip()) is None
            or hidden[:1] not in (["outputs.last_hidden_state"], ["outputs[0]"])  # (Llama 4's: the same)
            or any(re.fullmatch(slicing, value) is None for value in hidden[1:])
            or re.search(r"\b(logits|hidden_states)\s*([-+*/]|//|\*\*)=|\b(logits|hidden_states)\.\w+_\(",
                         source) is not None
            or f"self.{base_name}(" not in source)


def head_transform_reason(model: nn.Module, source: str | None) -> str | None:
    """Why the logits of this transformers causal LM are not just its output head applied to its base
    model's last hidden state (``transforms_head_output``), read from its ``forward``'s ``source``
    (``forward_source``); None when they are, so a loss may apply the head itself chunk by chunk."""
    if source is None:
        return f"the source of {type(model).__name__}.forward is not readable"
    head = model.get_output_embeddings()
    head_name = next((name for name, module in model.named_children() if module is head), None)
    if head_name is None or transforms_head_output(source, head_name, base_model_name(model)):
        return f"{type(model).__name__}.forward does more to its logits than apply its output head"
    return None


def max_positions(config: PretrainedConfig) -> int | None:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


@dataclass(frozen=True)
class ExpertPart:
    """One expert's stored tensor in a stacked expert parameter: ``name[expert]``'s ``part``-th of
    ``parts`` equal slices along its first dimension (a gate projection before its up projection)."""

    name: str
    expert: int
    part: int
    parts: int


def stacks_experts(converter: WeightConverter) -> bool:
    """Whether a conversion transformers applies while loading is the one shardtrain follows (reads,
    and writes back in export-hf): each expert's stored tensors stacked into one parameter, a gate
    and an up projection concatenated first."""
    steps = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    return steps in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])


class HFCache:
    """transformers' cache behind the interface ``generation.generate`` uses (``pos``); built from
    the model's config, which gives each layer its kind of cache (a hybrid's Mamba layers keep a
    state, not keys and values)."""

    def __init__(self, config: PretrainedConfig) -> None:
        self.config = config
        self.past = DynamicCache(config=config)
        self.pos = 0
        # The tokens cached so far, for a family whose cache goes stale at a position
        # (``regenerates_past_at``): the whole sequence is run again there.
        self.tokens: list[torch.Tensor] = []


def regenerates_past_at(hf: nn.Module) -> int | None:
    """The position past which transformers' generation of this family drops its cache and runs
    the whole sequence again, None for other families: Phi-3's and PhiMoE's long-context RoPE
    switches every position to its long factors once the sequence outgrows
    ``original_max_position_embeddings``, and keys cached under the short ones are stale (generation
    with the cache went another way than without it, and than transformers'). Read from the
    family's own ``prepare_inputs_for_generation``, where transformers does it."""
    limit = getattr(hf.config, "original_max_position_embeddings", None)
    try:
        source = inspect.getsource(type(hf).prepare_inputs_for_generation)
    except (OSError, TypeError):
        return None
    return limit if limit and "original_max_position_embeddings" in source else None


def attention_implementation(config: PretrainedConfig) -> str:
    """torch's fused attention (``sdpa``: no score matrix kept) where the family has it; else the
    family's own ``eager`` attention, which keeps each head's T x T scores (the planner counts
    them): Gemma 2, whose scores are soft-capped."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "eager" if model_class is not None and not model_class._supports_sdpa else "sdpa"


def build_transformers_model(config: PretrainedConfig) -> nn.Module:
    # fp32 master weights whatever the files hold: the sharding plan picks compute dtypes.
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention_implementation(config),
                                            dtype=torch.float32)


def unlike_causal_lm(config: PretrainedConfig, path: str) -> str | None:
    """Why a config transformers builds a causal LM from would not train as one here, None if it
    would: an encoder (BERT, RoBERTa, Electra: ``is_decoder`` false) attends both ways, so each next
    token was predicted seeing it (transformers only logs a warning). Training's refusal: generation
    and the exports read such a model as it is."""
    if getattr(config, "is_decoder", None) is False and config.model_type in BIDIRECTIONAL_MODEL_TYPES:
        return (f"model.path={path!r} is a {config.model_type} encoder (is_decoder: false in "
                f"{CONFIG_FILE}): its attention sees later tokens, so it cannot learn the next one; set "
                f"\"is_decoder\": true in {CONFIG_FILE} to train it as a causal LM")
    return None


# How a MoE causal LM's forward adds its router's load-balancing loss (Mixtral's, and Qwen2/3-MoE's,
# OLMoE's, Jamba's, PhiMoE's, GraniteMoE's, GPT-OSS's... alike): its module's function of the
# routers' logits, the experts and the experts each token goes to.
ROUTER_LOSS_CALL = re.compile(r"\baux_loss\s*=\s*load_balancing_loss_func\(\s*outputs\.router_logits,\s*"
                              r"self\.num_experts,\s*self\.num_experts_per_tok,\s*attention_mask\b")
# ... and how it weighs it: the attribute holding the coefficient (router_aux_loss_coef mostly, from
# the config's key of that name; JetMoe's aux_loss_coef, Dbrx's from ffn_config.moe_loss_weight).
ROUTER_LOSS_WEIGHT = re.compile(r"\bloss\s*\+=\s*self\.(\w+)\s*\*\s*aux_loss\b")


def forward_source(model: nn.Module) -> str | None:
    """The source of ``model``'s ``forward``; None where it cannot be read."""
    try:
        return inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return None


def adds_router_loss(source: str | None) -> bool:
    """Whether a forward (its ``source``) adds an auxiliary router loss of any form (it calls its
    family's ``load_balancing_loss_func`` or adds an ``aux_loss`` to the loss; HY-V3's
    ``aux_loss=None`` is none); True where the source could not be read."""
    return (source is None or "load_balancing_loss_func(" in source
            or ROUTER_LOSS_WEIGHT.search(source) is not None)


def router_loss_of(model: nn.Module, source: str | None) -> tuple[Callable[..., torch.Tensor], float] | None:
    """The load-balancing loss function of ``model``'s family and the coefficient its forward (its
    ``source``) weighs it by, where that forward computes and adds the loss as Mixtral's does
    (``ROUTER_LOSS_CALL``, ``ROUTER_LOSS_WEIGHT``) from attributes it has; None otherwise."""
    if source is None:
        return None
    function = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    has_counts = all(isinstance(getattr(model, name, None), int)
                     for name in ("num_experts", "num_experts_per_tok"))
    weight = ROUTER_LOSS_WEIGHT.search(source)
    coefficient = getattr(model, weight.group(1), None) if weight else None
    if not (ROUTER_LOSS_CALL.search(source) and callable(function) and has_counts
            and isinstance(coefficient, (int, float)) and not isinstance(coefficient, bool)):
        return None
    return function, float(coefficient)


class HFCausalLM(nn.Module):
    # LoRA's adapters go into the transformers model itself (models/lora.py: add_adapters).
    adapter_root = "hf"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.config = read_config(cfg)
        try:
            self.hf = build_transformers_model(self.config)
        except ValueError as exc:
            raise ModelError(f"model.path={cfg.path!r}: transformers cannot build a causal LM from its "
                             f"config ({str(exc).splitlines()[0]})") from exc
        self.max_seq_len = max_positions(self.config)
        self.dims = Dims.of_hf(self.config, self.hf.config._attn_implementation == "eager")
        names = set(getattr(self.hf, "_no_split_modules", None) or ())
        # Not a class holding the input embedding (BERT's, RoBERTa's, Electra's embeddings module
        # is in their _no_split_modules): the embedding goes to a group of its own, with the head
        # where they share the weight (a unit of it spanned two units, and a decoder BERT did not
        # shard at all: found by a trial)
        # (the embedding's ancestors by name: one walk, where asking each module for its
        # descendants walked the model once a module)
        embedding = module_name(self, self.hf.get_input_embeddings())
        holds_embedding = {type(m) for name, m in self.named_modules()
                           if embedding == name or embedding.startswith(f"{name}.") or not name}
        self.block_classes = tuple({type(m) for m in self.modules()
                                    if type(m).__name__ in names and type(m) not in holds_embedding})
        self.tied = self.hf.get_input_embeddings().weight is self.hf.get_output_embeddings().weight
        source = forward_source(self.hf)
        self.head_transform = head_transform_reason(self.hf, source)
        self._family_init: FamilyInitialisation | None = None
        # transformers renamed forward's past_key_values to cache (the old name warns, and goes in
        # 5.40); the name this version's forward takes.
        accepted = inspect.signature(self.hf.forward).parameters
        self.cache_keyword = "cache" if "cache" in accepted else "past_key_values"
        self.regenerate_at = regenerates_past_at(self.hf)
        # A MoE config asking for its router's load-balancing loss (output_router_logits, with a
        # coefficient): the task adds coefficient x that loss to training's cross-entropy.
        moe = hasattr(self.config, "output_router_logits")
        # (a family whose forward adds no such loss, Llama 4's, trains on the cross-entropy in
        # transformers too: nothing asked)
        self.router_loss_asked = moe and bool(self.config.output_router_logits) and adds_router_loss(source)
        found = router_loss_of(self.hf, source) if self.router_loss_asked else None
        self._router_loss = found[0] if found else None
        self.router_loss_coef = found[1] if found else 0.0
        # Only asked for where it is added (generation and evaluation: not computed)
        self._router_logits = {"output_router_logits": False} if moe else {}
        self._head_shares_unit: bool | None = None
        # Stored names differ from module names for some families (GPT-NeoX's files say embed_out,
        # the module lm_head): transformers' own renaming rules, applied as from_pretrained does.
        transforms = get_model_conversion_mapping(self.hf)
        self._renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def forward(self, tokens: torch.Tensor, cache: HFCache | None = None,
                positions: torch.Tensor | None = None, hidden_only: bool = False,
                router_loss: bool = False, token_mask: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits for ``tokens`` (B, T); ``hidden_only``: the base model's last hidden states instead,
        (B, T, dim), for a loss that applies ``output_head()`` itself chunk by chunk (only where
        ``head_transform_reason`` finds nothing else done to the logits). ``router_loss`` (a MoE
        model with ``router_loss_coef``): the output and the routers' load-balancing loss, as the
        model's own forward computes it given an attention mask (unscaled), over the tokens
        ``token_mask`` (B, T) marks, padding left out as transformers leaves it out (None: all)."""
        if (hidden_only or router_loss) and cache is not None:
            raise ModelError("hidden_only= and router_loss= are for training, not with a KV cache")
        if router_loss and self._router_loss is None:
            raise ModelError(self.training_refusal() or "this model has no router load-balancing loss "
                             "(output_router_logits false, or router_aux_loss_coef 0)")
        routers = {"output_router_logits": True} if router_loss else self._router_logits
        if cache is None:
            # With positions (document masking), transformers reads packed sequences from
            # position_ids that restart (given no attention mask and no cache) and builds the
            # model's own mask from them, sliding windows included. The padding a mask would mark
            # comes after every token in its row, which causal attention never reads.
            model = base_model_of(self.hf) if hidden_only else self.hf
            out = model(input_ids=tokens, position_ids=positions, use_cache=False, **routers)
            output = out.last_hidden_state if hidden_only else out.logits
            if not router_loss:
                return output
            return output, self.masked_router_loss(out.router_logits, token_mask)
        if positions is not None:
            raise ModelError("positions= is for training on packed documents, not with a KV cache")
        new = tokens.shape[1]
        if self.regenerate_at is not None and 0 < cache.pos <= self.regenerate_at < cache.pos + new:
            cache.past = DynamicCache(config=cache.config)
            tokens = torch.cat([*cache.tokens, tokens], dim=1)
        out = self.hf(input_ids=tokens, use_cache=True, **{self.cache_keyword: cache.past},
                      **self._router_logits)
        logits = out.logits[:, -new:]
        if self.regenerate_at is not None:
            cache.tokens.append(tokens[:, -new:])
        cache.pos += new
        return logits

    def masked_router_loss(self, router_logits: tuple[torch.Tensor, ...],
                           token_mask: torch.Tensor | None) -> torch.Tensor:
        """The family's load-balancing loss over the tokens ``token_mask`` marks. A micro-batch of
        padding alone (its loss weighed by its 0 targets) counts every row instead of none, which
        would divide by 0: NaN, which a weight of 0 does not cancel."""
        if token_mask is not None:
            token_mask = token_mask | ~token_mask.any()
        return self._router_loss(router_logits, self.hf.num_experts, self.hf.num_experts_per_tok, token_mask)

    def output_head(self) -> nn.Linear | None:
        """The linear map from ``hidden_only`` states to logits; None when the model does more to its
        logits than apply it, or when nothing that runs without it shares its FSDP unit (it would
        never be gathered): a loss must then take the logits from ``forward``."""
        head = self.hf.get_output_embeddings()
        if self.head_transform:
            return None
        if self._head_shares_unit is None:  # found once: the groups walk every module
            self._head_shares_unit = any(len(group) > 1 for group in self.extra_shard_groups()
                                         if any(module is head for module in group))
        return head if self._head_shares_unit else None

    def input_embedding(self) -> nn.Module:
        """The token embedding: its rows are the ids the model can read."""
        return self.hf.get_input_embeddings()

    def parallelize_tensors(self, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        """The tensor-parallel plan transformers declares for this model, translated onto torch's
        styles (``models/hf_tp.py``)."""
        parallelize_hf(self.hf, self.block_classes, tp_mesh, sequence_parallel)

    def tensor_parallel_plan(self, sequence_parallel: bool, tp: int) -> dict[str, ParallelStyle]:
        """The styles ``parallelize_tensors`` applies at ``tp``, by module path (read by the memory
        planner)."""
        styles = hf_tensor_parallel_styles(self.hf, self.block_classes, tp, sequence_parallel)
        prefix = module_name(self, self.hf)
        return {f"{prefix}.{name}" if name else prefix: style for name, style in styles.items()}

    def kept_in_fp32(self, dtype: torch.dtype) -> tuple[str, ...]:
        """The patterns of the weights this family keeps in fp32 when loaded in ``dtype``
        (``_keep_in_fp32_modules_strict`` in bf16 and fp16, ``_keep_in_fp32_modules`` in fp16 only:
        transformers 5's rule; each pattern is searched in a weight's name, ``*`` any run of
        characters). A MoE router's gate or correction bias written in bf16 was read back upcast,
        its fp32 precision gone (found by review of export-hf --dtype)."""
        kept = set(getattr(self.hf, "_keep_in_fp32_modules_strict", None) or ()) if dtype in (
            torch.bfloat16, torch.float16) else set()
        if dtype == torch.float16:
            kept |= set(getattr(self.hf, "_keep_in_fp32_modules", None) or ())
        return tuple(sorted(kept))

    def training_refusal(self) -> str | None:
        """Why this model cannot be trained as a causal LM (``unlike_causal_lm``; a router
        load-balancing loss its family computes otherwise than ``ROUTER_LOSS_CALL``), None if it can."""
        if reason := unlike_causal_lm(self.config, self.cfg.path):
            return reason
        if self.router_loss_asked and self._router_loss is None:
            return (f"model.path={self.cfg.path!r}: {CONFIG_FILE} sets output_router_logits: true (a router "
                    f"load-balancing loss), but {type(self.hf).__name__}.forward computes or weighs that "
                    "loss otherwise than Mixtral's, which shardtrain follows; set output_router_logits to "
                    "false to train on the cross-entropy alone")
        return None

    def document_mask_refusal(self) -> str | None:
        if reason := sequence_state_reason(self.config):  # the more telling reason first (Mamba's)
            return reason
        if "position_ids" not in inspect.signature(type(base_model_of(self.hf)).forward).parameters:
            return (f"a {self.config.model_type} model's forward takes no position_ids, so it never sees "
                    "where the packed documents start")
        return None

    def new_cache(self, max_len: int | None = None) -> HFCache:
        return HFCache(self.config)

    def parameter_name(self, stored: str) -> str:
        """The parameter a tensor stored in the model directory's files under ``stored`` fills
        whole (``expert_part`` for one expert's share of a stacked one)."""
        name, converted = rename_source_key(stored, self._renamings, self._converters)
        if converted is not None:
            raise ModelError(f"{stored}: stored in a layout transformers converts while loading "
                             f"({converted}) in a way shardtrain does not follow; load the model with "
                             "transformers' from_pretrained and save its state_dict() with safetensors "
                             "into a new model directory (beside config.json and the tokenizer files)")
        return PREFIX + name

    def expert_part(self, stored: str) -> ExpertPart | None:
        """Where one expert's tensor, stored as a module list does it (Mixtral's
        ``experts.3.w1.weight``, Qwen3-MoE's ``experts.3.gate_proj.weight``), goes in the parameter
        transformers stacks the experts in (``experts.gate_up_proj``: every expert's gate and up
        projections, concatenated); None for a tensor stored as it is used."""
        name, converted = rename_source_key(stored, self._renamings, self._converters)
        if converted is None:
            return None
        converter = next(c for c in self._converters if converted in c.source_patterns)
        if not stacks_experts(converter):
            return None  # parameter_name refuses it
        pattern = re.escape(converted).replace(r"\*", r"(\d+)")
        expert = re.search(pattern, stored)
        if expert is None:
            return None
        return ExpertPart(PREFIX + name, int(expert.group(1)), converter.source_patterns.index(converted),
                          len(converter.source_patterns))

    # ---- what the framework asks of a model -------------------------------------------------

    def extra_shard_groups(self) -> list[list[nn.Module]]:
        """The input embeddings (with any other embedding outside the blocks, e.g. GPT-2's positions)
        and the head with every other module outside the blocks that holds parameters (the final
        norm); one group when input and output embeddings share their weight."""
        in_blocks = {id(m) for block in self.modules() if isinstance(block, self.block_classes)
                     for m in block.modules()}
        head = self.hf.get_output_embeddings()
        loose = [m for m in self.hf.modules() if id(m) not in in_blocks and m is not head
                 and any(True for _ in m.parameters(recurse=False))]
        inputs = [m for m in loose if isinstance(m, nn.Embedding)]
        rest = [m for m in loose if not isinstance(m, nn.Embedding)] or self.final_norm()
        if self.tied:
            return [inputs + rest + [head]]
        return [inputs, rest + [head]]

    def final_norm(self) -> list[nn.Module]:
        """The base model's final norm, parameters or not: in the head's unit it gathers the head for
        a loss that applies the head itself to ``hidden_only`` states (OLMo's norm has no parameters,
        the head was alone in its unit, never gathered, and the chunked loss failed)."""
        for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f"):
            module = getattr(base_model_of(self.hf), name, None)
            if isinstance(module, nn.Module) and not isinstance(module, self.block_classes):
                return [module]
        return []

    def family_initialisation(self) -> FamilyInitialisation:
        """How the family initialises each parameter, found on first use: only runs that draw weights
        pay for it (a second build of the model, on the meta device: 1 s at 70B)."""
        if self._family_init is None:
            self._family_init = FamilyInitialisation(lambda: build_transformers_model(self.config))
        return self._family_init

    def init_parameter_elementwise(self, name: str) -> bool:
        """Whether ``init_parameter`` fills ``name`` element by element (each rank then draws only its
        shard's chunks): all but the few small parameters the family computes whole."""
        return self.family_initialisation().elementwise(hf_name(name))

    def init_parameter_constants(self, name: str) -> tuple[tuple[int, int, float], ...]:
        """Ranges of ``name``'s flattened elements its family sets to a constant after the draw (an
        embedding's padding row), which the framework sets where a rank's chunks hold them."""
        return self.family_initialisation().constants(hf_name(name))

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """``name`` (or, when elementwise, a chunk of it, flattened) as its family initialises it."""
        self.family_initialisation().fill(hf_name(name), tensor, generator)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Every buffer, garbage after materialisation on the device: non-persistent ones (RoPE
        tables) are in no weight file, and persistent ones (a router's ``e_score_correction_bias``)
        are read with the weights but from scratch nothing else sets them."""
        persistent = set(self.state_dict())
        self.buffers_only_in_weights: set[str] = set()
        owners: dict[str, nn.Module] = {}
        for name, _ in self.named_buffers():
            owner = name.rpartition(".")[0]
            owners.setdefault(owner, self.get_submodule(owner))
        for owner_name, module in owners.items():
            if not any(True for _ in module.parameters()) and hasattr(module, "config"):
                with torch.device("cpu"):  # a rotary embedding: built again from the config, small
                    fresh = type(module)(module.config)
                for buffer_name, value in fresh.named_buffers():
                    module.get_buffer(buffer_name).copy_(value)
            else:
                self.init_buffers_by_family(owner_name, module, persistent)

    def init_buffers_by_family(self, owner_name: str, module: nn.Module, persistent: set[str]) -> None:
        """The buffers of ``module`` as the family's ``_init_weights`` sets them (Gemma's scaled
        embedding's ``embed_scale``, a router's correction bias): building a module with parameters
        again would allocate them whole. The parameters are marked initialised, which transformers'
        init functions (and torch.nn.init's, which it guards as it does while loading) respect, and
        their version counters show that nothing wrote them (a write through ``.data`` would not
        show: transformers' own families make none). A buffer the family does not set is refused
        where nothing else will: a non-persistent one always, a persistent one when no weights are
        read (and the weights read must hold it: ``buffers_only_in_weights``)."""
        params = list(module.parameters())
        buffers = dict(module.named_buffers(prefix=owner_name, recurse=False))
        param_versions = [param._version for param in params]
        buffer_versions = {name: buffer._version for name, buffer in buffers.items()}
        marks = [param.__dict__.get("_is_hf_initialized") for param in params]
        for param in params:
            param._is_hf_initialized = True
        try:
            with guard_torch_init_functions():
                self.hf._init_weights(module)
        finally:
            for param, mark in zip(params, marks):
                if mark is None:
                    del param._is_hf_initialized
                else:
                    param._is_hf_initialized = mark
        unsupported = f"; {type(self.hf).__name__} is not supported"
        if [param._version for param in params] != param_versions:
            raise ModelError(f"{owner_name} ({type(module).__name__}): the family's _init_weights, run to "
                             f"set its buffers, wrote its parameters too{unsupported}")
        missed = [name for name, buffer in buffers.items() if buffer._version == buffer_versions[name]]
        if unread := [name for name in missed if name not in persistent]:
            raise ModelError(f"{', '.join(unread)} ({type(module).__name__}): a non-persistent buffer that "
                             f"neither a weight file nor the family's _init_weights sets{unsupported}")
        if missed and self.cfg.weights_source() is None:
            raise ModelError(f"{', '.join(missed)} ({type(module).__name__}): a buffer the family's "
                             "_init_weights does not set, so from scratch nothing does; load weights "
                             "(model.pretrained=true with weights in model.path, or model.init_from=)")
        self.buffers_only_in_weights.update(missed)  # the weight files must hold them

    def layers_with_a_mask(self, seq_len: int, document_mask: bool) -> list[bool]:
        """Per decoder layer, whether its SDPA attention gets a T x T mask at ``seq_len`` tokens
        (which it keeps for backward): transformers lets SDPA mask causally without one unless the
        layer's sliding window (or chunk) is shorter than the sequence or packed documents need one."""
        config = self.config
        layers = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None) or [
            "sliding_attention" if window else "full_attention"] * layers
        limits = {"sliding_attention": window,
                  "chunked_attention": getattr(config, "attention_chunk_size", None)}
        return [document_mask or (limits.get(kind) is not None and limits[kind] < seq_len) for kind in types]

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and not self.tied:
            n -= self.hf.get_input_embeddings().weight.numel()
        return n

    def inactive_expert_params(self) -> int:
        """Parameters of a MoE model's routed experts that a token does not run (``models/experts``):
        all but the ``num_experts_per_tok`` a token is routed to. 0 for a dense model."""
        k = getattr(self.hf, "num_experts_per_tok", None) or getattr(self.config, "num_experts_per_tok", None)
        if not isinstance(k, int) or isinstance(k, bool):
            return 0
        return inactive_expert_params(self.hf, k)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 per non-embedding parameter a token runs
        (a MoE layer's routed experts counted at the share it is routed to: counting them all made the
        MFU of Mixtral-8x7B 3.45x, of Qwen3-30B-A3B 6.8x, what the step computes) plus attention's
        scores and weighted sum, as for the built-in model, over the keys each layer attends to
        (``attention_spans``)."""
        d = self.dims
        active = self.num_params(exclude_embeddings=True) - self.inactive_expert_params()
        return 6 * active + 12 * d.attention_width * sum(attention_spans(self.config, seq_len))


def check_tensor_parallel(cfg: ModelConfig, tp: int, sequence_parallel: bool) -> None:
    """Whether ``model.path``'s model can take its declared tensor-parallel plan at ``tp``, before any
    process starts: built on the meta device (no memory, no weights read); one line if not."""
    if tp == 1:
        return
    with torch.device("meta"):
        model = HFCausalLM(cfg)
    check_declared_plan(model.hf, model.block_classes, tp, sequence_parallel)
