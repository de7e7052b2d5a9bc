"""Image classification with a vision transformer, shaped like timm's ``VisionTransformer``.

    PYTHONPATH=examples/tasks shardtrain train task=vit:ImageClassification task.depth=4 trainer.devices=2

timm is what a user would bring, but it needs torchvision, whose release for torch 2.13 fails to
import beside the CPU wheel; this model keeps timm's module names and structure (``patch_embed.proj``,
``cls_token``, ``pos_embed``, ``blocks.N.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}``, ``norm``,
``head``, and DeiT's distillation head ``head_dist``, unused unless distilling: a parameter that
never gets a gradient) so that swapping in ``timm.create_model`` changes nothing else.

The data is synthetic and made on the fly: each class is a fixed random image, each sample that
image plus noise drawn from the sample's index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.tasks.task import LossOutput, Task


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, image_size: int, patch: int, channels: int, dim: int) -> None:
        super().__init__()
        self.num_patches = (image_size // patch) ** 2
        self.proj = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class VisionTransformer(nn.Module):
    def __init__(self, image_size: int = 16, patch: int = 4, channels: int = 3, classes: int = 10,
                 dim: int = 32, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(image_size, patch, channels, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, dim))
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)
        self.head_dist = nn.Linear(dim, classes)  # DeiT's distillation head: used only to distil

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class SyntheticImages(torch.utils.data.Dataset):
    """``classes`` fixed random images; sample i is image ``i % classes`` plus noise from seed i."""

    def __init__(self, size: int, classes: int, image_size: int, seed: int, offset: int = 0) -> None:
        self.size, self.classes, self.offset = size, classes, offset
        generator = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(classes, 3, image_size, image_size, generator=generator)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index += self.offset
        noise = torch.randn(self.templates.shape[1:], generator=torch.Generator().manual_seed(index))
        label = index % self.classes
        return {"image": self.templates[label] + 0.8 * noise, "label": torch.tensor(label)}


class ImageClassification(Task):
    @dataclass
    class Options:
        image_size: int = 16
        patch: int = 4
        classes: int = 10
        dim: int = 32
        depth: int = 2
        heads: int = 4
        train_samples: int = 512
        val_samples: int = 64

    init_parameter_elementwise = True

    def build_model(self) -> nn.Module:
        o = self.options
        return VisionTransformer(o.image_size, o.patch, 3, o.classes, o.dim, o.depth, o.heads)

    def wrap_policy(self):
        return [Block]

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """timm's scheme: weights and tokens ~ N(0, 0.02), biases 0, norms 1."""
        if name.endswith("bias"):
            tensor.zero_()
        elif ".norm" in name or name.startswith("norm."):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)

    def train_dataset(self) -> SyntheticImages:
        o = self.options
        return SyntheticImages(o.train_samples, o.classes, o.image_size, self.seed)

    def val_dataset(self) -> SyntheticImages:
        o = self.options
        return SyntheticImages(o.val_samples, o.classes, o.image_size, self.seed, offset=o.train_samples)

    def loss(self, model: nn.Module, batch: dict) -> LossOutput:
        logits = model(batch["image"]).float()
        correct = (logits.argmax(-1) == batch["label"]).sum()
        return LossOutput(F.cross_entropy(logits, batch["label"], reduction="sum"), len(batch["label"]),
                          {"accuracy": (correct, len(batch["label"]))})

    def count(self, batch: dict) -> int:
        return len(batch["label"])

    def describe(self) -> str:
        o = self.options
        return (f"synthetic {o.image_size}x{o.image_size} images of {o.classes} classes "
                f"({o.train_samples} train)")
