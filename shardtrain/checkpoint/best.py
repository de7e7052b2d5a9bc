"""The best evaluations by ``trainer.monitor``: the checkpoints ``checkpoint.keep_best`` keeps
beside the newest ``keep_last`` (as Lightning's ``ModelCheckpoint(monitor=..., save_top_k=...)``),
and the evaluations since the last improvement that ``trainer.early_stop_patience`` counts (as
Lightning's ``EarlyStopping``).

Both are part of every checkpoint's trainer state (``TrainState.best``), so a resume at any world
size, and the prune after each commit, know them without reading any other checkpoint: each rank
judges an evaluation alike (its value is all-reduced: the same everywhere), and rank 0's prune
keeps the ranked steps.
"""

from __future__ import annotations

import math
from typing import Any

from shardtrain.config.schema import TrainerConfig


class BestEvaluations:
    """The ``keep`` best (step, value) pairs of ``monitor`` so far, best first; the best value
    yet, and how many evaluations since it have not improved on it by more than ``min_delta``."""

    def __init__(self, trainer: TrainerConfig, keep: int, evaluated: int | None = None,
                 validation: dict[str, Any] | None = None) -> None:
        self.keep = keep
        # The validation samples each evaluation reads, and what else makes them the same windows
        # (``validation``: their length, document masking, the held-out windows there are): values
        # over another set do not compare.
        self.evaluated = evaluated
        self.validation = validation
        self.monitor = trainer.monitor
        self.mode = trainer.monitor_mode
        self.min_delta = trainer.early_stop_min_delta
        self.ranking: list[tuple[int, float]] = []
        self.best: tuple[int, float] | None = None
        self.stale = 0
        # The step at which trainer.early_stop_patience ended the run (a resume from it has nothing
        # to do unless the patience grew).
        self.stopped_at: int | None = None

    def better(self, value: float, than: float) -> bool:
        return value < than if self.mode == "min" else value > than

    def judge(self, step: int, value: float, rank: bool = True) -> bool:
        """Take ``step``'s evaluation; whether its checkpoint ranks among the ``keep`` kept (it is
        then in the ranking, the worst out beyond ``keep``). NaN neither ranks nor improves.
        ``rank`` False: counted for early stopping only (its checkpoint is not this run's)."""
        if not math.isfinite(value):
            self.stale += 1
            return False
        margin = self.min_delta if self.mode == "min" else -self.min_delta
        if self.best is None or self.better(value, self.best[1] - margin):
            self.best, self.stale = (step, value), 0
        else:
            self.stale += 1
        if not rank:
            return False
        if not (len(self.ranking) < self.keep or (self.ranking and self.better(value, self.ranking[-1][1]))):
            return False
        entries = [(s, v) for s, v in self.ranking if s != step] + [(step, value)]
        entries.sort(key=lambda entry: entry[1], reverse=self.mode == "max")
        self.ranking = entries[: self.keep]
        return True

    def describe(self) -> str:
        return ", ".join(f"step-{step} {self.monitor} {value:.6g}" for step, value in self.ranking)

    def state(self) -> dict[str, Any]:
        """What a checkpoint's trainer state records of it."""
        return {"monitor": self.monitor, "mode": self.mode, "ranking": [[s, v] for s, v in self.ranking],
                "best": None if self.best is None else list(self.best), "stale": self.stale,
                "stopped_at": self.stopped_at, "evaluated": self.evaluated, "validation": self.validation}

    def restore(self, saved: dict[str, Any] | None, held: set[int] | None) -> str | None:
        """The record of a resumed checkpoint's trainer state; a line to say when it cannot be taken
        (saved without one, judging another value, or by another run: ``held`` None when the
        checkpoint lies outside this run's checkpoints directory, whose steps its ranking does not
        name), None when it was. ``held``: the steps whose checkpoints this run's directory still
        holds (a rollback to an older checkpoint may find ranked steps a later commit pruned: they
        leave the ranking, which would otherwise keep out every evaluation worse than theirs and
        point ``best`` at nothing). Another run's best value and count are taken all the same."""
        if not saved:
            return ("the resumed checkpoint records no best evaluation: trainer.monitor is judged from "
                    "here on")
        if (saved.get("monitor"), saved.get("mode")) != (self.monitor, self.mode):
            return (f"the resumed checkpoint judged its evaluations by {saved.get('monitor')} "
                    f"({saved.get('mode')}), this run by {self.monitor} ({self.mode}): judged afresh from "
                    "here on, and the checkpoints the old ranking kept are pruned as keep_last says")
        if None not in (saved.get("evaluated"), self.evaluated) and saved["evaluated"] != self.evaluated:
            return (f"the resumed checkpoint judged evaluations of {saved['evaluated']} validation samples, "
                    f"this run evaluates {self.evaluated} (trainer.eval_samples or the validation data "
                    "changed): judged afresh from here on, and the checkpoints the old ranking kept are "
                    "pruned as keep_last says")
        # The keys both record: a checkpoint saved before a key joined judged the same windows (its
        # ranking went on across an upgrade)
        before, now = saved.get("validation") or {}, self.validation or {}
        changed = ", ".join(f"{key} {before[key]} -> {value}" for key, value in now.items()
                            if key in before and before[key] != value)
        if changed:
            return (f"the resumed checkpoint judged evaluations of other validation windows ({changed}): "
                    "judged afresh from here on, and the checkpoints the old ranking kept are pruned as "
                    "keep_last says")
        best = saved.get("best") or (saved["ranking"][0] if saved.get("ranking") else None)
        if best is not None:
            self.best = (int(best[0]), float(best[1]))
        self.stale = int(saved.get("stale", 0))
        self.stopped_at = saved.get("stopped_at")
        if held is None:
            return None if not self.keep else (
                "the resumed checkpoint is another run's, whose best checkpoints lie in its own directory: "
                "checkpoint.keep_best ranks this run's evaluations from here on")
        ranking = [(int(step), float(value)) for step, value in saved.get("ranking", [])][: self.keep]
        self.ranking = [entry for entry in ranking if entry[0] in held]
        if gone := [f"step-{step}" for step, _ in ranking if step not in held]:
            return (f"the resumed checkpoint ranked {', '.join(gone)} among the best, which this run's "
                    "checkpoints no longer hold: ranked without them")
        return None
