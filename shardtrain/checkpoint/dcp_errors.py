"""DCP's failures as one line that names the rank, the cause and the fix.

``dcp.save`` and ``dcp.load`` gather every rank's exception into a ``CheckpointException``, whose text
starts "CheckpointException ranks:dict_keys([0, 1])" and then holds a traceback per rank. It derives
from ``BaseException``, so ``except Exception`` lets it through: the user got that first line and no
cause. These helpers find the first failed rank's own exception and say it in one line.
"""

from __future__ import annotations

import errno
import os
import re

import torch
from torch.distributed.checkpoint.api import CheckpointException

from shardtrain.accelerator import is_out_of_memory
from shardtrain.errors import os_error_code

# What the callers catch around DCP: its own gathered failures, and anything raised before (or
# outside) its collectives, such as a storage error while setting up.
DCP_FAILURES = (CheckpointException, Exception)


def failure_causes(exc: CheckpointException) -> dict[int, BaseException]:
    """Each failed rank's own exception in DCP's gathered one (its ``failures`` values are
    (exception, stack summary) pairs)."""
    causes = {rank: f[0] if isinstance(f, tuple) and f else f for rank, f in (exc.failures or {}).items()}
    return {rank: cause for rank, cause in sorted(causes.items()) if isinstance(cause, BaseException)}


def raise_if_interrupted(exc: BaseException) -> None:
    """Ctrl-C inside ``dcp.save``/``dcp.load``: DCP gathers the KeyboardInterrupt into its
    ``CheckpointException`` like any failure, and the save was reported failed, "check run.dir's
    filesystem", exit 2 (found by a trial); raised as the interruption it is (exit 130)."""
    pending: list[BaseException] = [exc]
    for _ in range(64):  # bounded: nested failures are few, and a cycle must not loop
        if not pending:
            return
        current = pending.pop()
        if isinstance(current, KeyboardInterrupt):
            raise KeyboardInterrupt from exc
        if isinstance(current, CheckpointException):
            pending += failure_causes(current).values()


def first_failure(exc: BaseException) -> tuple[int | None, BaseException]:
    """(rank, exception) of the lowest rank DCP reports failed, or (None, ``exc``) for an exception
    that is not DCP's gathered kind; nested ``CheckpointException``s are unwrapped too."""
    rank: int | None = None
    seen = 0
    while isinstance(exc, CheckpointException) and seen < 8:  # bounded: never loops on a cycle
        seen += 1
        causes = failure_causes(exc)
        if not causes:
            break
        rank, exc = next(iter(causes.items()))
    return rank, exc


def describe(exc: BaseException) -> str:
    """One line for an exception: an OSError's own text ("[Errno 28] No space left on device"), a
    Rust library's I/O error as the same, else its type and the first line of its message (torch's
    weights-only refusal reduced to what it refused, not its page of advice)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return str(exc).splitlines()[0] if str(exc) else f"[Errno {exc.errno}] {exc.strerror}"
    if (code := os_error_code(exc)) is not None:
        return f"[Errno {code}] {os.strerror(code)}"
    text = str(exc)
    refused = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    line = refused.group(1) if refused else next((s for s in text.splitlines() if s.strip()), "")
    return f"{type(exc).__name__}: {line.strip()}" if line else type(exc).__name__


def save_fix(exc: BaseException) -> str:
    """What the user can do about a save that failed with ``exc`` (an underlying exception)."""
    code = os_error_code(exc)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "free space on run.dir's filesystem (or raise its quota)"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make run.dir's checkpoints directory writable"
    if code == errno.EFBIG:
        return "raise the file size limit (ulimit -f) above a checkpoint file's size"
    if isinstance(exc, MemoryError) or is_out_of_memory(exc) and not isinstance(exc, torch.OutOfMemoryError):
        # The host's memory (found by review: told to report a defect); an async save copies the
        # state there, a synchronous one does not
        return ("free host memory (an async save copies this rank's model and optimizer state into it; "
                "checkpoint.async=false saves without that copy)")
    if code is None and not isinstance(exc, OSError):
        # A TypeError recording a task's option was told to check the filesystem (found by a trial).
        return ("this is no filesystem failure but a value the checkpoint cannot hold, or a defect (in "
                "the task's code or shardtrain's): report it")
    return "check run.dir's filesystem (free space, permissions, what is in its checkpoints directory)"


def failed_where(exc: BaseException, rank: int | None) -> tuple[str, BaseException]:
    """(" on rank N", cause): the rank DCP names as the first failed one, else ``rank`` (this
    rank's own failure; "" where none is known), and that rank's own exception."""
    failed, cause = first_failure(exc)
    rank = failed if failed is not None else rank
    return (f" on rank {rank}" if rank is not None else ""), cause


def save_failed(step: int, tmp, exc: BaseException, intact: str | None, rank: int | None = None) -> str:
    """The message of a save of ``step`` into ``tmp`` that failed with ``exc`` (DCP's, or this
    ``rank``'s own); ``intact`` names the newest complete checkpoint, which the save did not touch."""
    where, cause = failed_where(exc, rank)
    cause = underlying_os_error(cause)
    kept = f"{intact} is intact" if intact else "no earlier checkpoint of this run exists"
    return f"saving step {step} to {tmp} failed{where}: {describe(cause)}; {save_fix(cause)} ({kept})"


def underlying_os_error(exc: BaseException) -> BaseException:
    """The OSError a failed write raised beneath ``exc``, if any, else ``exc``: DCP's writer reports a
    full disk as torch's "[enforce fail at inline_container.cc] unexpected pos" with the ENOSPC only
    in its context (found by review: a full disk got the generic advice). A write's failure only: a
    read's context may hold an expected, handled OSError."""
    found, seen = exc, 0
    while found is not None and seen < 8:  # bounded: never loops on a cycle
        if isinstance(found, OSError) and found.errno is not None:
            return found
        found, seen = found.__cause__ or found.__context__, seen + 1
    return exc


def load_failed(path, exc: BaseException, fix: str, rank: int | None = None) -> str:
    """The message of a read of the checkpoint at ``path`` that failed with ``exc`` (DCP's, or this
    ``rank``'s own)."""
    where, cause = failed_where(exc, rank)
    return f"reading checkpoint {path} failed{where}: {describe(cause)}; {fix}"
