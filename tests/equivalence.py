"""Sharded training vs a single-process, unsharded reference written by hand with plain PyTorch.

``run_cases`` runs inside every spawned rank: it trains each case with shardtrain and rank 0 saves
losses, grad norms and the gathered full weights. ``reference_run`` is the hand-written loop the
cases are compared against: one process, no FSDP, the mean loss over the whole global batch,
``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from shardtrain.config.schema import Config, DataConfig
from shardtrain.data.batches import GlobalOrder
from shardtrain.data.corpus import Corpus, load_corpus, windows_of
from shardtrain.distributed.sharded_model import init_full_parameter
from shardtrain.models.llama import Llama
from shardtrain.tasks.language_model import LanguageModelTask
from shardtrain.train.optim import build_optimizer, build_scheduler

GLOBAL_BATCH = 8
STEPS = 5


def small_corpus() -> Corpus:
    return load_corpus(DataConfig(max_bytes=400_000, val_percent=30.0))


def case_config(world_size: int, run_dir: str, strategy: str = "FULL_SHARD",
                precision: str = "fp32", ac: str = "none", accum: int = 1,
                tied: bool = False, compile: bool = False, model: dict | None = None,
                **strategy_extra) -> Config:
    """``model``: sizes that replace the tiny model's (tensor parallelism needs even splits)."""
    cfg = Config()
    sizes = dict(dim=36, n_layers=3, n_heads=6, n_kv_heads=2, ffn_hidden_dim=97, max_seq_len=64)
    cfg.model = dataclasses.replace(cfg.model, tie_embeddings=tied, **(sizes | (model or {})))
    cfg.strategy = dataclasses.replace(
        cfg.strategy, sharding_strategy=strategy, mixed_precision=precision,
        activation_checkpointing=ac, compile=compile, **strategy_extra,
    )
    cfg.trainer = dataclasses.replace(
        cfg.trainer, max_steps=STEPS,
        # A tensor-parallel group is one data-parallel rank.
        micro_batch_size=GLOBAL_BATCH // (world_size // cfg.strategy.tensor_parallel * accum),
        grad_accum_steps=accum, seq_len=32, lr=3e-3, warmup_steps=2, grad_clip_norm=1.0,
        eval_every=0, eval_samples=8, sample_tokens=0, progress_bar=False, log_every=100,
    )
    cfg.run = dataclasses.replace(cfg.run, dir=run_dir, trackers=[])
    # The token stream cut every seq_len tokens, whatever the data (fine-tuning records would get
    # windows of whole records: tests/test_finetune.py's are longer than its 32-token windows)
    cfg.data = dataclasses.replace(cfg.data, packing="stream")
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, enabled=False)
    return cfg


def run_cases(cases: dict[str, dict], out_dir: str, prepared: str | None = None) -> None:
    """Inside each rank: train every case, rank 0 saves what the test compares (on the small corpus,
    or on the ``prepared`` dataset)."""
    from shardtrain.train.loop import Trainer

    corpus = small_corpus() if prepared is None else load_corpus(
        DataConfig(source="prepared", paths=[prepared]))
    world_size = int(__import__("os").environ["WORLD_SIZE"])
    for name, case in cases.items():
        cfg = case_config(world_size, str(Path(out_dir, name)), **case)
        breaks_before = sum(counters["graph_break"].values())
        graphs_before = counters["stats"]["unique_graphs"]
        trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=corpus))
        result = trainer.fit()
        weights = trainer.full_weights()
        if trainer.env.is_main:
            torch.save({"losses": result.losses, "grad_norms": result.grad_norms,
                        "weights": weights, "val": result.val_losses[-1][1],
                        "graph_breaks": sum(counters["graph_break"].values()) - breaks_before,
                        # That compilation happened: the case's blocks wrapped, and dynamo traced.
                        "compiled_modules": sum(getattr(m, "_compiled_call_impl", None) is not None
                                                for m in trainer.model.modules()),
                        "graphs": counters["stats"]["unique_graphs"] - graphs_before},
                       Path(out_dir, f"{name}.pt"))


def reference_run(tied: bool = False, train_tokens=None, model: dict | None = None) -> dict:
    """One process, no sharding: the ground truth (on ``train_tokens``, default the small corpus;
    ``model``: as in ``case_config``)."""
    cfg = case_config(1, "unused", tied=tied, model=model)
    tokens = small_corpus().train if train_tokens is None else train_tokens
    torch.manual_seed(0)
    model = Llama(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            init_full_parameter(model, name, p, cfg.trainer.seed)
    losses, norms = hand_written_loop(model, cfg, tokens, model)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "weights": weights}


def hand_written_loop(model, cfg: Config, tokens, logits_of,
                      extra_loss_of=None) -> tuple[list[float], list[float]]:
    """STEPS steps of AdamW with global-norm clipping on the whole global batch of ``tokens``'
    windows, in the global order; ``logits_of(x)`` runs the model; ``extra_loss_of(x)``, where given,
    is added to the mean cross-entropy. Returns losses and grad norms."""
    optimizer = build_optimizer(model, cfg.trainer)
    scheduler = build_scheduler(optimizer, cfg.trainer)
    # data.packing's windows, as the trainer makes them (whole records for fine-tuning data)
    windows = windows_of(tokens, cfg.trainer.seq_len, "data", False, cfg.data.packing)
    order = GlobalOrder(windows.num_samples, cfg.trainer.seed)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = windows.batch(order.take(step * GLOBAL_BATCH, GLOBAL_BATCH))[:2]
        loss = F.cross_entropy(logits_of(x).flatten(0, 1), y.flatten())
        if extra_loss_of is not None:
            loss = loss + extra_loss_of(x)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses, norms


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def max_errors(result: dict, ref: dict) -> dict[str, float]:
    """Largest relative errors: per-step loss, per-step grad norm, per-tensor weight norm."""
    assert result["weights"].keys() == ref["weights"].keys()
    return {
        "loss": max(rel(a, b) for a, b in zip(result["losses"], ref["losses"], strict=True)),
        "grad_norm": max(rel(a, b) for a, b in zip(result["grad_norms"], ref["grad_norms"], strict=True)),
        "weights": max(
            ((result["weights"][n] - w).norm() / w.norm()).item() for n, w in ref["weights"].items()
        ),
    }
