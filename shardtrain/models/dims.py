"""A decoder's sizes, whatever built it: what throughput (FLOPs) and the memory planner read."""

from __future__ import annotations

from dataclasses import dataclass

from shardtrain.errors import ModelError


@dataclass
class Dims:
    """The sizes the throughput and memory estimates need, from any transformer's config."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    vocab_size: int
    # An attention head's width: dim / n_heads unless the config sets it (Qwen3, Gemma, Mistral-Nemo:
    # n_heads x head_dim is then not the model's width, and the attention's tensors follow it).
    head_dim: int
    # transformers' eager attention (a family without torch's fused one: Gemma 2) keeps every head's
    # T x T scores, and a soft-cap (tanh) one more copy of them; fused attention keeps none.
    eager_attention: bool = False
    softcapped_scores: bool = False

    @classmethod
    def of_hf(cls, config, eager_attention: bool = False) -> Dims:
        """From a transformers config (GPT-2's names are mapped by the config itself)."""
        heads = getattr(config, "num_attention_heads", None)
        if not heads:
            raise ModelError(f"{type(config).__name__} has no attention heads (num_attention_heads): a "
                             "model without attention (Mamba, RWKV) is not supported, as the FLOP and "
                             "memory estimates are a transformer's (hybrids such as Jamba are)")
        ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
        return cls(config.hidden_size, config.num_hidden_layers, heads,
                   getattr(config, "num_key_value_heads", None) or heads,
                   ffn or 4 * config.hidden_size, config.vocab_size,
                   getattr(config, "head_dim", None) or config.hidden_size // heads, eager_attention,
                   eager_attention and bool(getattr(config, "attn_logit_softcapping", None)))

    @property
    def attention_width(self) -> int:
        """The query projection's output width (and the attention output's, wo's input)."""
        return self.n_heads * self.head_dim


def even_tensor_parallel_degrees(sizes: list[int], tp: int) -> list[int]:
    """The tensor-parallel degrees up to ``8 * tp`` that split every one of ``sizes`` evenly (1 at
    least): what a refusal of ``tp`` offers instead, a model's sizes being given."""
    return [d for d in range(1, tp * 8 + 1) if all(size % d == 0 for size in sizes)]
