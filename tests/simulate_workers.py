"""Simulation cases run in worker processes (two at a time: the machine has two cores)."""

from __future__ import annotations

import torch

from shardtrain.config.loader import load_config
from shardtrain.diagnostics.planner import estimate, planned_model
from shardtrain.models.registry import build_model
from shardtrain.train.simulate import simulate

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard")
# The default loss: chunked (auto) at Llama-3's 128k vocabulary.
SCALE = ["trainer.micro_batch_size=1", "trainer.seq_len=8192", "strategy.mixed_precision=bf16-mixed"]
PROCESSES_PER_NODE = 8


def scale_config(model: str, strategy: str, ac: str, *extra: str):
    return load_config([f"model={model}", f"strategy={strategy}", *SCALE,
                        f"strategy.activation_checkpointing={ac}", *extra])


def checkpointing_modes(strategy: str) -> tuple[str, ...]:
    """With and without activation checkpointing; selective checkpointing with full sharding."""
    return ("none", "all", "selective") if strategy == "full_shard" else ("none", "all")


def simulate_against_planner(model: str, world: int, strategy: str, extra: str = "") -> list[dict]:
    """``strategy`` with every checkpointing mode, one model at one world size; ``extra`` (more
    settings, space-separated) named in each case."""
    results = []
    meta = None
    for ac in checkpointing_modes(strategy):
        # The simulator gathers the embedding table (fake tensors hold no token ids to route):
        # the planner is asked about the same run.
        cfg = scale_config(model, strategy, ac, "strategy.embedding_lookup=gather", *extra.split())
        if meta is None:
            meta = planned_model(cfg)  # with finetune=lora its adapters on a frozen base
        sim = simulate(cfg, world, PROCESSES_PER_NODE)
        plan = estimate(cfg, meta, cfg.strategy.sharding_strategy, world, PROCESSES_PER_NODE)
        results.append(dict(
            case=f"{model} x {world} {strategy} AC={ac} {extra}".rstrip(), probed=sim.probed_layers,
            simulated=(sim.params, sim.grads, sim.optimizer, sim.activations, sim.peak),
            # FSDP2's memory tracker counts unsharded accumulation's full gradients (made in
            # backward) with the activations; the planner apart from them
            planned=(plan.params, plan.grads, plan.optimizer, plan.activations + plan.accumulation,
                     plan.peak),
        ))
    return results


def small_config(layers: int, strategy: str, ac: str, accumulate: int = 1, seq_len: int = 8192):
    """Llama-3-8B's width at ``layers`` blocks, 16 ranks of 4 per node."""
    return load_config(["model=llama3_8b", f"model.n_layers={layers}", f"strategy={strategy}",
                        "strategy.mixed_precision=bf16-mixed", f"strategy.activation_checkpointing={ac}",
                        "trainer.micro_batch_size=1", f"trainer.seq_len={seq_len}",
                        f"trainer.grad_accum_steps={accumulate}"])


def probe_and_full_depth(strategy: str, ac: str, accumulate: int) -> tuple:
    cfg = small_config(10, strategy, ac, accumulate)
    return simulate(cfg, 16, 4), simulate(cfg, 16, 4, probe=False)


def simulate_tensor_parallel(model: str, world: int, tp: int, strategy: str, ac: str, *extra: str) -> dict:
    """One FSDP x TP case (``tp`` ranks of a node's 8), simulated and planned."""
    extra = tuple(setting for setting in extra if setting)
    cfg = scale_config(model, strategy, ac, "trainer.devices=8", f"strategy.tensor_parallel={tp}", *extra)
    with torch.device("meta"):
        meta = build_model(cfg.model)
    sim = simulate(cfg, world, PROCESSES_PER_NODE)
    plan = estimate(cfg, meta, cfg.strategy.sharding_strategy, world, PROCESSES_PER_NODE)
    return dict(case=f"{model} x {world} {strategy} TP {tp} AC={ac} {' '.join(extra)}".rstrip(),
                probed=sim.probed_layers, mesh=sim.mesh,
                simulated=(sim.params, sim.grads, sim.optimizer, sim.activations, sim.peak),
                planned=(plan.params, plan.grads, plan.optimizer, plan.activations, plan.peak))


def tensor_parallel_probe_and_full_depth() -> tuple:
    cfg = small_config(10, "full_shard", "all", seq_len=4096)
    cfg.strategy.tensor_parallel = 4
    return simulate(cfg, 16, 4), simulate(cfg, 16, 4, probe=False)
