"""``checkpoint.keep_best``: the checkpoints with the best validation value, kept beside the newest
``keep_last`` (as Lightning's ``ModelCheckpoint(monitor=..., save_top_k=...)``).

The ranking is part of every checkpoint's trainer state (``TrainState.best``), so a resume at any
world size, and the prune after each commit, know it without reading any other checkpoint: each
rank decides alike whether an evaluation's value ranks (it is all-reduced: the same everywhere),
and rank 0's prune keeps the ranked steps.
"""

from __future__ import annotations

import math
from typing import Any

from shardtrain.config.schema import CheckpointConfig


class BestCheckpoints:
    """The ``keep`` best (step, value) pairs of ``monitor`` so far, best first."""

    def __init__(self, ckpt: CheckpointConfig) -> None:
        self.keep = ckpt.keep_best
        self.monitor = ckpt.monitor
        self.mode = ckpt.monitor_mode
        self.ranking: list[tuple[int, float]] = []

    def better(self, value: float, than: float) -> bool:
        return value < than if self.mode == "min" else value > than

    def ranks(self, value: float) -> bool:
        """Whether a checkpoint with this value would be among the kept ones (NaN never is)."""
        if not math.isfinite(value):
            return False
        return len(self.ranking) < self.keep or self.better(value, self.ranking[-1][1])

    def add(self, step: int, value: float) -> None:
        """``step``'s value ranked in (call when ``ranks``); the worst falls out beyond ``keep``."""
        entries = [(s, v) for s, v in self.ranking if s != step] + [(step, value)]
        entries.sort(key=lambda entry: entry[1], reverse=self.mode == "max")
        self.ranking = entries[: self.keep]

    def steps(self) -> set[int]:
        return {step for step, _ in self.ranking}

    def describe(self) -> str:
        return ", ".join(f"step-{step} {self.monitor} {value:.6g}" for step, value in self.ranking)

    def state(self) -> dict[str, Any]:
        """What a checkpoint's trainer state records of it."""
        return {"monitor": self.monitor, "mode": self.mode, "ranking": [[s, v] for s, v in self.ranking]}

    def restore(self, saved: dict[str, Any] | None, same_run: bool = True) -> str | None:
        """The ranking of a resumed checkpoint's trainer state; a line to say when it cannot be
        taken (saved without one, judging another value, or by another run: ``same_run`` false
        when the checkpoint lies outside this run's checkpoints directory, whose steps its ranking
        does not name), None when it was."""
        if not same_run:
            return ("the resumed checkpoint is another run's, whose best checkpoints lie in its own "
                    "directory: checkpoint.keep_best ranks this run's evaluations from here on")
        if not saved:
            return ("the resumed checkpoint records no ranking of the best: checkpoint.keep_best ranks "
                    "the evaluations from here on")
        if (saved.get("monitor"), saved.get("mode")) != (self.monitor, self.mode):
            return (f"the resumed checkpoint ranked its best by {saved.get('monitor')} "
                    f"({saved.get('mode')}), this run by {self.monitor} ({self.mode}): the ranking starts "
                    "again, and the checkpoints the old one kept are pruned as keep_last says")
        self.ranking = [(int(step), float(value)) for step, value in saved.get("ranking", [])]
        self.ranking = self.ranking[: self.keep]
        return None
