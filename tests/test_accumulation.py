"""Gradient accumulation: sharded (reduce-scatter every micro-batch) or unsharded (reduce once).

Both modes' losses, grad norms and weights are compared with the one-process reference in
tests/test_equivalence.py (FULL_SHARD at 2 ranks, HYBRID_SHARD 2 x 2 at 4 ranks); here the
communication each mode does is counted with the profiler.
"""

from __future__ import annotations

import pytest
import torch
from accumulation_workers import ACCUM, count_collectives
from distributed import run_on_ranks

from shardtrain.config.loader import load_config
from shardtrain.config.plan import resolve_plan
from shardtrain.config.schema import StrategyConfig
from shardtrain.diagnostics.planner import estimate
from shardtrain.models.registry import build_model


@pytest.mark.parametrize(
    ("strategy", "world", "group", "expected"),
    [("FULL_SHARD", 4, 0, "sharded"), ("SHARD_GRAD_OP", 2, 0, "sharded"),
     ("HYBRID_SHARD", 4, 2, "sharded"), ("NO_SHARD", 4, 0, "unsharded"), ("FULL_SHARD", 1, 0, "unsharded")],
)
def test_auto_accumulates_sharded_gradients_when_there_is_a_shard_group(strategy, world, group, expected):
    plan = resolve_plan(StrategyConfig(sharding_strategy=strategy, shard_group_size=group), world, world)
    assert plan.grad_accumulation == expected
    assert f"grad_accumulation={expected}" in plan.describe()


def test_collectives_per_step(tmp_path):
    run_on_ranks(count_collectives, 4, str(tmp_path), tmp_path=tmp_path)
    counts = torch.load(tmp_path / "collectives.pt")
    for strategy in ("FULL_SHARD", "HYBRID_SHARD"):
        sharded, unsharded = counts[strategy, "sharded"], counts[strategy, "unsharded"]
        # Every micro-batch's backward reduce-scatters in sharded mode, only the last in unsharded.
        assert unsharded["reduce_scatter"] > 0, counts
        assert sharded["reduce_scatter"] == ACCUM * unsharded["reduce_scatter"], counts
        # All-reduces (our own per-step ones, and HSDP's across replicas) do not grow with the
        # micro-batches in either mode: replicas are all-reduced on the last micro-batch only.
        assert sharded["all_reduce"] == unsharded["all_reduce"], counts
    hybrid, full = counts["HYBRID_SHARD", "sharded"], counts["FULL_SHARD", "sharded"]
    assert hybrid["all_reduce"] > full["all_reduce"]  # the replicas' gradient all-reduce


def test_planner_counts_unsharded_accumulated_gradients():
    cfg = load_config(["trainer.grad_accum_steps=2"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    total = sum(p.numel() for p in model.parameters())
    sharded = estimate(cfg, model, "FULL_SHARD", 8, 8)
    cfg.strategy.grad_accumulation = "unsharded"
    unsharded = estimate(cfg, model, "FULL_SHARD", 8, 8)
    assert unsharded.accumulation == total * 4 and sharded.accumulation == 0  # fp32, every parameter
    # Through the last micro-batch's backward the full gradients are held, not yet the sharded ones
    # (counted as both at once, the peak was 20% high against plan --simulate)
    assert unsharded.peak - sharded.peak == total * 4 - sharded.grads
    assert (unsharded.params, unsharded.grads, unsharded.optimizer) == (
        sharded.params, sharded.grads, sharded.optimizer)


def test_planner_holds_no_table_for_an_exchanged_embedding():
    """strategy.embedding_lookup=exchange: under SHARD_GRAD_OP every unit stays gathered from its
    forward to its backward, but an exchanged embedding is never gathered (bf16 where planned)."""
    cfg = load_config(["strategy.embedding_lookup=gather"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    gathered = estimate(cfg, model, "SHARD_GRAD_OP", 8, 8)
    cfg.strategy.embedding_lookup = "exchange"
    exchanged = estimate(cfg, model, "SHARD_GRAD_OP", 8, 8)
    assert gathered.gathered - exchanged.gathered == model.tok_embeddings.weight.numel() * 2
    # One rank shards nothing: there is nothing to exchange.
    at_one = estimate(cfg, model, "SHARD_GRAD_OP", 1, 1).gathered
    cfg.strategy.embedding_lookup = "gather"
    assert estimate(cfg, model, "SHARD_GRAD_OP", 1, 1).gathered == at_one


def test_an_embedding_whose_options_need_the_whole_table_is_gathered():
    """Found by review: max_norm (rows renormalised in place) and scale_grad_by_freq (counts over
    the whole batch) were dropped without a word by the row exchange; such a table is gathered."""
    from torch import nn

    from shardtrain.distributed.embedding_exchange import exchangeable

    model = nn.Sequential(nn.Embedding(16, 8))
    assert exchangeable(model, [model[0]])
    for options in ({"max_norm": 0.5}, {"scale_grad_by_freq": True}, {"sparse": True}):
        model = nn.Sequential(nn.Embedding(16, 8, **options))
        assert not exchangeable(model, [model[0]]), options
