"""Code that runs inside spawned ranks for the tensor-parallelism tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from checkpoint_workers import interrupted, new_trainer
from equivalence import STEPS, case_config, run_cases

# The tiny model of the equivalence tests with a feed-forward width tensor parallelism can split
# (97 cannot be halved); dim 36, 6 heads, 2 key/value heads and the 256-token vocabulary can.
TP_MODEL = {"ffn_hidden_dim": 98}
SPLITS = (2, 4)  # FSDP 4 to step 2, FSDP 2 x TP 2 to step 4, FSDP 4 again to the end


def layout_config(run_dir: str, resume: str = "auto", **strategy):
    cfg = case_config(4, run_dir, model=TP_MODEL, **strategy)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, enabled=True, resume=resume)
    return cfg


def equivalence_and_resume(out: str, cases: dict[str, dict]) -> None:
    """4 ranks: every equivalence case, then one run across layouts (DCP reshards the DTensors at
    each change): FSDP 4 to step 2, saved; resumed as FSDP 2 x TP 2 to step 4, saved; resumed as
    FSDP 4 again to the last step."""
    run_cases(cases, out)
    first = new_trainer(layout_config(f"{out}/fsdp4"))
    interrupted(first, SPLITS[0])
    second = new_trainer(layout_config(f"{out}/tp", resume=f"{out}/fsdp4/checkpoints/step-{SPLITS[0]}",
                                       tensor_parallel=2))
    assert second.step == SPLITS[0], second.step
    interrupted(second, SPLITS[1] - SPLITS[0])
    tp_weights = second.full_weights()
    third = new_trainer(layout_config(f"{out}/back", resume=f"{out}/tp/checkpoints/step-{SPLITS[1]}"))
    assert third.step == SPLITS[1], third.step
    result = third.fit()
    weights = third.full_weights()
    runs = (first, second, third)
    if third.env.is_main:
        torch.save({"losses": [loss for run in runs for loss in run.result.losses],
                    "grad_norms": [norm for run in runs for norm in run.result.grad_norms],
                    "weights": weights, "tp_weights": tp_weights,
                    "ids": [ids.tolist() for run in runs for ids in run.consumed_ids]},
                   Path(out, "across_layouts.pt"))
    assert len(result.losses) == STEPS - SPLITS[1]
