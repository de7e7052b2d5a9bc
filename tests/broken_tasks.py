"""Tasks that break the contract, for tests/test_tasks.py (imported by the spawned workers)."""

from __future__ import annotations

import dataclasses
import enum
import math
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from vit import ImageClassification, SyntheticImages

from shardtrain.config.schema import ModelConfig
from shardtrain.data.tokenizer import ByteTokenizer
from shardtrain.models.registry import build_model
from shardtrain.tasks.language_model import LanguageModelTask
from shardtrain.tasks.task import LossOutput, Task


class NoLoss(Task):
    def build_model(self):
        return torch.nn.Linear(2, 2)

    def train_dataset(self):
        return [torch.zeros(2)] * 8


class NeedsArgument(ImageClassification):
    """Settings taken by __init__ without an Options dataclass: nothing can pass them (found by
    review: a TypeError's traceback on every worker)."""

    Options = None

    def __init__(self, data_dir):
        super().__init__()
        self.data_dir = data_dir


class FlopsNone(ImageClassification):
    """flops overridden, returning None (found by review: the rank's step counted no FLOPs, MFU
    understated without a word)."""

    def flops(self, batch):
        return None


class BuildReturnsNone(ImageClassification):
    """Builds its model but forgets to return it."""

    def build_model(self):
        super().build_model()


class BuildsOnce(ImageClassification):
    """Returns one model built earlier from every build_model call (found by a trial: the FLOP
    counter's call turned the sharded model's parameters into fake tensors)."""

    def build_model(self):
        if not hasattr(self, "built"):
            self.built = super().build_model()
        return self.built


class ReusesPatchEmbed(ImageClassification):
    """A new model each call, with one patch embedding kept and put into every one (found by
    review: as shared as a whole model returned twice)."""

    def build_model(self):
        model = super().build_model()
        if not hasattr(self, "kept"):
            self.kept = model.patch_embed
        model.patch_embed = self.kept
        return model


class CountsNothing(ImageClassification):
    """Every micro-batch counts 0 (found by a trial: a run shorter than max_skipped_steps ended as
    finished, every update skipped, its checkpoint saved)."""

    def loss(self, model, batch):
        return LossOutput(model(batch["image"]).float().sum() * 0, 0)

    def count(self, batch):
        return 0


class MisspeltWrap(ImageClassification):
    """Its own wrap policy names a class its model lacks (found by a trial: blamed on
    strategy.wrap_policy, which the run did not set)."""

    def wrap_policy(self):
        return ["Blok"]


class MovesModel(ImageClassification):
    """Moves its model to a device in build_model, as a hand-written loop does (found by review:
    torch's "Cannot copy out of meta tensor ... use to_empty()", advice that is not the fix)."""

    def build_model(self):
        return super().build_model().to("cpu")


class BuiltInBf16(ImageClassification):
    """Returns its model in bf16, as from_pretrained(torch_dtype=torch.bfloat16) does (found by
    review: it trained with bf16 weights and Adam state under a precision promising fp32 ones)."""

    def build_model(self):
        return super().build_model().to(torch.bfloat16)


class VectorLoss(ImageClassification):
    """Returns the per-sample losses instead of their sum."""

    def loss(self, model, batch):
        logits = model(batch["image"]).float()
        return LossOutput(F.cross_entropy(logits, batch["label"], reduction="none"), len(batch["label"]))


class ItemLoss(ImageClassification):
    """Returns the loss as a Python number (.item()), which the FLOP counter cannot run either."""

    def loss(self, model, batch):
        logits = model(batch["image"]).float()
        summed = F.cross_entropy(logits, batch["label"], reduction="sum")
        return LossOutput(summed.item(), len(batch["label"]))


