"""The built-in Llama's state-dict adapter to Hugging Face ``LlamaForCausalLM`` (as torchtitan keeps a
``state_dict_adapter.py`` beside each model): names, the q/k permutation and the config.

Names map one to one; the query and key projections are permuted because shardtrain's RoPE rotates
adjacent pairs (Meta's layout) while transformers rotates the two halves of each head. Export
converts one tensor at a time (``to_hf``), so it can stream; import reads row by row (``hf_rows``), so
each rank reads only its own rows of a permuted projection.
"""

from __future__ import annotations

import math
import re

import torch

from shardtrain.config.plan import dtype_name
from shardtrain.config.schema import ModelConfig
from shardtrain.errors import ModelError
from shardtrain.models.llama import ffn_hidden_dim

LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
HF_TO_OURS_LAYER = {v: k for k, v in LAYER_NAMES.items()}
HF_TO_OURS_TOP = {v: k for k, v in TOP_NAMES.items()}
# Fields that must agree between a model config and a Hugging Face directory before loading.
SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "tie_embeddings")


def to_hf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    match = LAYER.match(name)
    if not match or match.group(2) not in LAYER_NAMES:
        raise ModelError(f"no Hugging Face name for parameter {name!r}")
    return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}"


def from_hf_name(name: str) -> str | None:
    if name in HF_TO_OURS_TOP:
        return HF_TO_OURS_TOP[name]
    match = HF_LAYER.match(name)
    if match and match.group(2) in HF_TO_OURS_LAYER:
        return f"layers.{match.group(1)}.{HF_TO_OURS_LAYER[match.group(2)]}"
    return None  # e.g. rotary inv_freq buffers in old exports


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection: per head, pairs (0,1),(2,3)... -> halves (0..d/2, d/2..d)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_rows(rows: torch.Tensor, n_heads: int, total: int) -> torch.Tensor:
    """The Hugging Face row holding each of our q/k ``rows`` (of ``total``): ``halves_to_interleaved``
    row by row, so a rank can read its own rows of a permuted projection and no others."""
    head_dim = total // n_heads
    head, within = rows // head_dim, rows % head_dim
    return head * head_dim + (within % 2) * (head_dim // 2) + within // 2


def rotary_heads(name: str, cfg: ModelConfig) -> int | None:
    """Heads of a RoPE-rotated projection (q or k), None for every other parameter."""
    if name.endswith("attention.wq.weight"):
        return cfg.n_heads
    if name.endswith("attention.wk.weight"):
        return cfg.n_kv_heads
    return None


def to_hf(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> tuple[str, torch.Tensor] | None:
    """Our parameter -> (Hugging Face name, tensor); None for the tied head (transformers ties it)."""
    if name == "output.weight" and cfg.tie_embeddings:
        return None
    heads = rotary_heads(name, cfg)
    return to_hf_name(name), interleaved_to_halves(tensor, heads) if heads else tensor


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": ffn_hidden_dim(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim // cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype_name(dtype),
        "dtype": dtype_name(dtype),
        "bos_token_id": None,
        "eos_token_id": None,
    }


def model_config_from_hf(config: dict) -> ModelConfig:
    rope = config.get("rope_parameters") or {}
    return ModelConfig(
        vocab_size=config["vocab_size"], dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        ffn_hidden_dim=config["intermediate_size"],
        max_seq_len=config.get("max_position_embeddings", 2048),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        norm_eps=config.get("rms_norm_eps", 1e-6),  # transformers' LlamaConfig default, as it reads it
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


# What the built-in Llama computes the same way as a Hugging Face Llama only at the same value.
NUMERIC_FIELDS = ("rope_theta", "norm_eps")


def unrepresentable(config: dict) -> list[str]:
    """A Hugging Face Llama config's settings the built-in Llama has no way to compute: imported,
    its weights would load and give other logits without a word (Llama 3.1's rope scaling, biases,
    another activation, a head size other than dim / heads)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    found = []
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        found.append(f"rope_type {rope.get('rope_type', rope.get('type'))!r} (only plain RoPE)")
    found += [f"{key}=true (no biases)" for key in ("attention_bias", "mlp_bias") if config.get(key)]
    if config.get("hidden_act", "silu") != "silu":
        found.append(f"hidden_act {config['hidden_act']!r} (SwiGLU with silu only)")
    head_dim = config.get("head_dim")
    if head_dim and head_dim * config["num_attention_heads"] != config["hidden_size"]:
        found.append(f"head_dim {head_dim} (the built-in Llama's is hidden_size / num_attention_heads)")
    return found


def config_mismatches(ours: ModelConfig, theirs: ModelConfig) -> list[str]:
    """Why a Hugging Face directory's weights cannot fill a model built from ``ours``."""
    problems = [f"model.{f}={getattr(ours, f)} but the checkpoint has {getattr(theirs, f)}"
                for f in SHAPE_FIELDS if getattr(ours, f) != getattr(theirs, f)]
    problems += [f"model.{f}={getattr(ours, f)} but the checkpoint has {getattr(theirs, f)} (set it)"
                 for f in NUMERIC_FIELDS if not math.isclose(getattr(ours, f), getattr(theirs, f))]
    if ffn_hidden_dim(ours) != ffn_hidden_dim(theirs):
        problems.append(f"model.ffn_hidden_dim={ffn_hidden_dim(ours)} but the checkpoint has "
                        f"{ffn_hidden_dim(theirs)}")
    return problems
