"""Tiny Hugging Face model directories made locally from transformers' config classes (nothing is
downloaded): random weights saved as safetensors, and a byte-level BPE tokenizer trained here.

Four families: Llama; Qwen2 with tied embeddings; Mistral; GPT-NeoX (LayerNorm with biases, parallel
attention and MLP, partial rotary, a fused QKV projection). Sizes are not divisible by 2 or 4, so
FSDP's uneven shards are exercised.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "finetune_hf"))
import make_model  # noqa: E402  (the example's model maker: one tokenizer recipe for both)

VOCAB = 300


def sample_texts() -> list[str]:
    return make_model.sample_texts(count=12)


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB):
    return make_model.train_tokenizer(texts, vocab_size)


def family_config(family: str, vocab_size: int = VOCAB, **sizes) -> transformers.PretrainedConfig:
    common = dict(vocab_size=vocab_size, hidden_size=36, intermediate_size=97, num_hidden_layers=3,
                  num_attention_heads=6, max_position_embeddings=128, eos_token_id=0,
                  bos_token_id=None, pad_token_id=None)
    common.update(sizes)
    if family == "llama":
        return transformers.LlamaConfig(num_key_value_heads=2, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common)
    if family == "mistral":
        return transformers.MistralConfig(**{"num_key_value_heads": 3, "sliding_window": None, **common})
    if family == "gpt_neox":  # 3 heads of 12: RoPE on the first 6 dimensions of each
        return transformers.GPTNeoXConfig(**{**common, "num_attention_heads": 3}, rotary_pct=0.5,
                                          use_parallel_residual=True, tie_word_embeddings=False)
    raise ValueError(family)


FAMILIES = ("llama", "qwen2", "mistral", "gpt_neox")


def make_model_dir(directory: Path, family: str, seed: int = 0, tokenizer=None, **sizes) -> Path:
    """A model directory as users have them, with weights like a trained model's: matrices larger
    than the default init (logits differ visibly per token), norm weights and biases away from their
    initial 1 and 0."""
    make_model.save_model_dir(directory, family_config(family, **sizes),
                              tokenizer or train_tokenizer(sample_texts()), seed=seed)
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        noise = torch.randn(tensor.shape, generator=generator) * 0.1
        tensors[name] = noise if tensor.ndim > 1 else tensor + noise
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return directory
