"""Code that runs inside spawned ranks for the tensor-parallelism tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from checkpoint_workers import new_trainer
from equivalence import STEPS, case_config, run_cases

# The tiny model of the equivalence tests with a feed-forward width tensor parallelism can split
# (97 cannot be halved); dim 36, 6 heads, 2 key/value heads and the 256-token vocabulary can.
TP_MODEL = {"ffn_hidden_dim": 98}
SPLIT = 2  # steps at FSDP 4 before the checkpoint the FSDP 2 x TP 2 run resumes from


def layout_config(run_dir: str, resume: str = "auto", **strategy):
    cfg = case_config(4, run_dir, model=TP_MODEL, **strategy)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, enabled=True, resume=resume)
    return cfg


def equivalence_and_resume(out: str, cases: dict[str, dict]) -> None:
    """4 ranks: every equivalence case, then a run that trains SPLIT steps as FSDP 4, saves, and
    goes on from that checkpoint as FSDP 2 x TP 2 (DCP reshards the DTensors) to STEPS."""
    run_cases(cases, out)
    first = new_trainer(layout_config(f"{out}/fsdp4"))
    for _ in range(SPLIT):
        first.run_step()
    first.save_checkpoint(blocking=True)
    second = new_trainer(layout_config(f"{out}/tp", resume=f"{out}/fsdp4/checkpoints/step-{SPLIT}",
                                       tensor_parallel=2))
    assert second.step == SPLIT, second.step
    result = second.fit()
    weights = second.full_weights()
    if second.env.is_main:
        torch.save({"losses": first.result.losses + result.losses,
                    "grad_norms": first.result.grad_norms + result.grad_norms,
                    "weights": weights,
                    "ids": [ids.tolist() for ids in first.consumed_ids + second.consumed_ids]},
                   Path(out, "across_layouts.pt"))
    assert len(first.result.losses) + len(result.losses) == STEPS
