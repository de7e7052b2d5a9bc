"""Optimizer parameter groups and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from shardtrain.config.schema import ModelConfig, TrainerConfig
from shardtrain.errors import ConfigError
from shardtrain.models.llama import Llama
from shardtrain.train.optim import (
    build_optimizer,
    build_scheduler,
    lr_factor,
    no_decay_names,
    optimizer_kind,
    schedule_cautions,
)


def test_no_weight_decay_on_norms_biases_embeddings():
    model = Llama(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2))
    skip = no_decay_names(model)
    assert "tok_embeddings.weight" in skip and "norm.weight" in skip
    assert "layers.0.attention_norm.weight" in skip
    assert "layers.0.attention.wq.weight" not in skip and "output.weight" not in skip
    groups = build_optimizer(model, TrainerConfig(weight_decay=0.1)).param_groups
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert id(model.tok_embeddings.weight) not in decayed and id(model.output.weight) in decayed
    tied = Llama(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, tie_embeddings=True))
    assert "tok_embeddings.weight" in no_decay_names(tied)  # the shared head weight is an embedding

    class HeadFirst(nn.Module):  # the head registered before the table it is tied to (found by review)
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 16, bias=False)
            self.embed = nn.Embedding(16, 8)
            self.head.weight = self.embed.weight

    head_first = HeadFirst()
    assert no_decay_names(head_first) == {"head.weight", "embed.weight"}
    (group,) = build_optimizer(head_first, TrainerConfig(weight_decay=0.1)).param_groups
    assert group["weight_decay"] == 0.0


@pytest.mark.parametrize("kernel", ["foreach", "auto"])
def test_the_optimizer_takes_every_setting(kernel):
    """Every reference loop builds its optimizer with build_optimizer too: the settings' wiring is
    checked here, against values no default has (found by review: betas or eps lost went unseen)."""
    model = Llama(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2))
    cfg = TrainerConfig(lr=7e-4, weight_decay=0.05, beta1=0.8, beta2=0.9, adam_eps=1e-7,
                        optimizer_kernel=kernel)
    optimizer = build_optimizer(model, cfg)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert sorted(g["weight_decay"] for g in optimizer.param_groups) == [0.0, 0.05]
    for group in optimizer.param_groups:
        assert (group["lr"], group["betas"], group["eps"]) == (7e-4, (0.8, 0.9), 1e-7)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))


def test_no_weight_decay_on_norms_and_biases_of_any_shape():
    """Found by review: only 1-D parameters counted as norms and biases, so a LayerNorm over (C, H, W)
    and the attention's 3-D bias_k were decayed towards zero."""
    model = nn.ModuleDict({"norm": nn.LayerNorm((4, 3, 3)), "group": nn.GroupNorm(2, 4),
                           "attention": nn.MultiheadAttention(8, 2, add_bias_kv=True),
                           "pos": nn.ParameterDict({"table": nn.Parameter(torch.zeros(16, 8))})})
    skip = no_decay_names(model)
    assert {"norm.weight", "norm.bias", "group.weight", "attention.bias_k", "attention.bias_v",
            "attention.in_proj_bias"} <= skip
    assert "attention.in_proj_weight" not in skip and "pos.table" not in skip  # a learnt table is decayed


