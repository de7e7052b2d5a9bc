"""A small Hugging Face model directory made here, as users have them from the Hub (nothing is
downloaded): config.json, safetensors weights, and a byte-level BPE tokenizer trained locally with
the ``tokenizers`` library (tokenizer.json, tokenizer_config.json with its end-of-text token).

    python examples/finetune_hf/make_model.py OUT_DIR
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
# ChatML, as Qwen's tokenizers write it (a model trained on chat data would have learned it).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def sample_texts(count: int = 40) -> list[str]:
    """Python standard library sources: text every machine has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [path.read_text(errors="replace") for path in sorted(root.glob("[a-c]*.py"))[:count]]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=[EOS, "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def save_model_dir(directory: Path, config: transformers.PretrainedConfig, tokenizer: Tokenizer,
                   seed: int = 0, **save_kwargs) -> Path:
    """Random weights for ``config`` and ``tokenizer``, saved as transformers saves a model."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, **save_kwargs)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS,
                                         chat_template=CHAT_TEMPLATE).save_pretrained(directory)
    return directory


def make_llama(directory: Path, vocab_size: int = 1024) -> Path:
    """A 2-layer Llama (grouped-query attention) with its own tokenizer."""
    tokenizer = train_tokenizer(sample_texts(), vocab_size)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=128, intermediate_size=352,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, eos_token_id=tokenizer.token_to_id(EOS), bos_token_id=None)
    return save_model_dir(directory, config, tokenizer)


if __name__ == "__main__":
    print(make_llama(Path(sys.argv[1])))
