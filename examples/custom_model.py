"""Bring your own model: a small GPT with its own block class, sharded and trained by shardtrain.

    python examples/custom_model.py [key=value ...]                       # one process
    torchrun --standalone --nproc-per-node 2 examples/custom_model.py     # two processes

A language model of your own trains through the built-in language-model task: it needs
``model(tokens) -> logits`` of shape (B, T, vocab), the class of its repeated block (the FSDP unit;
given here as ``wrap_policy``), and, optionally, an ``init_parameter(name, tensor, generator)``
method. With it the model is built on the meta device and every shard is initialised directly,
identically at any world size; without it shardtrain builds the whole model on CPU on every rank
before sharding (fine for small models) and says so. A model with another loss or other data is a
task of its own: see docs/tasks.md and examples/tasks/.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import shardtrain
from shardtrain.distributed.env import destroy_distributed
from shardtrain.tasks.language_model import LanguageModelTask


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4,
                 max_len: int = 256) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))

    # Each element is drawn on its own (the shape is never used): shardtrain may then initialise
    # just each rank's shard, in fixed-size chunks, instead of every full tensor on every rank.
    init_parameter_elementwise = True

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if name.endswith("bias"):
            tensor.zero_()
        elif ".ln" in name or name.startswith("ln."):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)


def main(overrides: list[str]) -> None:
    shardtrain.setup_logging()
    cfg = shardtrain.load_config(["experiment=quick", "trainer.max_steps=30", *overrides])
    try:
        result = shardtrain.run_training(cfg, task=LanguageModelTask(model=TinyGPT, wrap_policy=[Block]))
    finally:
        destroy_distributed()
    # Under torchrun every process has the result; a finished run resumed has no step left to train
    if int(os.environ.get("RANK", 0)) == 0 and result.losses:
        print(f"first loss {result.losses[0]:.3f}, last loss {result.losses[-1]:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
