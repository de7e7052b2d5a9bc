"""Low-rank adapters (LoRA) on any model, injected in place by PEFT, on a frozen base.

``add_adapters`` runs where the model is built (on the meta device, before sharding), so it serves
the built-in Llama, ``model.name=hf`` and every task alike. PEFT's ``inject_adapter_in_model``
replaces each targeted ``nn.Linear`` by a LoRA layer in place, without wrapping the model: module
names stay ours, so FSDP units, activation checkpointing and the weight readers keep working. The
one change in names is PEFT's: a targeted layer's own weight moves to ``<module>.base_layer.weight``
beside ``<module>.lora_A.default.weight`` and ``<module>.lora_B.default.weight``; ``base_name``
maps it back wherever base weights are read or drawn, so a LoRA run's base is the plain run's.

The adapters' initial values are PEFT's (``lora_A`` kaiming-uniform with a = sqrt(5), that is
uniform in +-1/sqrt(fan_in); ``lora_B`` zeros), drawn by ``AdapterInitializer`` through the
framework's seeded, world-size-invariant initialisation instead of the global RNG.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import io
import logging
import math
import re
import tokenize
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from shardtrain.config.schema import FinetuneConfig
from shardtrain.errors import ConfigError, ModelError
from shardtrain.models.initializer import draws_elementwise, elementwise_constants

log = logging.getLogger("shardtrain")

ADAPTER_NAME = "default"  # PEFT's name for a model's only adapter
BASE_LAYER = ".base_layer."
# finetune.targets=[]: the attention and MLP projections of the built-in Llama (wq..w3), of
# Llama/Mistral/Qwen2-style Hugging Face models, of GPT-NeoX (fused QKV, dense, the MLP pair), of
# Phi-3 (fused qkv_proj and gate_up_proj), of OPT and Phi (out_proj, fc1, fc2) and of GPT-J (fc_in,
# fc_out): the last three families' were left without adapters, without a word (found by a trial).
DEFAULT_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3",
                   "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h",
                   "qkv_proj", "gate_up_proj", "out_proj", "fc1", "fc2", "fc_in", "fc_out")


# A child's weight read by its parent's code other than for its dtype, device or shape
# (``self.dt_proj.weight @ x``): the child's own forward does not run for it. Matched in the code
# without its comments and strings, its tokens joined by spaces.
DIRECT_WEIGHT_READ = re.compile(
    r"\bself\s*\.\s*(\w+)\s*\.\s*weight\b(?!\s*\.\s*(?:dtype|device|shape|ndim|size|dim|data_ptr)\b)")
# ... nor where it is only looked at or initialised (T5's isinstance(self.wo.weight, ...), init.*)
LOOKED_AT = re.compile(r"(?:\bisinstance|\bgetattr|\bhasattr|\binit\s*\.\s*\w+)\s*\(\s*$")


# Comments and strings; from Python 3.12 an f-string's text is a token of its own
TEXT_TOKENS = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}


def code_tokens(source: str) -> str:
    """``source`` without its comments and strings (docstrings), its tokens joined by spaces."""
    try:
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        return " ".join(token.string for token in tokens if token.type not in TEXT_TOKENS)
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return source


@functools.cache
def weights_read_directly(module_class: type) -> frozenset[str]:
    """The names of the children whose weight ``module_class``'s code (every method of it, on any
    path: a read behind a setting, Bloom's slow tensor-parallel path, counts) reads itself; none where
    its source cannot be read."""
    try:
        code = code_tokens(inspect.getsource(module_class))
    except (OSError, TypeError):
        return frozenset()
    return frozenset(match[1] for match in DIRECT_WEIGHT_READ.finditer(code)
                     if not LOOKED_AT.search(code, max(0, match.start() - 60), match.start()))


def read_without_calling(model: nn.Module) -> dict[str, str]:
    """The modules of ``model`` whose weight their parent reads without calling them (Jamba's Mamba
    mixer: ``self.dt_proj.weight @ ...``; Bamba's and Nemotron-H's ``out_proj`` in their fused CUDA
    kernel's path; nn.MultiheadAttention's ``out_proj``), each with its parent's class name: an
    adapter there would never run, an NF4 weight there fails its first forward (found by review)."""
    found = {}
    for parent_name, parent in model.named_modules():
        for child_name in weights_read_directly(type(parent)):
            if isinstance(parent._modules.get(child_name), nn.Module):
                found[f"{parent_name}.{child_name}" if parent_name else child_name] = type(parent).__name__
    return found


def base_name(name: str) -> str:
    """The name a parameter has in the model without adapters (PEFT moves a targeted layer's weight
    under ``base_layer``)."""
    return name.replace(BASE_LAYER, ".")


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` belongs to a LoRA adapter."""
    return ".lora_A." in name or ".lora_B." in name