class ItemMetric(ImageClassification):
    """A valid loss with a metric read as a Python number: it trains, and the FLOP counter (fake
    tensors have no values) cannot run it. Its position table is frozen."""

    def build_model(self):
        model = super().build_model()
        model.pos_embed.requires_grad_(False)
        return model

    def loss(self, model, batch):
        logits = model(batch["image"]).float()
        hits = (logits.argmax(-1) == batch["label"]).sum().item()
        return LossOutput(F.cross_entropy(logits, batch["label"], reduction="sum"), len(batch["label"]),
                          metrics={"hits": hits})


class MetricNamedLoss(ImageClassification):
    """A metric named like a field of the metrics record (it would overwrite the logged loss)."""

    def loss(self, model, batch):
        out = super().loss(model, batch)
        return LossOutput(out.loss, out.count, {**out.metrics, "loss": out.loss.detach()})


class ValidationMetricNamedLoss(ImageClassification):
    """A metric of evaluation only, named so that its val_<name> is the validation loss (found by
    review: it replaced val_loss, which keep_best and early stopping judge)."""

    def loss(self, model, batch):
        out = super().loss(model, batch)
        extra = {} if model.training else {"loss": out.loss.detach()}
        return LossOutput(out.loss, out.count, {**out.metrics, **extra})


class TrainingMetricNamedLikeValidation(ImageClassification):
    """A training metric val_acc beside an evaluation-only metric acc: both would be val_acc in the
    record (found by review: the evaluation's replaced the training's without a word)."""

    def loss(self, model, batch):
        out = super().loss(model, batch)
        named = {"val_acc": out.loss.detach()} if model.training else {"acc": out.loss.detach()}
        return LossOutput(out.loss, out.count, named)


class MissingKey(SyntheticImages):
    def __getitem__(self, index):
        item = super().__getitem__(index)
        return {"image": item["image"]} if index % 2 else item


class MixedItems(ImageClassification):
    """Every odd item of the training data lacks its label."""

    def train_dataset(self):
        o = self.options
        return MissingKey(o.train_samples, o.classes, o.image_size, self.seed)


class ImageEncoder(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, dim, kernel_size=4, stride=4)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.conv(images).mean(dim=(2, 3))


