"""What each panel of the report plots, as plain data: runs -> panels of lines, markers and bars.

Pure (no drawing): the same panels are drawn by ``figures`` and written into the HTML as JSON, so
what a reader sees and what a program reads back are one thing.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from shardtrain.report.runs import Run, finite_or_none, restarts_so_far

PHASES = ("forward", "backward", "optimizer", "end")
STATE_PARTS = ("params", "grads", "optimizer")
# Throughput fields, most telling first: a task's own count per second (tokens for a language
# model, `<unit>_per_s`), else samples per second.
SAMPLES_RATE = "samples_per_s"


@dataclass
class Line:
    """One plotted series of one run. ``style``: ``line`` (joined), ``marked`` (dashed, each point
    marked: sparse values such as the validation loss), ``points`` (markers only: events)."""

    run: str
    label: str
    x: list[float]
    y: list[float | None]
    style: str = "line"


@dataclass
class Marker:
    """A vertical marker at ``x``: an attempt that started there (``resume``, ``restart``) or a
    step whose update was skipped (``skip``)."""

    run: str
    x: float
    kind: str
    label: str
    reason: str = ""  # a skipped step's: "non-finite", or "nothing to learn from" (a count of 0)


@dataclass
class Level:
    """A horizontal reference (the gradient clipping threshold)."""

    run: str
    y: float
    label: str


@dataclass
class Bars:
    """Stacked bars: for each group (phase) and run, one segment per part, in MiB."""

    groups: list[str]
    parts: list[str]
    values: dict[str, dict[str, list[float]]]  # run -> part -> one value per group
    step: dict[str, int]  # run -> the step of the record shown


@dataclass
class Panel:
    id: str
    title: str
    xlabel: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    levels: list[Level] = field(default_factory=list)
    bars: Bars | None = None
    note: str = ""
    log_y: bool = False
    zero_based: bool = False  # the y axis starts at 0 (amounts: rates, seconds, MiB)

    @property
    def empty(self) -> bool:
        return not (self.lines or self.bars)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


RATE = re.compile(r"[a-z][a-z0-9_]*_per_s")


def rate_key(runs: list[Run]) -> str:
    """The throughput field: tokens_per_s, another task unit's ``<unit>_per_s``, else samples_per_s."""
    # A task's count_unit is a lowercase name (tasks.task.check_task); others are no rate of ours.
    # A unit's rate comes with its count (<unit>_seen): a task's metric named bits_per_s is no rate
    # (found by review: it took the throughput panel, and the loss-against-count one plotted 0s).
    # Runs logged before the count took the unit's name counted every unit as tokens_seen.
    def counted(record: dict, key: str) -> bool:
        seen = {k for k in record if k.endswith("_seen")}
        return f"{unit_of(key)}_seen" in seen or seen == {"tokens_seen"}

    keys = {k for run in runs for r in run.of("train") for k in r if RATE.fullmatch(k) and counted(r, k)}
    if "tokens_per_s" in keys:
        return "tokens_per_s"
    others = sorted(keys - {SAMPLES_RATE})
    return others[0] if others else SAMPLES_RATE


def unit_of(key: str) -> str:
    return key.removesuffix("_per_s")


def start_markers(run: Run, to_x=lambda step: step) -> list[Marker]:
    """Each attempt after the first: where it resumed from (or that it started over)."""
    markers = []
    totals = restarts_so_far([start.restart_count for start in run.starts])
    for index, (start, total) in enumerate(zip(run.starts, totals, strict=True)):
        if index == 0 and start.resumed_from is None and start.restart_count == 0:
            continue  # the run's own beginning
        kind = "restart" if start.restart_count else "resume"
        what = (f"resumed at step {start.step} ({start.resumed_from.rstrip('/').rsplit('/', 1)[-1]})"
                if start.resumed_from else f"started over at step {start.step}")
        # Numbered over the run, as the runs table counts them (torchrun's own count is per job).
        in_job = f" ({start.restart_count} in this job)" if total != start.restart_count else ""
        restart = f"torchrun restart {total}{in_job}, " if start.restart_count else ""
        markers.append(Marker(run.name, to_x(start.step), kind, f"{run.name}: {restart}{what}"))
    return markers


def skip_reason(record: dict) -> str:
    """Why a ``skip`` record's step was skipped: its count tells a step with nothing to learn from
    (0: prompts alone) from a non-finite loss or gradient norm."""
    return "nothing to learn from" if record.get("count") == 0 else "non-finite"


def skip_markers(run: Run) -> list[Marker]:
    return [Marker(run.name, r["step"], "skip", f"{run.name}: step {r['step']} skipped ({skip_reason(r)})",
                   skip_reason(r)) for r in run.of("skip")]