def matches(module_name: str, target: str) -> bool:
    """PEFT's rule for a list of targets: the whole name, or its end after a dot."""
    return module_name == target or module_name.endswith("." + target)


def head_modules(model: nn.Module) -> dict[int, str]:
    """The model's output head(s), by id: LoRA there would bypass the chunked loss and export maps."""
    heads = {}
    for owner in (model, getattr(model, "hf", None)):
        for getter in ("output_head", "get_output_embeddings"):
            head = getattr(owner, getter, None)
            found = head() if callable(head) else None
            if isinstance(found, nn.Module):
                heads[id(found)] = getter
    return heads


def held_targets(finetune: FinetuneConfig, adapter_names: Iterable[str]) -> FinetuneConfig:
    """A checkpoint's LoRA settings with the modules its adapters are on (``adapter_names``, its
    adapter parameters) as the targets, where it records the default ones: the defaults widened on
    2026-12-01 (OPT, Phi, Phi-3, GPT-J), and exports, generate and eval rebuilt such a checkpoint with
    adapters it does not hold (found by a review). The same modules for a newer checkpoint."""
    if finetune.targets:
        return finetune
    modules = sorted({name.split(".lora_A.")[0] for name in adapter_names if ".lora_A." in name})
    return dataclasses.replace(finetune, targets=modules) if modules else finetune


def adapter_targets(model: nn.Module, targets: Iterable[str]) -> list[str]:
    """The modules of ``model`` the target patterns select, each an ``nn.Linear`` of the model's body;
    a ConfigError naming an embedding, the output head or a layer LoRA does not take."""
    patterns = list(targets) or list(DEFAULT_TARGETS)
    heads = head_modules(model)
    read_by_parent = read_without_calling(model)
    chosen = []
    for name, module in model.named_modules():
        if not name or not any(matches(name, pattern) for pattern in patterns):
            continue
        if not targets and (not isinstance(module, nn.Linear) or name in read_by_parent
                            or isinstance(module, NonDynamicallyQuantizableLinear)):
            # The defaults name many families' projections: a module of another kind by one of
            # those names (nn.MultiheadAttention's out_proj, a container) is not a projection here,
            # nor one whose weight its parent reads itself on some path (a Mamba mixer's out_proj,
            # which PEFT refuses; Bloom's dense under its slow tensor-parallel setting).
            continue
        if isinstance(module, nn.Embedding):
            raise ConfigError(f"finetune.targets selects the embedding {name!r}: LoRA on embeddings is "
                              "not supported yet; target the attention and MLP projections")
        if id(module) in heads:
            raise ConfigError(f"finetune.targets selects the output head {name!r}: LoRA on the head is "
                              "not supported yet; target the attention and MLP projections")
        if isinstance(module, NonDynamicallyQuantizableLinear):
            raise ConfigError(f"finetune.targets selects {name!r}, the output projection of an "
                              "nn.MultiheadAttention, which reads its weight without calling it: an "
                              "adapter there would never run; name other projections")
        if not isinstance(module, nn.Linear):  # subclasses are layers PEFT wraps like nn.Linear
            if any(isinstance(child, nn.Linear) for child in module.modules()):
                continue  # a container whose name matches (GPT-NeoX's "attention.dense" is the layer)
            raise ConfigError(f"finetune.targets selects {name!r}, a {type(module).__name__}: LoRA "
                              "takes nn.Linear layers only; name the projections")
        chosen.append(name)
    if not chosen:
        raise ConfigError(f"finetune.targets {patterns} selects no nn.Linear of {type(model).__name__}; "
                          "name its projections (the end of a module name, e.g. q_proj)")
    # Each pattern given must select a layer (the defaults name several families' projections):
    # one that selects none, misspelt, would train fewer adapters than asked without a word.
    idle = [pattern for pattern in targets if not any(matches(name, pattern) for name in chosen)]
    if idle:
        raise ConfigError(f"finetune.targets {idle} select{'s' if len(idle) == 1 else ''} no nn.Linear of "
                          f"{type(model).__name__} (the others do); fix or drop "
                          f"{'it' if len(idle) == 1 else 'them'}")
    return chosen


