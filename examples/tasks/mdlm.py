"""A masked-diffusion language model (MDLM): tokens are masked at a random noise level t and the
model learns to recover them, the loss on the masked positions weighted by the schedule.

    PYTHONPATH=examples/tasks shardtrain train task=mdlm:MaskedDiffusionLM trainer.devices=2

With the linear schedule (a token is masked with probability t), the continuous-time bound weighs
each masked position's cross-entropy by 1/t; the loss is normalised by the number of tokens (all
positions, masked or not), the MDLM convention. The noise level and the mask of every sample are
drawn in ``draw`` from the generator the framework seeds by the sample's position in the global
order, so they are the same at any world size and after a resume. The count is returned by
``loss`` only (no ``count()``), so the framework divides the accumulated gradients once, after
the last micro-batch.

The denoiser is a bidirectional transformer over bytes (256 values and a mask token) with its
input embedding tied to its output head. The text is this Python's own standard library.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.tasks.task import LossOutput, Task

VOCAB = 256
MASK = VOCAB  # the mask token's id


class DenoiserBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class Denoiser(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB + 1, dim)
        self.position = nn.Parameter(torch.zeros(length, dim))
        self.blocks = nn.ModuleList(DenoiserBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB + 1, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter under two names

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def stdlib_bytes(limit: int) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's ``json`` package sources, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"]) / "json"
    data = b"".join(path.read_bytes() for path in sorted(root.glob("*.py")))[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class ByteWindows(torch.utils.data.Dataset):
    def __init__(self, data: torch.Tensor, length: int) -> None:
        self.data, self.length = data, length

    def __len__(self) -> int:
        return len(self.data) // self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.data[index * self.length:(index + 1) * self.length]}


class MaskedDiffusionLM(Task):
    @dataclass
    class Options:
        length: int = 32
        dim: int = 32
        layers: int = 2
        heads: int = 4
        min_noise: float = 1e-3  # t is drawn from [min_noise, 1]: 1/t stays bounded
        train_bytes: int = 16_384
        val_bytes: int = 2_048

    count_unit = "tokens"
    init_parameter_elementwise = True

    def build_model(self) -> nn.Module:
        o = self.options
        return Denoiser(o.dim, o.layers, o.heads, o.length)

    def wrap_policy(self):
        return [DenoiserBlock]

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if name.endswith("bias"):
            tensor.zero_()
        elif "norm" in name:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)

    def train_dataset(self) -> ByteWindows:
        return ByteWindows(stdlib_bytes(self.options.train_bytes), self.options.length)

    def val_dataset(self) -> ByteWindows:
        o = self.options
        return ByteWindows(stdlib_bytes(o.train_bytes + o.val_bytes)[o.train_bytes:], o.length)

    def draw(self, item: dict, generator: torch.Generator) -> dict:
        """This sample's noise level and mask: each position masked on its own with probability t,
        as the bound assumes (a position forced masked weighed each token 1 + E[(1-t)/(L t)], 1.18 at
        L=32, and a nearly clean sample's one forced token about 500: found by review). A sample may
        have no masked position; its loss is 0 and it still counts its tokens, as in MDLM."""
        tokens = item["tokens"]
        t = self.options.min_noise + (1 - self.options.min_noise) * torch.rand((), generator=generator)
        masked = torch.rand(tokens.shape, generator=generator) < t
        return {"tokens": tokens, "noisy": torch.where(masked, MASK, tokens), "masked": masked,
                "t": t}

    def loss(self, model: nn.Module, batch: dict) -> LossOutput:
        logits = model(batch["noisy"]).float()
        ce = F.cross_entropy(logits.flatten(0, 1), batch["tokens"].flatten(), reduction="none")
        ce = ce.view_as(batch["tokens"]) * batch["masked"]
        weighted = (ce / batch["t"][:, None]).sum()
        return LossOutput(weighted, batch["tokens"].numel(),
                          {"masked_ce": (ce.sum(), batch["masked"].sum())})

    def describe(self) -> str:
        o = self.options
        return f"bytes of the standard library's json package, windows of {o.length} ({o.train_bytes} bytes)"
