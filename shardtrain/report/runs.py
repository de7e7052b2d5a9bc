"""A run directory as the report reads it: ``metrics.jsonl`` as one timeline, ``config.yaml`` as flat keys.

Pure reading, no drawing. A run may still be writing (its last line half written) or may have been
resumed after a crash (records after the resume repeat steps the crashed attempt had logged): the
timeline is what the run that continues did, one record per step and kind, sorted by step.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from shardtrain.diagnostics.failures import describe, first_failure
from shardtrain.errors import ReportError, first_line

METRICS_FILE = "metrics.jsonl"
DRY_RUN_FILE = "dry-run.jsonl"  # a dry run's records, beside a run's (train/metrics.py)
# A checkpoint's trainer state (checkpoint/state.py, whose import brings torch: `report` answers without)
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
# Kinds logged at most once per step; a later record of a step replaces an earlier one.
STEP_KINDS = ("train", "memory", "checkpoint", "skip")
# A record starts with its step (MetricsWriter.write); a killed writer's unfinished line may have the
# next attempt's first record appended to it, which is found again from here.
RECORD_START = '{"step": '


@dataclass
class Start:
    """One attempt's start (a ``start`` record): the step it began at, what it resumed from."""

    step: int
    resumed_from: str | None
    restart_count: int
    world_size: int | None
    time: float | None = None
    # How it ended (its ``end`` record): finished, preempted, interrupted or failed, at ``ended_at``;
    # None where it wrote none (still running, killed, or written before the record existed).
    outcome: str | None = None
    ended_at: int | None = None


def restarts_so_far(counts: list[int]) -> list[int]:
    """At each of a run's starts, in order (their ``restart_count``), the torchrun restarts since
    the run began. torchrun's count starts from 0 again in each requeued Slurm job (a count that
    does not rise begins a job), and an attempt that failed before its start record still raised
    the next one's count: each job adds its highest count."""
    totals: list[int] = []
    earlier_jobs = 0
    for previous, count in zip([None, *counts], counts):
        if previous is not None and count <= previous:
            earlier_jobs += previous
        totals.append(earlier_jobs + count)
    return totals


@dataclass
class Run:
    path: Path
    name: str
    config: dict[str, Any]
    records: dict[str, list[dict]]  # kind -> records, one per step, sorted by step
    starts: list[Start] = field(default_factory=list)
    unreadable_lines: int = 0
    # The last attempt's root-cause failure record (run.dir/failures), if it recorded one.
    failure: dict | None = None

    def of(self, kind: str) -> list[dict]:
        return self.records.get(kind, [])

    def values(self, kind: str, key: str) -> tuple[list[int], list[float | None]]:
        """(steps, values) of ``key`` in the ``kind`` records that hold it (None: logged as null)."""
        pairs = [(r["step"], finite_or_none(r[key])) for r in self.of(kind) if key in r]
        return [s for s, _ in pairs], [v for _, v in pairs]


def number_or_none(value: Any) -> float | None:
    """A logged number as a float, NaN and infinities included; None for null or anything else."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def finite_or_none(value: Any) -> float | None:
    """A number as a float, with null, NaN and infinities as None (JSON has no NaN)."""
    number = number_or_none(value)
    return number if number is not None and math.isfinite(number) else None


def count_or_none(value: Any) -> int | None:
    """A count a record holds, or None where it holds something else (a hand-edited file's string,
    which a report would otherwise sort among numbers, or print into its page)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def parse_lines(text: str) -> tuple[list[dict], int]:
    """The records in a metrics.jsonl text, and how many whole lines could not be read.

    The text after the last newline is a record still being written by a running run: it counts
    only if it already parses as a whole record (its newline not yet written), and is never counted
    as unreadable. A line whose start was left unfinished by a killed writer keeps the
    record appended to it.
    """
    *lines, unfinished = text.split("\n")
    records, unreadable = [], 0
    for line in lines:
        if not line.strip():
            continue
        record = _record(line)
        if record is None:
            unreadable += 1
        else:
            records.append(record)
    if unfinished.strip() and (record := _record(unfinished)) is not None:
        records.append(record)  # complete, only its newline missing
    return records, unreadable


def _record(line: str) -> dict | None:
    for start in (0, line.rfind(RECORD_START)):
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and isinstance(
                record.get("kind"), str):
            return record
    return None


def timeline(records: list[dict]) -> tuple[dict[str, list[dict]], list[Start]]:
    """One record per step and kind, sorted by step, the later values winning where two records of
    a step name the same field (an evaluation a preemption skipped, run by the resume, adds its
    values to the step's record); and the attempts' starts.

    A ``start`` record at step S means training went back to S: what an earlier attempt logged after
    S never happened in the run that continues, and is dropped even where no later record replaces
    it (the attempts may log at different steps).
    """
    by_kind: dict[str, dict[int, dict]] = {kind: {} for kind in STEP_KINDS}
    starts: list[Start] = []
    for record in records:
        kind, step = record["kind"], record["step"]
        if kind == "start":
            for kept in by_kind.values():
                for later in [s for s in kept if s > step]:
                    del kept[later]
            restarts = count_or_none(record.get("restart_count")) or 0
            resumed = record.get("resumed_from") if isinstance(record.get("resumed_from"), str) else None
            starts.append(Start(step, resumed, restarts, count_or_none(record.get("world_size")),
                                finite_or_none(record.get("time"))))
        elif kind == "end" and starts:
            starts[-1].outcome, starts[-1].ended_at = str(record.get("outcome")), step
        elif kind in by_kind:
            by_kind[kind][step] = {**by_kind[kind].get(step, {}), **record}
    return {kind: [kept[s] for s in sorted(kept)] for kind, kept in by_kind.items()}, starts


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys (``trainer.lr``); lists and empty mappings stay values."""
    if not isinstance(tree, dict) or (not tree and prefix):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def read_config(path: Path) -> dict[str, Any]:
    """The run's resolved config as flat keys; empty when the run has not written it."""
    if not path.is_file():
        return {}
    try:
        return flatten(OmegaConf.to_container(OmegaConf.load(path)))
    except (OmegaConfBaseException, OSError, ValueError, yaml.YAMLError) as exc:
        raise ReportError(f"{path} is not readable YAML ({first_line(exc)}); it is the config.yaml "
                          "`shardtrain train` writes into run.dir") from exc


