"""Throughput and MFU, and the metrics sink (JSON lines, and the trackers), rank 0 only."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

from shardtrain.config.schema import Config
from shardtrain.train.trackers import GuardedTracker, close_trackers, start_trackers, tracker_record


class Throughput:
    """Samples/s, the task's count per second (``<unit>_per_s``: tokens/s for a language model) and
    FLOP/s over the wall time since the last report: whole iterations (data, step, evaluation,
    checkpoint saves, logging), not the optimizer step alone, which flatters a loop."""

    RATE_FIELDS = ("model_tflops", "mfu", "data_wait_ms", "data_wait_pct")

    def __init__(self, unit: str, world_size: int, peak_flops: float | None) -> None:
        self.unit = unit
        self.world_size = world_size
        self.peak_flops = peak_flops
        self.reset()

    def reset(self) -> None:
        self.samples = 0
        self.count = 0.0
        self.flops = 0.0
        self.steps = 0
        self.data_wait_s = 0.0
        self.since = time.perf_counter()

    def add(self, samples: int, count: float, flops: float, data_wait_s: float = 0.0) -> None:
        """One step's samples, count and FLOPs (all ranks; 0 FLOPs: unknown), and how long it
        waited for its batches."""
        self.samples += samples
        self.count += count
        self.flops += flops
        self.steps += 1
        self.data_wait_s += data_wait_s

    def seen_field(self) -> str:
        """The record's name for the count so far (``tokens_seen`` for a language model)."""
        return f"{self.unit}_seen"

    def field_names(self) -> tuple[str, ...]:
        """The names a train record gives the throughput's values and the count so far (a task's
        metric may not take one)."""
        return (f"{self.unit}_per_s", "samples_per_s", self.seen_field(), *self.RATE_FIELDS)

    def report(self) -> dict[str, float | None]:
        seconds = time.perf_counter() - self.since
        per_s = 1 / seconds if seconds > 0 else 0.0
        flops = self.flops * per_s
        mfu = flops / (self.peak_flops * self.world_size) if self.peak_flops and flops else None
        # The share of the wall time spent waiting for data: what prefetching did not hide.
        wait_pct = 100 * self.data_wait_s * per_s
        # The count's own rate beside samples/s (tokens/s for a language model); a task whose count
        # is its samples has samples/s alone, the count's, as <unit>_seen counts them (found by
        # review: the samples consumed, beside a samples_seen of the count, which a loss counting
        # some of its samples keeps lower).
        rates = {"samples_per_s": self.samples * per_s, f"{self.unit}_per_s": self.count * per_s}
        wait_ms = 1000 * self.data_wait_s / max(self.steps, 1)
        values = (flops / 1e12 if flops else None, mfu, wait_ms, wait_pct)
        return {**rates, **dict(zip(self.RATE_FIELDS, values, strict=True))}


METRICS_FILE = "metrics.jsonl"
# A dry run's records: its one step must not join the run's own (an extra attempt, a step past
# max_steps in `shardtrain report`).
DRY_RUN_FILE = "dry-run.jsonl"


class MetricsWriter:
    """Appends one JSON object per record to ``metrics.jsonl`` and hands the same record to every
    tracker of ``run.trackers`` (train/trackers.py); rank 0 only."""

    def __init__(self, run_dir: Path, enabled: bool, name: str = METRICS_FILE) -> None:
        self.enabled = enabled
        self._file = None
        self.started = False  # this attempt's start record written: its end record belongs to it
        self.trackers: list[GuardedTracker] = []
        self.tracker_timeout_s = 0.0
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / name, "a", buffering=1, encoding="utf-8")

    def start_trackers(self, cfg: Config, resuming: bool, start_step: int = 0) -> None:
        """The trackers, started (a ``TrackerError`` if one cannot start); ``resuming`` continues
        their runs from ``start_step``."""
        if self.enabled:
            self.trackers = start_trackers(cfg, resuming, start_step)
            self.tracker_timeout_s = cfg.run.tracker_timeout_s

    def write(self, step: int, kind: str, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "kind": kind, "time": time.time(), **values}
        self._file.write(json.dumps(record) + "\n")
        self.started = self.started or kind == "start"
        if self.trackers:
            entry = tracker_record(step, kind, record["time"], values)
            for tracker in self.trackers:
                tracker.log(entry)

    def close(self, outcome: str = "finished", step: int | None = None) -> None:
        """``outcome``: finished, failed, preempted or interrupted (recorded by W&B and MLflow, and
        at ``step`` as an ``end`` record in metrics.jsonl, which the report reads)."""
        # A full disk must not mask how the run ended, nor leave the trackers' runs open: the line
        # it refused stays buffered, and closing the file tries it again.
        # Without this attempt's start record (its trackers failed to start), an end record would be
        # read as the previous attempt's (found by review: a preempted attempt shown as failed).
        if self._file is not None and step is not None and self.started:
            with contextlib.suppress(OSError):
                self.write(step, "end", {"outcome": outcome})
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()
        close_trackers(self.trackers, outcome, self.tracker_timeout_s)
        self.trackers = []