def run_unit(run: Run) -> str:
    """What a run's task counts (its throughput field's unit: tokens for a language model)."""
    return unit_of(rate_key([run]))


def seen_count(record: dict, unit: str) -> float | None:
    """A train record's count so far: ``<unit>_seen``, or ``tokens_seen``, under which runs logged
    before 2026-11-28 kept every task's count (a run resumed across that has both kinds)."""
    return finite_or_none(record.get(f"{unit}_seen", record.get("tokens_seen")))


def steps_to_count(run: Run, unit: str):
    """The task's count seen at any step (tokens for a language model): the logged counts, joined
    linearly (a validation point or a resume between two logged records has no count of its own)."""
    known = [(r["step"], c) for r in run.of("train") if (c := seen_count(r, unit)) is not None]
    xs = np.array([0.0] + [s for s, _ in known])
    ys = np.array([0.0] + [c for _, c in known])
    return lambda step: float(np.interp(step, xs, ys))


def series_panel(runs: list[Run], panel_id: str, title: str, ylabel: str, key: str,
                 scale: float = 1.0, zero_based: bool = True) -> Panel:
    """One line per run of ``key`` against the step, with the attempts' starts marked."""
    panel = Panel(panel_id, title, "step", ylabel, zero_based=zero_based)
    for run in runs:
        steps, values = run.values("train", key)
        if any(v is not None for v in values):
            panel.lines.append(Line(run.name, key, steps,
                                    [None if v is None else v * scale for v in values]))
        panel.markers += start_markers(run)
    return panel


def counting_elsewhere(runs: list[Run], unit: str) -> str:
    """The note of a panel whose axis counts ``unit``: the runs counting another (a ViT's samples
    beside a language model's tokens), which have no place on it."""
    elsewhere = [f"{run.name} ({run_unit(run)})" for run in runs if run_unit(run) != unit]
    return f"Not on this panel, counting another unit: {', '.join(elsewhere)}." if elsewhere else ""


def throughput_panel(runs: list[Run], rate: str) -> Panel:
    unit = unit_of(rate)
    panel = series_panel(runs, "throughput", f"Throughput ({unit}/s, all ranks)", f"{unit}/s", rate)
    panel.note = counting_elsewhere(runs, unit)
    return panel


def loss_panels(runs: list[Run], unit: str) -> list[Panel]:
    """The loss against steps and against the task's count seen (tokens for a language model)."""
    per = "target token" if unit == "tokens" else unit.removesuffix("s")
    by_step = Panel("loss_steps", "Loss against steps", "step", f"loss (per {per})")
    by_tokens = Panel("loss_tokens", f"Loss against {unit} seen", f"{unit} seen", f"loss (per {per})")
    by_tokens.note = counting_elsewhere(runs, unit)
    for run in runs:
        counted_here = run_unit(run) == unit
        count_at = steps_to_count(run, unit)
        for key, style in (("loss", "line"), ("val_loss", "marked"), ("ema_val_loss", "marked")):
            steps, values = run.values("train", key)
            if all(v is None for v in values):  # none logged, or none finite: no empty legend entry
                continue
            by_step.lines.append(Line(run.name, key, steps, values, style))
            if counted_here:
                by_tokens.lines.append(Line(run.name, key, [count_at(s) for s in steps], values, style))
        by_step.markers += start_markers(run) + skip_markers(run)
        if counted_here:
            by_tokens.markers += start_markers(run, count_at)
    return [by_step, by_tokens]


def mfu_panel(runs: list[Run]) -> Panel:
    """MFU in percent; where no run knows its device's peak, the model's TFLOP/s instead."""
    known = [run for run in runs if any(v is not None for v in run.values("train", "mfu")[1])]
    if known:
        panel = series_panel(runs, "mfu", "Model FLOP/s utilisation", "MFU (%)", "mfu", scale=100)
        if unknown := [run.name for run in runs if run not in known]:
            panel.note = (f"Not on this panel, MFU unknown (no peak FLOP/s for its device, or no FLOPs "
                          f"counted): {', '.join(unknown)}.")
        return panel
    if not any(v is not None for run in runs for v in run.values("train", "model_tflops")[1]):
        # Nothing to draw instead: no FLOPs counted, whatever the device (found by review: an H100
        # run was said to lack its peak)
        panel = series_panel(runs, "mfu", "Model FLOP/s utilisation (unknown: no FLOPs counted)", "MFU (%)",
                             "mfu", scale=100)
        panel.note = ("These runs counted no FLOPs (a task whose forward could not be counted; "
                      "docs/tasks.md), so neither MFU nor the model's TFLOP/s is known.")
        return panel
    panel = series_panel(runs, "mfu", "Model TFLOP/s (MFU unknown: no peak for this device)",
                         "model TFLOP/s (all ranks)", "model_tflops")
    panel.note = ("MFU needs the device's peak FLOP/s, unknown on a CPU or an unlisted accelerator "
                  "(docs/metrics.md); the model's achieved TFLOP/s is drawn instead.")
    return panel


