"""Failure records: each rank that fails writes what happened, so the launcher can say which rank
failed first and why, instead of leaving the user to dig through interleaved tracebacks."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import traceback
from pathlib import Path

from shardtrain.errors import RunDirectoryBusy, ShardtrainError

FAILURE_DIR = "failures"


def record_failure(run_dir: Path, rank: int, step: int, kind: str, message: str,
                   traceback_text: str = "", exit_status: int = 1, fallout: bool = False,
                   when: float | None = None) -> None:
    """``exit_status``: what a single process exits with for this failure (2 for the framework's
    own errors), which the launcher gives too: torchrun's own is 1 for any failure. ``fallout``:
    this rank raised another rank's failure (an agreed check, or it waited in a collective for a
    stuck one), never the root cause. ``when``: the failure's time, where it was found earlier."""
    try:
        directory = Path(run_dir) / FAILURE_DIR
        directory.mkdir(parents=True, exist_ok=True)
        write_whole(directory / f"rank-{rank}.json", json.dumps({
            "rank": rank, "host": socket.gethostname(), "step": step, "type": kind,
            "message": message, "time": time.time() if when is None else when, "traceback": traceback_text,
            "exit_status": exit_status, "fallout": fallout,
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        }, indent=2))
    except OSError:
        pass  # reporting must never mask the original failure


def write_whole(path: Path, text: str) -> None:
    """``text`` into ``path`` whole or not at all: a process stopped mid-write (the launcher stops the
    other workers once one exits) leaves no empty or half evidence file behind."""
    # One staging file per writer: the watchdog's stop and the main thread's own failure can record
    # at once, and sharing one, one's replace failed or wrote the other's half (found by a review).
    part = path.with_name(f".{path.name}.{threading.get_ident()}.part")
    try:
        part.write_text(text, encoding="utf-8")
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def is_failure(exc: BaseException) -> bool:
    """Not an interrupt (Ctrl-C reaches every worker: no rank's failure), a clean exit, nor a start
    refused because another training holds the run directory (its record would land among that
    training's own, and ``report`` named it that run's failure)."""
    return not (isinstance(exc, (KeyboardInterrupt, RunDirectoryBusy))
                or isinstance(exc, SystemExit) and exc.code in (0, None))


def exit_status_of(exc: BaseException) -> int:
    """What one process exits with for ``exc`` (the CLI's mapping): 2 for the framework's own
    errors, a SystemExit's own code, 1 for anything else."""
    if isinstance(exc, ShardtrainError):
        return 2
    if isinstance(exc, SystemExit) and isinstance(exc.code, int):
        return exc.code
    return 1


def record_exception(run_dir: Path, rank: int, step: int, exc: BaseException) -> None:
    """``exc`` as this rank's failure record."""
    text = str(exc)
    record_failure(run_dir, rank, step, type(exc).__name__, text.splitlines()[0] if text else "",
                   "".join(traceback.format_exception(exc)), exit_status_of(exc),
                   fallout=getattr(exc, "failed_rank", rank) != rank)


def first_failure(run_dir: Path, since: float, last_attempt: bool = False) -> dict | None:
    """The earliest failure recorded after ``since`` that is not another rank's failure raised
    here (the root cause; later ones are fallout). ``last_attempt``: of the last of torchrun's
    restarts that left a record only (one node's agent counts them all: the built-in launcher's),
    where an earlier attempt's, which a restart recovered from, would be named (a rank that
    records nothing in the last attempt, SIGKILLed as it waited on a failed peer, left it there)."""
    return root_failure(failure_records(run_dir, since, last_attempt))


def root_failure(records: list[dict]) -> dict | None:
    """The earliest of ``records`` that is not another rank's failure raised here (``first_failure``)."""
    return min(records, key=lambda r: (r.get("fallout", False), r["time"])) if records else None


def failure_records(run_dir: Path, since: float, last_attempt: bool = True) -> list[dict]:
    """The failures recorded after ``since`` (of the last attempt that left one), as
    ``first_failure`` reads them."""
    records = []
    for path in (Path(run_dir) / FAILURE_DIR).glob("rank-*.json"):
        try:
            record = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        if not (isinstance(record, dict) and isinstance(record.get("time"), (int, float))
                and all(key in record for key in ("rank", "host", "step", "type", "message"))):
            continue  # not a record of ours (hand-edited, or another tool's file)
        if record["time"] >= since:
            records.append(record)
    if last_attempt and records:
        last = max(record.get("attempt", 0) for record in records)
        records = [record for record in records if record.get("attempt", 0) == last]
    return records


def describe(record: dict) -> str:
    # ``step`` counts the steps done when it failed: 0 is start-up or the first step ("at step 0"
    # read as a step that does not exist).
    step = record["step"]
    when = "before its first step finished" if step == 0 else f"after step {step}"
    return (f"rank {record['rank']} (host {record['host']}) failed first, {when}: {record['type']}: "
            f"{record['message']}")
