"""Ranks that check something each on their own, then stop or go on together.

A check that fails on one rank only (a damaged file in its share, an unreadable RNG file) must stop
every rank at once: a rank that raises alone leaves the others waiting in the next collective until
the process group's timeout. One all-gather of each rank's verdict, then every rank raises the same
error, or none does.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from shardtrain.errors import ShardtrainError

T = TypeVar("T")


def gather_verdicts(error: str | None, detail: Any = None,
                    group: dist.ProcessGroup | None = None) -> list[tuple[str | None, Any]]:
    """Every rank's ``(error, detail)`` in rank order, on every rank (one all-gather); this rank's
    alone where no process group runs."""
    if not dist.is_initialized():
        return [(error, detail)]
    verdicts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, (error, detail), group=group)
    return verdicts


def raise_first_error(verdicts: list[tuple[str | None, Any]], error_type: type[ShardtrainError]) -> None:
    """Raise the lowest failed rank's error as ``error_type``, the same on every rank, if any failed
    (also with an empty message: ``str(OSError())`` is one)."""
    failed = [(rank, error) for rank, (error, _) in enumerate(verdicts) if error is not None]
    if failed:
        rank, error = failed[0]
        raise from_rank(error_type(error or f"a check failed on rank {rank} without saying why"), rank)


def from_rank(exc: BaseException, rank: int) -> BaseException:
    """``exc``, marked as raised on every rank for ``rank``'s failure: another rank's failure record
    of it is fallout, which the launcher does not name as the root cause (``failed_rank``)."""
    exc.failed_rank = rank
    return exc


def agree(error: str | None, detail: Any = None, group: dist.ProcessGroup | None = None, *,
          error_type: type[ShardtrainError]) -> list[Any]:
    """Every rank's ``detail`` in rank order, or the lowest failed rank's ``error`` raised as
    ``error_type`` on every rank together."""
    verdicts = gather_verdicts(error, detail, group)
    raise_first_error(verdicts, error_type)
    return [detail for _, detail in verdicts]


def run_agreed(action: Callable[[], T], group: dist.ProcessGroup | None = None) -> T:
    """``action()`` on every rank (rank 0's file writes, its trackers' start, a task's own data
    code), then one all-gather of how it went: where it raised on some rank, every rank raises the
    lowest such rank's (``raise_agreed``), so the others do not go on into a collective it never
    joins. Returns this rank's result."""
    result, failure = attempt(action)
    raise_agreed(failure, group)
    return result


def attempt(action: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """``action()``'s result, or the exception it raised (held, for ``raise_agreed`` once every rank
    can learn of it)."""
    try:
        return action(), None
    except Exception as exc:  # a task's ValueError on one node too: not the others' wait until the timeout
        return None, exc


def raise_agreed(failure: Exception | None, group: dist.ProcessGroup | None = None) -> None:
    """One all-gather of each rank's ``failure`` (None: this rank's part went well); where some
    rank's is not None, every rank raises the lowest such rank's, of its class and with its
    arguments where it is a ``ShardtrainError`` or an ``OSError`` (an OSError's errno; any other as
    a ``ShardtrainError`` with its message), that rank its own exception."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    error = None if failure is None else str(failure) or type(failure).__name__
    if failure is not None and not isinstance(failure, (ShardtrainError, OSError)):
        error = f"{type(failure).__name__} on rank {rank}: {error}"  # the others raise it as a message
    detail = None
    if failure is not None:  # plain values only: pickling anything else could fail on this rank alone
        plain = all(isinstance(arg, (str, int, float, type(None))) for arg in failure.args)
        kind = type(failure) if isinstance(failure, (ShardtrainError, OSError)) and picklable(
            type(failure)) else None
        # The rank whose failure it is: an agreed error raised inside the action (a nested check)
        # names its own, so that rank's record is the root cause and the others' fallout.
        detail = (kind, failure.args if plain else (error,), getattr(failure, "failed_rank", rank))
    verdicts = gather_verdicts(error, detail, group)
    failed = next((rank for rank, (error, _) in enumerate(verdicts) if error is not None), None)
    if failed is None:
        return
    if failure is not None and failed == rank:
        raise failure
    error, detail = verdicts[failed]
    origin = detail[2] if isinstance(detail, tuple) and len(detail) == 3 else failed
    raise from_rank(rebuilt(error, detail), origin)


def rebuilt(error: str, detail: Any) -> BaseException:
    """The failed rank's exception from its class and arguments; a ShardtrainError with its message
    where that cannot be (a class whose constructor takes other arguments, or a verdict that is not
    run_agreed's, from ranks that reached different collectives)."""
    try:
        kind, args, _ = detail
        if isinstance(kind, type) and issubclass(kind, (ShardtrainError, OSError)):
            return kind(*args)
    except (TypeError, ValueError):
        pass
    return ShardtrainError(error)


def picklable(kind: type) -> bool:
    """Whether the class goes through the all-gather (one defined inside a function does not)."""
    try:
        pickle.dumps(kind)
    except Exception:  # PicklingError, AttributeError: the class cannot be found by its name
        return False
    return True
