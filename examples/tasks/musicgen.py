"""A language model over K parallel audio-codebook streams with MusicGen's delay pattern.

    PYTHONPATH=examples/tasks shardtrain train task=musicgen:CodebookLM task.codebooks=4 trainer.devices=2

Codebook k of a sample is delayed by k frames (MusicGen's "delay" interleaving, as in AudioCraft and
transformers' ``MusicgenForCausalLM``): at step s the model sees every codebook's previous token and
predicts all K of step s. The positions the delay leaves empty (the first k of codebook k and the
last K-1-k) hold a special token and are not targets: the loss counts only the valid positions of
every codebook. Samples have different lengths, so ``collate`` pads them (padding is no target
either). The model is a plain module (sum of K embeddings, causal transformer blocks with a
sinusoidal position table, K heads) trained from the weights its own constructor draws: the task
gives no initialiser, so the framework builds it on the CPU, seeded, on every rank.

The data is synthetic: every codebook of a sample is an arithmetic sequence of codes whose start
and step come from the sample's index, so the loss can fall.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.tasks.task import LossOutput, Task

IGNORE = -100


def sinusoidal_table(length: int, dim: int) -> torch.Tensor:
    position = torch.arange(length, dtype=torch.float32)[:, None]
    frequencies = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2], table[:, 1::2] = torch.sin(position * frequencies), torch.cos(position * frequencies)
    return table


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        # Without biases, as MusicGen's decoder attention (a key bias only gets rounding noise).
        self.attention = nn.MultiheadAttention(dim, heads, bias=False, batch_first=True)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        causal = torch.full((x.shape[1], x.shape[1]), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.ffn(self.norm2(x))


class CodebookDecoder(nn.Module):
    """(B, K, S) codes -> (B, K, S, cardinality) logits; code ``cardinality`` is the special token."""

    def __init__(self, codebooks: int, cardinality: int, dim: int, layers: int, heads: int,
                 max_len: int) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(cardinality + 1, dim) for _ in range(codebooks))
        self.layers = nn.ModuleList(DecoderLayer(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.heads = nn.ModuleList(nn.Linear(dim, cardinality, bias=False) for _ in range(codebooks))
        self.register_buffer("positions", sinusoidal_table(max_len, dim), persistent=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        x = sum(embedding(codes[:, k]) for k, embedding in enumerate(self.embeddings))
        x = x + self.positions[: codes.shape[-1]].to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return torch.stack([head(x) for head in self.heads], dim=1)


def delay(codes: torch.Tensor, special: int) -> torch.Tensor:
    """(K, T) -> (K, T + K - 1): codebook k shifted right by k, the gaps filled with ``special``."""
    k, t = codes.shape
    out = torch.full((k, t + k - 1), special, dtype=codes.dtype)
    for index in range(k):
        out[index, index:index + t] = codes[index]
    return out


class SyntheticCodes(torch.utils.data.Dataset):
    def __init__(self, size: int, codebooks: int, cardinality: int, min_frames: int, max_frames: int,
                 offset: int = 0) -> None:
        self.size, self.codebooks, self.cardinality = size, codebooks, cardinality
        self.min_frames, self.max_frames, self.offset = min_frames, max_frames, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(1_000 + index + self.offset)
        frames = int(torch.randint(self.min_frames, self.max_frames + 1, (), generator=generator))
        start = torch.randint(0, self.cardinality, (self.codebooks, 1), generator=generator)
        step = torch.randint(1, 4, (self.codebooks, 1), generator=generator)
        return {"codes": (start + step * torch.arange(frames)) % self.cardinality}


class CodebookLM(Task):
    @dataclass
    class Options:
        codebooks: int = 4
        cardinality: int = 32
        dim: int = 32
        layers: int = 2
        heads: int = 4
        min_frames: int = 8
        max_frames: int = 14
        train_samples: int = 256
        val_samples: int = 32

    count_unit = "codes"

    def build_model(self) -> nn.Module:
        o = self.options
        return CodebookDecoder(o.codebooks, o.cardinality, o.dim, o.layers, o.heads,
                               o.max_frames + o.codebooks)

    def wrap_policy(self):
        return [DecoderLayer]

    def train_dataset(self) -> SyntheticCodes:
        o = self.options
        return SyntheticCodes(o.train_samples, o.codebooks, o.cardinality, o.min_frames, o.max_frames)

    def val_dataset(self) -> SyntheticCodes:
        o = self.options
        return SyntheticCodes(o.val_samples, o.codebooks, o.cardinality, o.min_frames, o.max_frames,
                              offset=o.train_samples)

    def collate(self, items: list[dict]) -> dict[str, torch.Tensor]:
        """Delayed codes, inputs shifted right by one step (a special start token), padded to the
        longest sample; only the real, non-delay positions are targets."""
        special = self.options.cardinality
        delayed = [delay(item["codes"], special) for item in items]
        length = max(d.shape[1] for d in delayed)
        inputs = torch.full((len(items), self.options.codebooks, length), special, dtype=torch.long)
        targets = torch.full_like(inputs, IGNORE)
        for row, d in enumerate(delayed):
            inputs[row, :, 1:d.shape[1]] = d[:, :-1]
            valid = d != special
            targets[row, :, :d.shape[1]] = torch.where(valid, d, IGNORE)
        return {"inputs": inputs, "targets": targets}

    def loss(self, model: nn.Module, batch: dict) -> LossOutput:
        logits = model(batch["inputs"]).float()
        targets = batch["targets"]
        loss = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), ignore_index=IGNORE, reduction="sum")
        return LossOutput(loss, (targets != IGNORE).sum())

    def count(self, batch: dict) -> int:
        return int((batch["targets"] != IGNORE).sum())

    def describe(self) -> str:
        o = self.options
        return (f"synthetic codes, {o.codebooks} codebooks of {o.cardinality}, {o.min_frames}-"
                f"{o.max_frames} frames ({o.train_samples} train)")