def unadapted_linears(model: nn.Module) -> dict[str, int]:
    """The linear layers of a model with adapters that carry none (not the output head), counted
    by their last name: what the default targets left out of a family they do not know."""
    heads = head_modules(model)
    adapted = set(adapter_modules(model))
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if (not isinstance(module, nn.Linear) or isinstance(module, NonDynamicallyQuantizableLinear)
                or id(module) in heads or name in adapted or name.endswith(BASE_LAYER.rstrip("."))
                or is_adapter(name + ".")):
            continue
        last = name.rsplit(".", 1)[-1]
        counts[last] = counts.get(last, 0) + 1
    return counts


def adapter_flops_per_token(model: nn.Module, full_flops: float, cfg: FinetuneConfig) -> float:
    """Training FLOPs per token of ``model`` (before its adapters are added) fine-tuned with adapters:
    ``full_flops`` (6 per non-embedding parameter, forward and backward, plus attention) less the frozen
    base's weight gradients (2 per parameter: its backward computes the inputs' gradients only), plus
    6 per adapter parameter (``rank * (in + out)`` per adapted linear). Counted as full training, the
    logged MFU under LoRA was 1.5x what the step computes."""
    if cfg.method == "none":
        return full_flops
    if hasattr(model, "flops_per_token") and hasattr(model, "num_params"):
        # the parameters a token runs (a MoE model's routed experts at their share)
        inactive = getattr(model, "inactive_expert_params", None)
        base = model.num_params(exclude_embeddings=True) - (inactive() if callable(inactive) else 0)
    else:  # counted as 6 per parameter
        base = sum(p.numel() for p in model.parameters())
    linears = [model.get_submodule(name) for name in adapter_targets(model, cfg.targets)]
    adapters = sum(cfg.rank * (linear.in_features + linear.out_features) for linear in linears)
    return full_flops - 2 * base + 6 * adapters


def peft_package() -> Any:
    """PEFT, imported only by runs that fine-tune with adapters, through importlib on purpose (as
    the trackers are): importing it imports transformers' quantizers and, where installed, torchao,
    1.5 s and torchao's kernel-loading warnings on CPU for every process of every other run."""
    return importlib.import_module("peft")


def lora_config(cfg: FinetuneConfig, modules: list[str]) -> Any:
    """PEFT's ``LoraConfig`` for ``cfg`` on ``modules``."""
    return peft_package().LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=modules, bias="none")