def test_a_schedule_that_does_not_do_what_its_settings_say_is_said():
    """A warmup longer than the run (from the config review) and a decay of one step, which lowers no
    step's rate: step N trains at the value for N - 1 (from the training-step review)."""
    assert schedule_cautions(TrainerConfig(warmup_steps=12, max_steps=6, lr=3e-3)) == [
        "trainer.warmup_steps=12 > trainer.max_steps=6: the learning rate rises for the whole run and peaks "
        "at 0.0015, 50% of trainer.lr=0.003; lower trainer.warmup_steps"]
    short = TrainerConfig(warmup_steps=0, max_steps=100, decay_fraction=0.01, min_lr_ratio=0.1)
    assert schedule_cautions(short) == [
        "trainer.decay_fraction=0.01 of the 100 steps after warmup is a decay of at most one step, "
        "which lowers no step's rate (step N trains at the schedule's value for N - 1); raise "
        "trainer.decay_fraction"]
    assert lr_factor(99, 0, 100, 0.1, "linear", 0.01) == 1.0  # the last step's, undecayed
    for fine in (TrainerConfig(warmup_steps=0, max_steps=100, decay_fraction=0.02),
                 TrainerConfig(warmup_steps=0, max_steps=100, decay_fraction=0.01, min_lr_ratio=1.0),
                 TrainerConfig()):
        assert schedule_cautions(fine) == [], fine


def test_warmup_then_cosine_to_min_ratio():
    assert lr_factor(0, 10, 100, 0.1) == 0.1 and lr_factor(9, 10, 100, 0.1) == 1.0
    assert lr_factor(10, 10, 100, 0.1) == 1.0
    assert math.isclose(lr_factor(55, 10, 100, 0.1), 0.55)
    assert math.isclose(lr_factor(100, 10, 100, 0.1), 0.1) and lr_factor(500, 10, 100, 0.1) == 0.1


@pytest.mark.parametrize("decay", ["cosine", "linear", "sqrt"])
def test_warmup_stable_decay(decay):
    """The last decay_fraction of the steps after warmup decay (here 18 of 90: from step 82); the
    shapes meet at both ends and differ between (linear 0.55 halfway, cosine too, sqrt 0.4636)."""
    factor = lambda step: lr_factor(step, 10, 100, 0.1, decay, 0.2)  # noqa: E731
    assert factor(4) == 0.5 and factor(10) == factor(81) == 1.0
    assert factor(82) == 1.0 and factor(100) == pytest.approx(0.1) and factor(200) == pytest.approx(0.1)
    assert all(factor(s) >= factor(s + 1) for s in range(82, 100))
    halfway = {"cosine": 0.55, "linear": 0.55, "sqrt": 0.1 + 0.9 * (1 - math.sqrt(0.5))}[decay]
    assert factor(91) == pytest.approx(halfway)
    # decay_fraction 1.0 is the decay from the end of warmup, bit for bit the schedule before it existed
    def before(step: int, warmup: int, max_steps: int, min_ratio: float) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    for warmup, max_steps in ((10, 100), (0, 7), (30, 300), (5, 5), (9, 3)):
        assert all(lr_factor(s, warmup, max_steps, 0.1, "cosine", 1.0) == before(s, warmup, max_steps, 0.1)
                   for s in range(max_steps + 20)), (warmup, max_steps)
    seventy = lambda step: lr_factor(step, 0, 1000, 0.0, "linear", 0.07)  # noqa: E731
    assert seventy(930) == 1.0 and seventy(931) < 1.0  # 70 decay steps, not 71
    assert lr_factor(55, 10, 100, 0.1, "linear") == pytest.approx(0.55)
    # the trainer's settings reach the scheduler
    model = Llama(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2))
    cfg = TrainerConfig(lr=1.0, warmup_steps=10, max_steps=100, min_lr_ratio=0.1, lr_decay=decay,
                        decay_fraction=0.2)
    scheduler = build_scheduler(build_optimizer(model, cfg), cfg)
    rates = []
    for _ in range(100):
        rates.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([factor(step) for step in range(100)])


