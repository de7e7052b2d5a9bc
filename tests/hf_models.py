"""Tiny Hugging Face model directories made locally from transformers' config classes (nothing is
downloaded): random weights saved as safetensors, and a byte-level BPE tokenizer trained here.

Four families: Llama; Qwen2 with tied embeddings; Mistral; GPT-NeoX (LayerNorm with biases, parallel
attention and MLP, partial rotary, a fused QKV projection). Sizes are not divisible by 2 or 4, so
FSDP's uneven shards are exercised.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
VOCAB = 300


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def sample_texts() -> list[str]:
    """Some of the standard library's source files: text every machine has."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("[a-c]*.py"))[:12]
    return [f.read_text(errors="replace") for f in files]


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
        return transformers.MistralConfig(num_key_value_heads=3, sliding_window=None, **common)
    if family == "gpt_neox":  # 3 heads of 12: RoPE on the first 6 dimensions of each
        return transformers.GPTNeoXConfig(**{**common, "num_attention_heads": 3}, rotary_pct=0.5,
                                          use_parallel_residual=True, tie_word_embeddings=False)
    raise ValueError(family)


FAMILIES = ("llama", "qwen2", "mistral", "gpt_neox")


def make_model_dir(directory: Path, family: str, seed: int = 0, tokenizer: Tokenizer | None = None,
                   max_shard_size: str | None = None, **sizes) -> Path:
    """A model directory as users have them: config.json, safetensors weights, tokenizer files."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = family_config(family, **sizes)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Like a trained model's: matrices larger than the default init (logits differ visibly per
        # token), norm weights and biases away from their initial 1 and 0.
        for param in model.parameters():
            if param.ndim > 1:
                param.normal_(0.0, 0.1)
            else:
                param.add_(torch.randn_like(param), alpha=0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer or train_tokenizer(sample_texts()), eos_token=EOS)
    fast.save_pretrained(directory)
    return directory