def add_adapters(model: nn.Module, cfg: FinetuneConfig) -> nn.Module:
    """``model`` with LoRA adapters on ``cfg.targets`` (PEFT, in place) and every other parameter
    frozen. The adapters are fp32 whatever the base's dtype."""
    if cfg.method not in ("lora", "qlora"):
        raise ConfigError(f"finetune.method={cfg.method!r} adds no adapters")
    modules = adapter_targets(model, cfg.targets)
    read_by_parent = read_without_calling(model)
    if bypassed := [name for name in modules if name in read_by_parent]:
        # Named (a checkpoint's adapters are too): its code may read the weight on a path the run does
        # not take (Bloom's), so said, not refused
        log.warning(f"finetune.targets: {read_by_parent[bypassed[0]]}'s code reads the weight of "
                    f"{bypassed[0]}{f' (and {len(bypassed) - 1} more)' if len(bypassed) > 1 else ''} without "
                    "calling the layer on some path (Jamba's Mamba dt_proj always, a fused CUDA kernel's "
                    "out_proj): an adapter there does not run on that path; name other layers if it is yours")
    # Into the module PEFT knows (a transformers model inside a wrapper): PEFT reads the transformers
    # model's weight-conversion mapping of the model it is given, which asks it for attributes a
    # wrapper lacks (GPT-NeoX, Jamba, the MoE families raised AttributeError: base_model_prefix).
    root = getattr(model, "adapter_root", "")
    host = model.get_submodule(root)
    relative = [name.removeprefix(f"{root}.") for name in modules] if root else modules
    try:
        peft_package().inject_adapter_in_model(lora_config(cfg, relative), host, adapter_name=ADAPTER_NAME)
    except ValueError as exc:  # PEFT's refusal of a layer (a Mamba mixer's out_proj), a traceback before
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ConfigError(f"finetune.method={cfg.method}: PEFT refused the adapters on {type(host).__name__} "
                          f"({first[:300]}); name other layers in finetune.targets") from exc
    # PEFT rewrites the targets of a transformers model whose family transformers v5 converts (the
    # mixture-of-experts families: the routed experts' fused weights in place of the layers chosen),
    # and the weights' names with them: refused, where loading the base failed on missing keys.
    if (placed := adapter_modules(model)) != sorted(modules):
        missed = sorted(set(modules) - set(placed))
        raise ConfigError(f"finetune.method={cfg.method}: PEFT put the adapters elsewhere than the layers "
                          f"finetune.targets chose in {type(host).__name__} ({len(missed)} chosen not "
                          f"adapted, e.g. {(missed or placed)[0]}): transformers' weight conversion for this "
                          "family rewrites LoRA's targets; LoRA is not supported for it here, train it "
                          "with finetune=none")
    for name, param in model.named_parameters():
        adapter = is_adapter(name)
        param.requires_grad_(adapter)
        if adapter and param.dtype != torch.float32:
            raise ModelError(f"adapter {name} was made in {param.dtype}; build the model in fp32")
    return model


def adapter_modules(model: nn.Module) -> list[str]:
    """Names of the modules that carry adapters (PEFT's LoRA layers)."""
    return sorted({name.split(".lora_A.")[0] for name, _ in model.named_parameters()
                   if ".lora_A." in name})


class AdapterInitializer:
    """Initialises the adapters as PEFT does and defers every other parameter to ``base`` (the task's
    or the model's ``init_parameter``), under the names the base model has. The adapters are drawn
    elementwise whatever the base (the bound of ``lora_A`` depends on its fan-in alone, recorded
    here), every other parameter as ``base`` draws it."""

    def __init__(self, base: Any, model: nn.Module) -> None:
        self.base = base
        self.fan_in = {name: param.shape[1] for name, param in model.named_parameters()
                       if ".lora_A." in name}

    def init_parameter_elementwise(self, name: str) -> bool:
        # An adapter on read weights does not ask the base (which may not know how to draw them).
        return is_adapter(name) or draws_elementwise(self.base, base_name(name))

    def init_parameter_constants(self, name: str) -> Sequence[tuple[int, int, float]]:
        return () if is_adapter(name) else elementwise_constants(self.base, base_name(name))

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if ".lora_A." in name:
            bound = 1.0 / math.sqrt(self.fan_in[name])  # kaiming_uniform_(a=sqrt(5)) of PEFT
            tensor.uniform_(-bound, bound, generator=generator)
        elif ".lora_B." in name:
            tensor.zero_()
        else:
            self.base.init_parameter(base_name(name), tensor, generator)


def store_base_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with every frozen parameter stored in ``dtype`` (``finetune.base_dtype``); the
    adapters stay fp32. FSDP2 all-gathers a unit of mixed dtypes and reduce-scatters only the
    adapters' gradients, which stay of one dtype."""
    for name, param in model.named_parameters():
        if not is_adapter(name):
            param.data = param.data.to(dtype)
    return model


def local_bytes(param: torch.Tensor) -> int:
    """Bytes of ``param`` this rank holds (its shard, for a sharded DTensor)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return stored_bytes(local)


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor`` stores: for a tensor subclass such as QLoRA's NF4 weights, its inner tensors'
    (4-bit data and scales), not its elements times the dtype it presents."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


@torch.no_grad()
def round_base_to(model: nn.Module, dtype: torch.dtype) -> None:
    """Round every frozen parameter of ``model`` (sharded or not) to ``dtype`` in place, keeping its
    own dtype: a ``finetune.base_dtype=bf16`` base computed in fp32 (the exports' checks, generate
    and eval in fp32) holds the values training stored."""
    for name, param in model.named_parameters():
        if not is_adapter(name):
            local = param.to_local() if hasattr(param, "to_local") else param
            local.copy_(local.to(dtype))
