"""Code that runs inside spawned ranks for the diagnostics and safety-rail tests."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import torch
from equivalence import case_config, small_corpus
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from shardtrain.distributed.parallelize import reshard_all
from shardtrain.distributed.qlora import full_value
from shardtrain.errors import ShardtrainError
from shardtrain.tasks.language_model import LanguageModelTask
from shardtrain.train.loop import Trainer


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Linear(24, 24)

    def forward(self, x):
        return x + torch.relu(self.ff(x))


class SharedBlockModel(nn.Module):
    """Registers the same block under two parents: the double-memory trap."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 24)
        self.encoder = nn.ModuleList([Block()])
        self.decoder = nn.ModuleList([self.encoder[0]])
        self.out = nn.Linear(24, 256)

    def forward(self, tokens):
        return self.out(self.decoder[0](self.encoder[0](self.emb(tokens))))


class TiedAcrossUnitsModel(nn.Module):
    """The head tied to the embedding, each in a unit of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 24)
        self.blocks = nn.ModuleList([Block()])
        self.out = nn.Linear(24, 256, bias=False)
        self.out.weight = self.emb.weight

    def extra_shard_groups(self) -> list[list[nn.Module]]:
        return [[self.emb], [self.out]]

    def forward(self, tokens):
        return self.out(self.blocks[0](self.emb(tokens)))


class BypassModel(nn.Module):
    """Calls a sharded block's forward directly, skipping FSDP's hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 24)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(24, 256)

    def forward(self, tokens):
        h = self.blocks[0](self.emb(tokens))
        return self.out(self.blocks[1].forward(h))


def expect_error(out: str, name: str, model, run_dir: str | None = None, checkpoints: bool = False,
                 **create_kwargs) -> None:
    """Build and train one step; record the ShardtrainError message every rank raised."""
    world = int(os.environ["WORLD_SIZE"])
    cfg = case_config(world, run_dir or f"{out}/{name}")
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, enabled=checkpoints)
    try:
        task = LanguageModelTask(model=model, wrap_policy=[Block], corpus=small_corpus())
        trainer = Trainer.create(cfg, task=task, **create_kwargs)
        trainer.run_step()
    except ShardtrainError as exc:
        Path(out, f"{name}-rank{os.environ['RANK']}.txt").write_text(f"{type(exc).__name__}: {exc}")
        return
    raise AssertionError(f"{name}: no error raised")


def rails(out: str) -> None:
    expect_error(out, "shared", SharedBlockModel)
    expect_error(out, "bypass", BypassModel)
    expect_error(out, "tied", TiedAcrossUnitsModel)

    def stale_optimizer(sharded_model):
        unsharded = BypassModel()  # parameters from before sharding
        return torch.optim.AdamW(unsharded.parameters(), lr=1e-3)

    expect_error(out, "optimizer", BypassModel, optimizer_factory=stale_optimizer)

    def no_return(sharded_model):  # found by review: 'NoneType' object has no attribute ...
        torch.optim.AdamW(sharded_model.parameters(), lr=1e-3)

    expect_error(out, "no_return", BypassModel, optimizer_factory=no_return)
    # an optimizer where its factory belongs (found by a user trial: "'AdamW' object is not callable")
    expect_error(out, "instance", BypassModel,
                 optimizer_factory=torch.optim.AdamW(BypassModel().parameters(), lr=1e-3))
    # each rank its own run.dir, as node-local disks give it: stopped before any model exists
    expect_error(out, "unshared", BypassModel, run_dir=f"{out}/unshared-rank{os.environ['RANK']}",
                 checkpoints=True)
    assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)  # the cores, split
    # A wrap policy naming a class inside another's blocks (an attention beside its block, as some
    # Hugging Face families' _no_split_modules do), and the embedding of an extra group: the
    # outermost blocks are the units, each module sharded once (found by review: "overlapping
    # meshes" and "fully_shard has already been applied" from inside torch).
    cfg = case_config(int(os.environ["WORLD_SIZE"]), f"{out}/nested")
    cfg.strategy = dataclasses.replace(cfg.strategy, embedding_lookup="gather")
    task = LanguageModelTask(wrap_policy=["TransformerBlock", "Attention", "Embedding"],
                             corpus=small_corpus())
    trainer = Trainer.create(cfg, task=task)
    units = [*(f"layers.{i}" for i in range(len(trainer.model.layers))), "tok_embeddings", "norm+output",
             "<root>"]
    assert trainer.built.report.units == units, trainer.built.report.units
    assert math.isfinite(trainer.run_step().loss)
    # A factory's empty first group, as PyTorch allows (the no-decay-first idiom on a model whose
    # names match none): it trains (found by review: IndexError in the step's skip decision).
    cfg = case_config(int(os.environ["WORLD_SIZE"]), f"{out}/empty_group")

    def no_decay_first(sharded_model):
        no_decay = [p for name, p in sharded_model.named_parameters() if name.endswith(".bias")]
        decay = [p for name, p in sharded_model.named_parameters() if not name.endswith(".bias")]
        return torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay}], lr=1e-3,
                                 fused=True)

    trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=small_corpus()),
                             optimizer_factory=no_decay_first)
    assert not trainer.built.optimizer.param_groups[0]["params"] and math.isfinite(trainer.run_step().loss)


