"""A decoder's sizes, whatever built it: what throughput (FLOPs) and the memory planner read."""

from __future__ import annotations

from dataclasses import dataclass


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

    @classmethod
    def of_hf(cls, config) -> Dims:
        """From a transformers config (GPT-2's names are mapped by the config itself)."""
        heads = config.num_attention_heads
        ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
        return cls(config.hidden_size, config.num_hidden_layers, heads,
                   getattr(config, "num_key_value_heads", None) or heads,
                   ffn or 4 * config.hidden_size, config.vocab_size,
                   getattr(config, "head_dim", None) or config.hidden_size // heads)

    @property
    def attention_width(self) -> int:
        """The query projection's output width (and the attention output's, wo's input)."""
        return self.n_heads * self.head_dim
