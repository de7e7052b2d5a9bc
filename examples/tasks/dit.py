"""A diffusion transformer (DiT) that predicts the noise added to image latents, class-conditioned.

    PYTHONPATH=examples/tasks shardtrain train task=dit:LatentDiffusion trainer.devices=2

The model follows the DiT paper (and diffusers' ``DiTTransformer2DModel``): latents cut into
patches, a sinusoidal timestep embedding and a class embedding that modulate every block through
adaLN-Zero, and a final layer back to patches. Its sinusoidal frequency table is a non-persistent
buffer: the framework builds the model with its parameters on the meta device and restores the
table the constructor computed. The forward takes float latents (cast to the compute dtype by FSDP
under mixed precision) and integer timesteps and labels (left as they are).

Training is DDPM's: x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps with a linear beta schedule over
1,000 steps, the loss the squared error of the predicted noise, summed, normalised by the number of
latent elements. The timestep and the noise of every sample are drawn in ``draw``, from the
generator the framework seeds by the sample's position in the global order. The latents are
synthetic: a fixed random latent per class plus noise drawn from the sample's index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from shardtrain.tasks.task import LossOutput, Task

STEPS = 1000


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int, frequencies: int = 64) -> None:
        super().__init__()
        half = frequencies // 2
        self.register_buffer("frequencies", torch.exp(-math.log(10000.0) * torch.arange(half) / half),
                             persistent=False)
        self.mlp = nn.Sequential(nn.Linear(frequencies, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        angles = t.float()[:, None] * self.frequencies[None]
        features = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * dim, dim))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c).chunk(6, dim=1)
        h = modulate(self.norm1(x), shift1, scale1)
        x = x + gate1[:, None] * self.attn(h, h, h, need_weights=False)[0]
        return x + gate2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))


class DiT(nn.Module):
    def __init__(self, size: int, channels: int, patch: int, dim: int, depth: int, heads: int,
                 classes: int) -> None:
        super().__init__()
        self.patch, self.channels = patch, channels
        self.x_embedder = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)
        self.pos_embed = nn.Parameter(torch.zeros(1, (size // patch) ** 2, dim))
        self.t_embedder = TimestepEmbedder(dim)
        self.y_embedder = nn.Embedding(classes, dim)
        self.blocks = nn.ModuleList(DiTBlock(dim, heads) for _ in range(depth))
        self.final_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.final_linear = nn.Linear(dim, patch * patch * channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, _, height, width = x.shape
        h = self.x_embedder(x).flatten(2).transpose(1, 2) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.final_modulation(c).chunk(2, dim=1)
        h = self.final_linear(modulate(self.final_norm(h), shift, scale))
        p, grid = self.patch, width // self.patch
        h = h.view(b, height // p, grid, p, p, self.channels)
        return torch.einsum("bhwpqc->bchpwq", h).reshape(b, self.channels, height, width)


class SyntheticLatents(torch.utils.data.Dataset):
    def __init__(self, size: int, classes: int, channels: int, side: int, seed: int, offset: int = 0):
        self.size, self.classes, self.offset = size, classes, offset
        generator = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(classes, channels, side, side, generator=generator)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index += self.offset
        noise = torch.randn(self.templates.shape[1:], generator=torch.Generator().manual_seed(7 + index))
        label = index % self.classes
        return {"latents": self.templates[label] + 0.3 * noise, "label": torch.tensor(label)}


class LatentDiffusion(Task):
    @dataclass
    class Options:
        size: int = 8
        channels: int = 4
        patch: int = 2
        dim: int = 32
        depth: int = 2
        heads: int = 4
        classes: int = 4
        train_samples: int = 256
        val_samples: int = 32

    count_unit = "elements"
    init_parameter_elementwise = True

    def __init__(self, options=None, **overrides) -> None:
        super().__init__(options, **overrides)
        betas = torch.linspace(1e-4, 0.02, STEPS, dtype=torch.float64)
        self.alpha_bar = torch.cumprod(1 - betas, dim=0).float()

    def build_model(self) -> nn.Module:
        o = self.options
        return DiT(o.size, o.channels, o.patch, o.dim, o.depth, o.heads, o.classes)

    def wrap_policy(self):
        return [DiTBlock]

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """DiT's: adaLN modulations and the final linear start at zero (each block starts as the
        identity), biases at zero, the rest N(0, 0.02)."""
        if name.endswith("bias") or "modulation" in name or name.startswith("final_linear"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, 0.02, generator=generator)

    def train_dataset(self) -> SyntheticLatents:
        o = self.options
        return SyntheticLatents(o.train_samples, o.classes, o.channels, o.size, self.seed)

    def val_dataset(self) -> SyntheticLatents:
        o = self.options
        return SyntheticLatents(o.val_samples, o.classes, o.channels, o.size, self.seed,
                                offset=o.train_samples)

    def draw(self, item: dict, generator: torch.Generator) -> dict:
        t = torch.randint(0, STEPS, (), generator=generator)
        noise = torch.randn(item["latents"].shape, generator=generator)
        abar = self.alpha_bar[t]
        noisy = abar.sqrt() * item["latents"] + (1 - abar).sqrt() * noise
        return {"noisy": noisy, "noise": noise, "t": t, "label": item["label"]}

    def loss(self, model: nn.Module, batch: dict) -> LossOutput:
        predicted = model(batch["noisy"], batch["t"], batch["label"]).float()
        return LossOutput(((predicted - batch["noise"]) ** 2).sum(), batch["noise"].numel())

    def count(self, batch: dict) -> int:
        return batch["noise"].numel()

    def describe(self) -> str:
        o = self.options
        return (f"synthetic {o.channels}x{o.size}x{o.size} latents of {o.classes} classes "
                f"({o.train_samples} train)")