def memory_phase_panel(runs: list[Run]) -> Panel:
    """Each phase of a step: the bytes of the sharded parameters, gradients and optimizer state, and
    the rest of the phase's peak (accelerator: the allocator's peak; CPU: the process's RSS)."""
    panel = Panel("memory_phases", "Memory by phase of a step (rank 0)", "phase", "MiB")
    values: dict[str, dict[str, list[float]]] = {}
    steps: dict[str, int] = {}
    rest_parts = set()
    for run in runs:
        records = run.of("memory")
        if not records:
            continue
        record = records[-1]  # the latest: optimizer state exists and the allocator is warm
        accelerator = any(k.endswith(".peak_allocated_mib") for k in record)
        total_key, rest = (("peak_allocated_mib", "activations and temporaries (allocator peak)")
                           if accelerator else ("rss_mib", "rest of the process (resident set)"))
        rest_parts.add(rest)
        parts: dict[str, list[float]] = {part: [] for part in (*STATE_PARTS, rest)}
        for phase in PHASES:
            state = [finite_or_none(record.get(f"{phase}.{part}_mib")) or 0.0 for part in STATE_PARTS]
            total = finite_or_none(record.get(f"{phase}.{total_key}")) or 0.0
            for part, value in zip(STATE_PARTS, state):
                parts[part].append(value)
            parts[rest].append(max(total - sum(state), 0.0))
        values[run.name] = parts
        steps[run.name] = record["step"]
    if values:
        all_parts = [*STATE_PARTS, *sorted(rest_parts)]
        for parts in values.values():
            for part in all_parts:
                parts.setdefault(part, [0.0] * len(PHASES))
        panel.bars = Bars(list(PHASES), all_parts, values, steps)
        panel.note = ("From the latest `memory` record of each run (diagnostics.steps first steps of "
                      "each attempt): " + ", ".join(f"{name} step {s}" for name, s in steps.items()) + ".")
    return panel


def grad_norm_panel(runs: list[Run]) -> Panel:
    """The global gradient norm before clipping, the clipping threshold, and the logged steps where
    the norm was above it (their update was scaled down to the threshold)."""
    panel = series_panel(runs, "grad_norm", "Gradient norm (before clipping)", "global L2 norm",
                         "grad_norm", zero_based=False)
    for run in runs:
        clip = finite_or_none(run.config.get("trainer.grad_clip_norm"))
        if not clip or clip <= 0:
            continue
        panel.levels.append(Level(run.name, clip, f"{run.name}: clip at {clip:g}"))
        steps, norms = run.values("train", "grad_norm")
        clipped = [(s, n) for s, n in zip(steps, norms) if n is not None and n > clip]
        if clipped:
            panel.lines.append(Line(run.name, "clipped", [s for s, _ in clipped], [n for _, n in clipped],
                                    "points"))
    norms = [v for line in panel.lines for v in line.y if v]
    panel.log_y = bool(norms) and max(norms) / min(norms) > 30
    panel.note = ("The norm of the last step of each logged interval (trainer.log_every); the "
                  "threshold is trainer.grad_clip_norm.")
    return panel


def checkpoint_panel(runs: list[Run]) -> Panel:
    """Seconds training waited for each checkpoint save, synchronous and asynchronous apart."""
    panel = Panel("checkpoints", "Checkpoint saves: time training was blocked", "step", "seconds blocked",
                  zero_based=True)
    for run in runs:
        for label, is_async in (("blocked_s", False), ("blocked_s async", True)):
            records = [r for r in run.of("checkpoint") if bool(r.get("async")) == is_async]
            if records:
                panel.lines.append(Line(run.name, label, [r["step"] for r in records],
                                        [finite_or_none(r.get("blocked_s")) for r in records], "points"))
        panel.markers += start_markers(run)
    return panel


def build_panels(runs: list[Run]) -> list[Panel]:
    """Every panel of the report, in page order."""
    rate = rate_key(runs)
    unit = unit_of(rate)
    panels = [
        *loss_panels(runs, unit),
        throughput_panel(runs, rate),
        mfu_panel(runs),
        memory_phase_panel(runs),
        series_panel(runs, "peak_memory", "Peak memory since start (rank 0)", "MiB", "peak_memory_mib"),
        # rank 0's own loader: a stall on another rank shows as a slower step, not here
        series_panel(runs, "data_wait", "Data wait (share of wall time, rank 0)", "% of wall time",
                     "data_wait_pct"),
        grad_norm_panel(runs),
        series_panel(runs, "lr", "Learning rate", "learning rate", "lr"),
        checkpoint_panel(runs),
    ]
    return panels