class TextBlock(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Captioner(torch.nn.Module):
    """Text with an image for some samples: the image's features are added to the first position."""

    def __init__(self, dim: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.encoder = ImageEncoder(dim)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(TextBlock(dim) for _ in range(2))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, images: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        # The supported pattern: the encoder runs on every rank, on no images at all if this batch
        # has none, so every rank all-gathers its parameters (skipping it on one rank would leave
        # the others waiting in that all-gather: pytorch/pytorch#152964).
        features = self.encoder(images)
        x = x.index_add(0, rows, torch.nn.functional.pad(features[:, None], (0, 0, 0, x.shape[1] - 1)))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class SkippingCaptioner(Captioner):
    """Runs the image encoder only where a micro-batch has images: its parameters, in the root unit
    (not a unit of their own), get gradients on some ranks only (strategy.reduce_unused_params)."""

    def forward(self, tokens: torch.Tensor, images: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if len(rows):
            features = self.encoder(images)
            x = x.index_add(0, rows, torch.nn.functional.pad(features[:, None], (0, 0, 0, x.shape[1] - 1)))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class SomeImages(torch.utils.data.Dataset):
    """One sample in ``every`` has an image; every item has the same keys (``has_image`` says which)."""

    def __init__(self, every: int = 4) -> None:
        self.every = every

    def __len__(self) -> int:
        return 128

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(index)
        return {"tokens": torch.randint(0, 32, (6,), generator=generator),
                "image": torch.randn(3, 8, 8, generator=generator),
                "has_image": torch.tensor(index % self.every == 0)}


class SometimesImages(Task):
    """Batches on which some ranks have images and others none (tests/test_tasks.py)."""

    def build_model(self):
        return Captioner()

    def wrap_policy(self):
        return [ImageEncoder, TextBlock]

    def train_dataset(self):
        return SomeImages()

    def collate(self, items):
        has = torch.stack([item["has_image"] for item in items])
        return {"tokens": torch.stack([item["tokens"] for item in items]),
                "images": torch.stack([item["image"] for item in items])[has],  # possibly none
                "rows": has.nonzero().flatten()}

    def loss(self, model, batch):
        logits = model(batch["tokens"][:, :-1], batch["images"], batch["rows"]).float()
        targets = batch["tokens"][:, 1:]
        return LossOutput(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"),
                          targets.numel())


class CaptionerWithMethod(Captioner):
    def caption(self, tokens: torch.Tensor, images: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.forward(tokens, images, rows)


class CallsAMethod(SometimesImages):
    """Its loss calls a method of the model (CLIP's encode_image, a VAE's decode), not the model: the
    root's own parameters (embedding, head) are gathered for it because it is named."""

    forward_methods = ("caption",)

    def build_model(self):
        return CaptionerWithMethod()

    def loss(self, model, batch):
        logits = model.caption(batch["tokens"][:, :-1], batch["images"], batch["rows"]).float()
        targets = batch["tokens"][:, 1:]
        return LossOutput(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"),
                          targets.numel())


class SkipsImages(SometimesImages):
    """Skips the image encoder where a micro-batch has no images: ranks use different parameters in
    a step. One sample in two has an image, so every global batch has some (the reference, one
    process, then gives every parameter a gradient each step, as the sharded run's reduction does)."""

    def build_model(self):
        return SkippingCaptioner()

    def wrap_policy(self):
        return [TextBlock]

    def train_dataset(self):
        return SomeImages(every=2)


class RankMetrics(ImageClassification):
    """Names a metric after its rank: the ranks' metrics differ."""

    def loss(self, model, batch):
        out = super().loss(model, batch)
        return LossOutput(out.loss, out.count, {f"rank{torch.distributed.get_rank()}": out.count})


class RankData(ImageClassification):
    """Rank 1 has one training image fewer, as a node whose copy of the data differs would."""

    def train_dataset(self) -> SyntheticImages:
        o = self.options
        fewer = torch.distributed.get_rank()
        return SyntheticImages(o.train_samples - fewer, o.classes, o.image_size, self.seed)


class RankDataTooFew(ImageClassification):
    """Rank 1's copy of the data holds fewer images than one global batch: its batches refuse it
    while rank 0's go on (found by review: rank 0 then waited in the next collective until the
    process group's timeout)."""

    def train_dataset(self) -> SyntheticImages:
        o = self.options
        count = 4 if torch.distributed.get_rank() == 1 else o.train_samples
        return SyntheticImages(count, o.classes, o.image_size, self.seed)


class OwnBind(ImageClassification):
    """Overrides bind() without calling super().bind() (found by review: Task.seed then read 0, so
    trainer.seed had no effect on the task's draws)."""

    datasets_made = 0  # and start-up makes its training dataset once (the FLOP count reused it)

    def bind(self, cfg):
        self.bound = True

    def train_dataset(self):
        self.datasets_made += 1
        return super().train_dataset()


class RankDataFails(ImageClassification):
    """Rank 1's data code raises a plain ValueError (a file only one node lacks, read by the user's
    own code): every rank stops at once, rank 1 named, not rank 0 left waiting until the timeout."""

    def train_dataset(self) -> SyntheticImages:
        if torch.distributed.get_rank() == 1:
            raise ValueError("shard 7 of the images is missing on this node")
        return super().train_dataset()


class ChangingMetrics(ImageClassification):
    """Rank 1 returns one more metric from its second step on: the names change on one rank only."""

    calls = 0

    def loss(self, model, batch):
        out = super().loss(model, batch)
        self.calls += 1  # 1: the FLOP count at start-up, 2: the first step
        if torch.distributed.get_rank() == 1 and self.calls > 2:
            return LossOutput(out.loss, out.count, {**out.metrics, "late": out.count})
        return out


class DerivedLanguageTask(LanguageModelTask):
    """The built-in language-model task under another name: its settings (micro_batch_size=auto,
    trainer.loss_chunk_tokens) apply."""


class OwnModelLanguageTask(LanguageModelTask):
    """A language-model task that builds a model of its own: the planner's formulas do not know it."""

    def build_model(self) -> torch.nn.Module:
        return super().build_model()


class OwnLossLanguageTask(LanguageModelTask):
    """A language-model task with a loss of its own: trainer.loss_chunk_tokens does not reach it."""

    def loss(self, model, batch):
        return super().loss(model, batch)


class KeywordInit(ImageClassification):
    """An ``__init__`` of its own taking the options as keywords (the style ``MyTask(depth=4)``
    invites): built from the config with one keyword per option."""

    def __init__(self, depth: int = 2, **overrides) -> None:
        super().__init__(depth=depth, **overrides)


class BareInit(ImageClassification):
    """An ``__init__`` that takes no options: it cannot be built from the config."""

    def __init__(self) -> None:
        super().__init__()


class DroppedOptions(ImageClassification):
    """Takes the options as keywords but does not pass them on: the task would train other options
    than the config records."""

    def __init__(self, depth: int = 2, **overrides) -> None:
        super().__init__()


class SwitchedImages(ImageClassification):
    """A boolean option (``task.augment=2`` was read as true, as OmegaConf reads any integer)."""

    @dataclasses.dataclass
    class Options(ImageClassification.Options):
        augment: bool = False


class NaNOption(ImageClassification):
    """An option whose default is NaN, and a helper of its own named ``model_factory`` (not a model
    given in code, as LanguageModelTask(model=...) records under that name)."""

    @dataclasses.dataclass
    class Options(ImageClassification.Options):
        clip: float = math.nan

    def model_factory(self):
        return self.build_model


class NextByteText(Task):
    """A task of its own (not the language model's) whose model maps byte ids to next-byte logits,
    and which says so with text_tokenizer(): training samples text from it."""

    count_unit = "tokens"

    def build_model(self):
        return build_model(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64))

    def train_dataset(self):
        text = b"def sample(): return 'text'\n" * 8
        return [torch.tensor(list(text[i:i + 17])) for i in range(0, 64, 4)]

    def loss(self, model, batch):
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum")
        return LossOutput(loss, batch[:, 1:].numel())

    def text_tokenizer(self):
        return ByteTokenizer()


class Activation(enum.Enum):
    relu = "relu"
    gelu = "gelu"


class TypedOptions(ImageClassification):
    """Options typed as an Enum, a path and a Literal (found by a user trial: the Enum and the path
    trained, then every save failed to record them; the Literal made the task unusable from the
    command line)."""

    @dataclasses.dataclass
    class Options(ImageClassification.Options):
        activation: Activation = Activation.relu
        notes: Path = Path("notes")
        pooling: Literal["mean", "first"] = "mean"
        width: int | None = None
        sizes: tuple[int, ...] = (1, 2)
        strict: Literal[True, False] = False


class LateParameter(ImageClassification):
    """Creates a module inside loss, after the model was sharded (found by a user trial: the error
    told a task author, who calls no fully_shard, to put fully_shard on the root)."""

    def loss(self, model, batch):
        if not hasattr(model, "late_head"):
            model.late_head = torch.nn.Linear(self.options.classes, self.options.classes)
        logits = model.late_head(model(batch["image"]).float())
        return LossOutput(F.cross_entropy(logits, batch["label"], reduction="sum"), len(batch["label"]))


@dataclasses.dataclass
class Betas:
    betas: tuple[float, float] = (0.9, 0.95)


class NestedOptions(ImageClassification):
    """Options whose values read back otherwise than held (a tuple as a list in a nested dataclass or
    an Optional, a NaN): the same values as recorded."""

    @dataclasses.dataclass
    class Options(ImageClassification.Options):
        inner: Betas = dataclasses.field(default_factory=Betas)
        crop: tuple[int, int] | None = (8, 8)
        floor: float = math.nan


class ReservedOptionName(ImageClassification):
    """An option named like the task section's recorded key."""

    @dataclasses.dataclass
    class Options(ImageClassification.Options):
        model_factory: str = "mine"
