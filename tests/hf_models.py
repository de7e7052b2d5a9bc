"""Tiny Hugging Face model directories made locally from transformers' config classes (nothing is
downloaded): random weights saved as safetensors, and a byte-level BPE tokenizer trained here.

Five families: Llama; Qwen2 with tied embeddings; Mistral; GPT-NeoX (LayerNorm with biases, parallel
attention and MLP, partial rotary, a fused QKV projection); Gemma 2 (eager attention with soft-capped
scores and sliding windows, four norms a block, a scaled embedding with a buffer, tied, soft-capped
logits). Sizes are not divisible by 2 or 4, so
FSDP's uneven shards are exercised. More families' configs (``initialisation_family_config``) for
the from-scratch initialisation's tests.
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
    if family == "mixtral":  # 4 experts, 2 a token, with the router's load-balancing loss asked for
        # sizes in multiples of 16 bytes: transformers' experts run torch's grouped_mm, which needs them
        return transformers.MixtralConfig(**{**common, "hidden_size": 48, "intermediate_size": 64},
                                          num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                          output_router_logits=True, router_aux_loss_coef=0.05)
    if family == "gpt_neox":  # 3 heads of 12: RoPE on the first 6 dimensions of each
        return transformers.GPTNeoXConfig(**{**common, "num_attention_heads": 3}, rotary_pct=0.5,
                                          use_parallel_residual=True, tie_word_embeddings=False)
    return initialisation_family_config(family, common)


def initialisation_family_config(family: str, common: dict) -> transformers.PretrainedConfig:
    """Families whose own ``_init_weights`` departs from normal / ones / zeros: GPT-2 (residual
    projections' std / sqrt(2 n_layer)), Gemma (tied; RMSNorm weights at zero, ``x * (1 + w)``; a
    padding row), Jamba (Mamba mixers: log-arange ``A_log``, ``D`` ones), Bamba (Mamba-2 mixers),
    Gemma 2 and 3 (the same scaled embedding), Qwen3-Next (gated delta net: ``A_log`` log-uniform,
    zero-centred norms), Nemotron-H (Mamba-2:
    ``dt_bias`` drawn through softplus's inverse, ``out_proj`` kaiming-uniform rescaled by a copy);
    ModernBERT's decoder (``trunc_normal_``, which shardtrain cannot follow)."""
    gqa = dict(common, num_key_value_heads=2)
    if family == "gpt2":
        return transformers.GPT2Config(**common)
    if family == "gemma":
        return transformers.GemmaConfig(**{**gqa, "pad_token_id": 1}, head_dim=6)
    if family == "qwen3":  # per-head query and key norms
        return transformers.Qwen3Config(**gqa, head_dim=6)
    if family == "gemma2":  # also soft-capped logits and four norms a block
        return transformers.Gemma2Config(**{"sliding_window": 16, **gqa, "pad_token_id": 1}, head_dim=6)
    if family == "gemma3_text":
        return transformers.Gemma3TextConfig(**{"sliding_window": 16, **gqa, "pad_token_id": 1}, head_dim=6)
    if family == "jamba":  # mamba, attention, mamba
        return transformers.JambaConfig(**gqa, mamba_d_state=4, mamba_expand=2, attn_layer_period=3,
                                        attn_layer_offset=1, num_experts=1, use_mamba_kernels=False)
    if family == "bamba":
        return transformers.BambaConfig(**gqa, mamba_n_heads=6, mamba_d_head=12, mamba_d_state=4,
                                        mamba_n_groups=1, attn_layer_indices=[1])
    if family == "qwen3_next":  # three linear-attention layers, one full
        return transformers.Qwen3NextConfig(
            **{**gqa, "num_hidden_layers": 4}, head_dim=6, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, num_experts=3, num_experts_per_tok=1,
            moe_intermediate_size=16, shared_expert_intermediate_size=16)
    if family == "nemotron_h":
        return transformers.NemotronHConfig(**gqa, mamba_num_heads=6, mamba_head_dim=12, ssm_state_size=4,
                                            n_groups=1, n_routed_experts=4, moe_intermediate_size=16,
                                            moe_shared_expert_intermediate_size=16)
    if family == "llama4_text":  # its base model is `model`, its base_model_prefix "language_model"
        return transformers.Llama4TextConfig(
            **{**gqa, "hidden_size": 48, "intermediate_size": 64}, head_dim=8, intermediate_size_mlp=64,
            num_local_experts=2, interleave_moe_layer_step=2, attention_chunk_size=128)
    if family == "modernbert_decoder":
        return transformers.ModernBertDecoderConfig(**{**common, "pad_token_id": 1, "bos_token_id": 2})
    raise ValueError(family)


FAMILIES = ("llama", "qwen2", "mistral", "gpt_neox", "gemma2")
# Families whose from-scratch initialisation is compared with transformers' (tests/test_hf_models.py).
INITIALISATION_FAMILIES = (*FAMILIES, "gpt2", "gemma", "jamba", "bamba", "qwen3_next", "nemotron_h")


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