def check_run_dir(run_dir: Path) -> Path:
    """``run_dir``'s metrics file, or the one-line error that says what to pass instead (cheap:
    the command line asks before it imports the plotting library)."""
    if run_dir.is_file():
        raise ReportError(f"{str(run_dir)!r} is a file; pass the run directory holding it "
                          f"({str(run_dir.parent)!r}): the report reads its metrics.jsonl and config.yaml")
    if not run_dir.is_dir():
        raise ReportError(f"run directory {str(run_dir)!r} does not exist; pass the run.dir of a "
                          "training run (the directory holding metrics.jsonl)")
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        if (run_dir / DRY_RUN_FILE).is_file():
            raise ReportError(f"{str(run_dir)!r} holds a dry run's records only ({DRY_RUN_FILE}): a dry run "
                              "trains nothing to report; report the run.dir of a training run")
        if run_dir.name == "checkpoints" or (run_dir / STATE_FILE).is_file():
            whole = run_dir.absolute()  # `report step-4` from inside checkpoints/ names the run, not '.'
            run = whole.parent if whole.name == "checkpoints" else whole.parent.parent
            raise ReportError(f"{str(run_dir)!r} is a run's checkpoints, not its run directory; pass "
                              f"{str(run)!r}")
        raise ReportError(f"{str(run_dir)!r} has no {METRICS_FILE}: not a training run directory "
                          "(pass the run.dir of `shardtrain train`), or its run has not started")
    return metrics


def load_run(path: str | Path, name: str | None = None) -> Run:
    """Read one run directory (``run.dir`` of a finished, resumed or running training)."""
    run_dir = Path(path)
    metrics = check_run_dir(run_dir)
    records, unreadable = parse_lines(metrics.read_bytes().decode("utf-8", errors="replace"))
    kinds, starts = timeline(records)
    if not kinds["train"]:
        # An attempt's failure, not an earlier one's that a running attempt has not logged past yet
        failed = first_failure(run_dir, (starts[-1].time if starts else None) or 0.0, last_attempt=True)
        if failed is not None:  # it never will log one
            raise ReportError(f"{metrics} has no training records: the run failed before its first "
                              f"logged step ({describe(failed)}; {run_dir / 'failures'})")
        raise ReportError(f"{metrics} has no training records yet (a run writes one every "
                          "trainer.log_every steps); run the report again once it has logged a step")
    last_start = starts[-1].time if starts and starts[-1].time is not None else None
    # The launcher's choice: the last attempt's first failure (found by review: an earlier attempt's,
    # where a restart failed before its start record)
    failure = first_failure(run_dir, last_start, last_attempt=True) if last_start is not None else None
    return Run(run_dir, name or run_dir.name, read_config(run_dir / CONFIG_FILE), kinds, starts,
               unreadable, failure)


def run_names(paths: list[Path]) -> list[str]:
    """Short names that tell the runs apart: the directory names, with as many parent directories
    as it takes when two share a name. Bytes a file name holds that are no UTF-8 are shown as
    U+FFFD (matplotlib cannot draw the surrogates Python reads them as)."""
    parts = [p.resolve().parts for p in paths]
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):
        names = [os.fsencode(Path(*p[-depth:]).as_posix()).decode("utf-8", "replace") for p in parts]
        if len(set(names)) == len(names):
            return names
    raise ReportError("the same run directory is given twice; give each run once")  # load_runs checks


def load_runs(paths: list[str | Path]) -> list[Run]:
    paths = [Path(p) for p in paths]
    seen: dict[Path, Path] = {}
    for path in paths:
        if (first := seen.setdefault(path.resolve(), path)) is not path:
            raise ReportError(f"{str(path)!r} and {str(first)!r} are the same run directory; give each run "
                              "once")
    return [load_run(p, name) for p, name in zip(paths, run_names(paths))]


# run.dir always differs between runs and is shown beside each run's name already.
NOT_COMPARED = ("run.dir",)


def config_differences(runs: list[Run]) -> dict[str, list[Any]]:
    """The flat config keys whose values are not the same in every run: key -> value per run
    (None where a run's config lacks the key); sorted by key."""
    keys = sorted({k for run in runs for k in run.config} - set(NOT_COMPARED))
    missing = object()
    differences = {}
    for key in keys:
        values = [run.config.get(key, missing) for run in runs]
        if any(v != values[0] for v in values[1:]):
            differences[key] = [None if v is missing else v for v in values]
    return differences