def test_kernels_as_asked_and_named_in_the_report():
    """auto and fused take torch's fused AdamW where it has one (the CPU has it), foreach by name;
    the start-up report's model line names which."""
    model = Llama(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2))
    kinds = {kernel: optimizer_kind(build_optimizer(model, TrainerConfig(optimizer_kernel=kernel)))
             for kernel in ("auto", "fused", "foreach")}
    assert kinds == {"auto": "AdamW (fused)", "fused": "AdamW (fused)", "foreach": "AdamW (foreach)"}
    assert optimizer_kind(torch.optim.SGD(model.parameters(), lr=0.1)) == "SGD"
    # Where torch has no fused kernel (it says so only at the first step): auto takes foreach, and
    # fused is refused in one line, both before any step.
    with torch.device("meta"):
        elsewhere = Llama(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2))
    auto = build_optimizer(elsewhere, TrainerConfig(optimizer_kernel="auto"))
    assert optimizer_kind(auto) == "AdamW (foreach)"
    with pytest.raises(ConfigError, match="fused AdamW steps floating-point parameters on cpu, cuda"):
        build_optimizer(elsewhere, TrainerConfig(optimizer_kernel="fused"))


def test_a_loaded_state_keeps_the_kernels_and_settings_built_now():
    """What a resume does around the optimizer's state load (Checkpointer.load): the kernels and the
    configured decay, betas and eps are the ones built now (found by review: a foreach checkpoint
    made a fused AdamW take the foreach path and fail, a new decay was ignored), while the rate and
    the running values some optimizers keep in their groups (Prodigy's d) stay the checkpoint's."""
    from shardtrain.checkpoint.checkpointer import built_group_settings, restore_built_settings

    model = torch.nn.Linear(2, 2)
    saved = torch.optim.AdamW(model.parameters(), lr=0.5, foreach=True, weight_decay=0.1)
    saved.param_groups[0]["d"] = 7.0  # a running value of the optimizer's own
    model(torch.randn(3, 2)).sum().backward()
    saved.step()
    built = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True, weight_decay=0.05, betas=(0.8, 0.9))
    built.param_groups[0]["d"] = 1.0
    settings = built_group_settings(built)
    built.load_state_dict(saved.state_dict())
    restore_built_settings(built, settings)
    group = built.param_groups[0]
    assert (group["fused"], group["foreach"]) == (True, None)
    assert (group["weight_decay"], group["betas"]) == (0.05, (0.8, 0.9))
    assert (group["lr"], group["d"]) == (0.5, 7.0)
    model(torch.randn(3, 2)).sum().backward()
    built.step()  # the fused kernel runs: the state's step count where it wants it


def test_a_save_before_the_first_update_leaves_the_optimizer_as_fresh():
    """Found by review: torch's get_state_dict creates an empty optimizer's state with a step at lr 0,
    which left AdamW's step count at 1 (in the live optimizer and the checkpoint): after skipped first
    steps and a save, the first real update took step 2's bias correction, 0.735 of itself. The
    saver puts the counts back to 0, and the first update is a fresh optimizer's."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from shardtrain.checkpoint.checkpointer import undo_creation_step

    torch.manual_seed(0)
    saved, fresh = nn.Linear(4, 3), nn.Linear(4, 3)
    fresh.load_state_dict(saved.state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, betas=(0.9, 0.95), foreach=True)
                  for m in (saved, fresh)]
    _, state = get_state_dict(saved, optimizers[0])
    undo_creation_step(optimizers[0], state)
    assert [float(entry["step"]) for entry in state["state"].values()] == [0.0, 0.0]
    batch = torch.randn(2, 4)
    for model, optimizer in zip((saved, fresh), optimizers, strict=True):
        model(batch).square().sum().backward()
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), fresh.parameters(), strict=True))


def test_settings_an_optimizer_factory_does_not_use_are_named():
    """Found by review: with optimizer_factory, trainer.lr, the AdamW settings and the kernel were
    accepted and unused without a word; those given away from their defaults are named at start-up."""
    from shardtrain.diagnostics.rails import settings_a_factory_ignores

    assert settings_a_factory_ignores(TrainerConfig()) is None
    said = settings_a_factory_ignores(TrainerConfig(lr=1e-4, optimizer_kernel="fused"))
    assert said.startswith("trainer.lr=0.0001, trainer.optimizer_kernel=fused: the optimizer_factory's "
                           "optimizer is used, with its own settings"), said
