"""One training at a time in a run directory.

Two trainings started in one ``run.dir`` (a command run twice, a job submitted twice, a requeue while
the old job still runs) save into the same checkpoints directory: each deletes the other's
in-progress saves as abandoned at its start, prunes the other's checkpoints as its own, and the
newest checkpoint may hold either run's weights. Rank 0 of a training holds an exclusive ``flock``
on ``run.dir/.shardtrain-run.lock`` from start-up to its end; a second start finds it held and stops
with one line naming the holder. The kernel drops the lock when the process ends however it ends
(killed, out of memory, a torchrun restart). On a network filesystem a lock held from a node that
failed outlives it (NFSv4 until its lease expires, 90 s by default; NFSv3 until the node comes back;
Lustre until the client is evicted): a Slurm job requeued after that failure finds its own previous
run's lock, and waits up to ``REQUEUE_WAIT_S`` for it to go rather than refuse its own run. A dry run
takes none: it changes no file of the run. Trainers of one process share the process's hold (a library
user builds a second trainer to resume the first one's save).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import IO

from shardtrain.errors import RunDirectoryBusy

log = logging.getLogger(__name__)

LOCK_FILE = ".shardtrain-run.lock"
# How long a requeued Slurm job waits for the lock its own earlier run held from a failed node.
REQUEUE_WAIT_S = 240.0


# The locks this process holds, by lock file, with how many trainers hold each: a process's own
# trainers of one run.dir (a library user building a second to resume the first's save) share it, as
# flock would refuse this process a second hold of its own lock.
HELD: dict[Path, tuple[IO[str], int]] = {}


class RunLock:
    """A hold on the lock; ``release`` (or the process's end) lets the next training start once this
    process's last hold is released."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def release(self) -> None:
        if self.path is None:
            return
        handle, holds = HELD.pop(self.path)
        if holds > 1:
            HELD[self.path] = (handle, holds - 1)
        else:
            handle.close()  # closing the file drops the flock
        self.path = None


def take_run_lock(run_dir: Path) -> RunLock:
    """The run directory's lock, or a CheckpointError naming the training that holds it. A filesystem
    without ``flock`` is a warning: the run goes on unguarded."""
    path = (run_dir / LOCK_FILE).resolve()  # one key for the directory however it is reached
    if path in HELD:
        handle, holds = HELD[path]
        HELD[path] = (handle, holds + 1)
        return RunLock(path)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Opened for appending: a second start must read the holder's line before deciding, not empty it.
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        text = handle.read()
        requeued = earlier_run_of_this_job(text)
        if not (requeued and wait_for_lock(handle, path)):
            handle.close()
            since = (f"; it is this Slurm job's run before its requeue, whose lock the filesystem has kept "
                     f"{REQUEUE_WAIT_S:.0f} s after its node failed: remove {path} once that node is down"
                     if requeued else "")
            raise RunDirectoryBusy(f"another training holds {run_dir} ({describe_holder(text)}; {path}): two "
                                   "trainings in one run.dir delete and prune each other's checkpoints; wait "
                                   f"for it to end, stop it, or choose another run.dir{since}") from None
    except OSError as exc:
        log.warning(f"checkpoint: cannot lock {path} ({exc.strerror or exc}): a second training started in "
                    "this run.dir would not be refused")
        handle.close()
        return RunLock(None)
    if (local := node_local_flock(path)) is not None:
        mount, how, fix = local
        log.warning(f"checkpoint: {path} is on {how} at {mount}: its lock holds on this node only, so a "
                    "second training started in this run.dir from another node would not be refused "
                    f"({fix} for a cluster-wide lock)")
    handle.seek(0)
    handle.truncate()
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), **slurm_incarnation()}
    handle.write(json.dumps(holder) + "\n")
    handle.flush()
    HELD[path] = (handle, 1)
    return RunLock(path)


def slurm_incarnation() -> dict[str, int]:
    """This process's Slurm job and how many times it was requeued (none outside Slurm)."""
    job = os.environ.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        return {}
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    return {"slurm_job": int(job), "slurm_restart": int(restarts) if restarts.isdigit() else 0}


def earlier_run_of_this_job(text: str) -> bool:
    """Whether the lock's holder is this Slurm job before a requeue (Slurm runs one job id at a time:
    the holder is gone, its node failed). Two steps of one job start alike: refused as ever."""
    mine = slurm_incarnation()
    try:
        holder = json.loads(text)
        return bool(mine) and holder.get("slurm_job") == mine["slurm_job"] and (
            int(holder.get("slurm_restart", 0)) < mine["slurm_restart"])
    except (ValueError, TypeError, AttributeError):
        return False


def wait_for_lock(handle: IO[str], path: Path) -> bool:
    """Whether the lock came free within ``REQUEUE_WAIT_S``."""
    log.warning(f"checkpoint: {path} is held by this job's run before its requeue (its node failed, and "
                f"the filesystem keeps its lock until that node's lease ends): waiting up to "
                f"{REQUEUE_WAIT_S:.0f} s for it")
    deadline = time.monotonic() + REQUEUE_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            continue
    return False


def describe_holder(text: str) -> str:
    """The holder's host, process and start, from what it wrote into the lock file."""
    try:
        holder = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["since"])))
        return f"process {int(holder['pid'])} on {holder['host']}, since {since}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


MOUNTINFO = Path("/proc/self/mountinfo")


def node_local_flock(path: Path, mountinfo: str | None = None) -> tuple[str, str, str] | None:
    """(the mount point, how it is mounted, the fix) where ``path``'s filesystem keeps ``flock`` on each
    node alone: Lustre mounted with ``localflock`` (found by a scale review), NFS mounted with
    ``nolock`` or ``local_lock=flock|all`` (found by review); else None. ``mountinfo``: the text of
    /proc/self/mountinfo (read where not given; no such file: None)."""
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text()
        except OSError:
            return None
    best: tuple[str, str, set[str]] | None = None
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts, rest = fields.split(), tail.split()
        if len(parts) < 6 or len(rest) < 3:
            continue
        # Octal escapes (a space is \040) in the mount point
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), parts[4])
        inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) > len(best[0])):
            best = (point, rest[0], set(parts[5].split(",")) | set(rest[2].split(",")))
    if best is None:
        return None
    point, kind, options = best
    if kind == "lustre" and "localflock" in options:
        return point, "Lustre mounted with localflock", "mount it with -o flock"
    local = sorted(options & {"nolock", "local_lock=flock", "local_lock=all"})
    if kind in ("nfs", "nfs4") and local:
        return point, f"NFS mounted with {local[0]}", "mount it with local_lock=none and locks"
    return None
