"""One training at a time in a run directory.

Two trainings started in one ``run.dir`` (a command run twice, a job submitted twice, a requeue while
the old job still runs) save into the same checkpoints directory: each deletes the other's
in-progress saves as abandoned at its start, prunes the other's checkpoints as its own, and the
newest checkpoint may hold either run's weights. Rank 0 of a training holds an exclusive ``flock``
on ``run.dir/.shardtrain-run.lock`` from start-up to its end; a second start finds it held and stops
with one line naming the holder. The kernel drops the lock when the process ends however it ends
(killed, out of memory, a torchrun restart), so a stale lock is never left behind. A dry run takes
none: it changes no file of the run.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import IO

from shardtrain.errors import CheckpointError

log = logging.getLogger(__name__)

LOCK_FILE = ".shardtrain-run.lock"


class RunLock:
    """The held lock; ``release`` (or the process's end) lets the next training start."""

    def __init__(self, handle: IO[str] | None) -> None:
        self.handle = handle

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing the file drops the flock
            self.handle = None


def take_run_lock(run_dir: Path) -> RunLock:
    """The run directory's lock, or a CheckpointError naming the training that holds it. A filesystem
    without ``flock`` is a warning: the run goes on unguarded."""
    path = run_dir / LOCK_FILE
    run_dir.mkdir(parents=True, exist_ok=True)
    # Opened for appending: a second start must read the holder's line before deciding, not empty it.
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = describe_holder(handle.read())
        handle.close()
        raise CheckpointError(f"another training holds {run_dir} ({holder}; {path}): two trainings in one "
                              "run.dir delete and prune each other's checkpoints; wait for it to end, stop "
                              "it, or choose another run.dir") from None
    except OSError as exc:
        log.warning(f"checkpoint: cannot lock {path} ({exc.strerror or exc}): a second training started in "
                    "this run.dir would not be refused")
        handle.close()
        return RunLock(None)
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}) + "\n")
    handle.flush()
    return RunLock(handle)


def describe_holder(text: str) -> str:
    """The holder's host, process and start, from what it wrote into the lock file."""
    try:
        holder = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["since"])))
        return f"process {int(holder['pid'])} on {holder['host']}, since {since}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"