def nan_step_is_skipped(out: str) -> None:
    """A NaN on one rank at step 3: the update is skipped everywhere, state left untouched. Steps 1
    and 2 are traced by the profiler (diagnostics.profile_at): every rank writes its trace."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    cfg = case_config(world, f"{out}/nan")
    cfg.diagnostics = dataclasses.replace(cfg.diagnostics, profile_at=1, profile_steps=2)
    cfg.trainer = dataclasses.replace(cfg.trainer, ema_decay=0.75)  # the weights' average: below
    trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=small_corpus()))
    expected = trainer.full_weights()  # the average starts from the weights training starts from
    # FULL_SHARD: after the forward only the last block stays gathered of the blocks (backward needs
    # it at once); the others went back to their shards (DTensors). Each block prefetched the next
    # unit's all-gather (the next block's, the last block the head's), as FSDP's trace labels show.
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as trace:
        trainer.model(torch.zeros(1, 8, dtype=torch.long))
    layers = trainer.model.layers
    kept = [i for i, block in enumerate(layers) if not isinstance(next(block.parameters()), DTensor)]
    reshard_all(trainer.model)
    assert kept == [len(layers) - 1], kept
    prefetched = {e.name.split(" for ")[1] for e in trace.events()
                  if e.name.startswith("FSDP::forward_prefetch")}
    assert prefetched == {*(f"layers.{i}" for i in range(1, len(layers))), "norm, output"}, prefetched
    for _ in range(2):
        trainer.run_step()
        weights = trainer.full_weights()
        expected = {name: 0.75 * expected[name] + 0.25 * weights[name] for name in expected}
    # found by review: writing the trace (hundreds of MB at scale) was timed as the step's
    assert trainer.watchdog.phase == "writing the profiler trace", trainer.watchdog.phase
    assert trainer.watchdog.limits()[1:] == (cfg.checkpoint.save_timeout_s, "checkpoint.save_timeout_s")
    average = {name: full_value(value).float() for name, value in trainer.average.average.items()}
    assert all(torch.allclose(average[name], expected[name], rtol=1e-6, atol=1e-7) for name in expected)
    # Evaluation runs the model on the average swapped in, then the weights are back bit for bit.
    with trainer.average.swapped_in():
        inside = trainer.full_weights()
    assert all(torch.equal(inside[name], value) for name, value in average.items())
    assert all(torch.equal(value, weights[name]) for name, value in trainer.full_weights().items())
    record = trainer.validate()
    assert record["ema_val_loss"] != record["val_loss"] and trainer.result.average_val_losses == [
        (trainer.step, record["ema_val_loss"])], record
    assert all(torch.equal(value, weights[name]) for name, value in trainer.full_weights().items())
    trace = json.loads(Path(out, "nan", "profiles", "steps-1-2", f"rank{rank}.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"aten::mm", "Optimizer.step#AdamW.step"} <= names, sorted(n for n in names if n)[:40]
    before = trainer.full_weights()
    optim_before = {k: v.clone() for k, v in trainer.built.optimizer.state_dict()["state"][0].items()}
    schedule_before = (trainer.built.scheduler.last_epoch, trainer.built.scheduler.get_last_lr())
    logged_count = trainer.interval_count
    os.environ["SHARDTRAIN_FAULT"] = "loss:1:3:nan"
    stats = trainer.run_step()
    del os.environ["SHARDTRAIN_FAULT"]
    # the learning-rate schedule stays where it was too (docs/diagnostics.md), and the skipped
    # step's loss is left out of the logging interval's mean
    assert (trainer.built.scheduler.last_epoch, trainer.built.scheduler.get_last_lr()) == schedule_before
    assert trainer.interval_count == logged_count
    after = trainer.full_weights()
    optim_after = trainer.built.optimizer.state_dict()["state"][0]
    assert stats.skipped and trainer.result.skipped_steps == 1
    assert all(torch.equal(before[k], after[k]) for k in before)
    # a skipped step leaves the average where it was too
    assert all(torch.equal(full_value(value).float(), average[name])
               for name, value in trainer.average.average.items())
    for key, value in optim_before.items():
        local = optim_after[key]
        local = local.to_local() if hasattr(local, "to_local") else local
        value = value.to_local() if hasattr(value, "to_local") else value
        assert torch.equal(value, local), key
    assert not trainer.run_step().skipped  # and training goes on


STRATEGY_CASES = {
    1: [("FULL_SHARD", {}), ("NO_SHARD", {})],
    2: [("FULL_SHARD", {}), ("SHARD_GRAD_OP", {}), ("NO_SHARD", {}), ("HYBRID_SHARD", {}),
        ("FULL_SHARD", {"precision": "bf16-pure"})],
    4: [("FULL_SHARD", {}), ("SHARD_GRAD_OP", {}), ("NO_SHARD", {}),
        ("HYBRID_SHARD", {"shard_group_size": 2}), ("HYBRID_SHARD_ZERO2", {"shard_group_size": 2})],
}


def measured_state(out: str) -> None:
    """Per-rank state bytes as the diagnostics measure them, for every strategy at this size."""
    world = int(os.environ["WORLD_SIZE"])
    results = []
    for strategy, extra in STRATEGY_CASES[world]:
        cfg = case_config(world, f"{out}/m{world}-{strategy}", strategy=strategy, **extra)
        cfg.diagnostics = dataclasses.replace(cfg.diagnostics, enabled=True, steps=1)
        trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=small_corpus()))
        trainer.run_step()
        if trainer.env.is_main:  # rank 0 logs every rank's table to metrics.jsonl after step 1
            records = [json.loads(line) for line in Path(cfg.run.dir, "metrics.jsonl").open()]
            ranks = [r for r in records if r["kind"] == "memory_ranks"][-1]["ranks"]
            results.append({"strategy": strategy, "extra": extra,
                            "mesh": trainer.built.plan.mesh_shape, "ranks": ranks})
    if int(os.environ["RANK"]) == 0:
        torch.save(results, Path(out, f"measured{world}.pt"))
