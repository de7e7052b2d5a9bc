"""Fault injection for tests: make one rank fail at a named point of chosen steps.

``SHARDTRAIN_FAULT=<point>:<rank>:<steps>:<action>[:<attempt>]`` (several: comma-separated, the
first that matches acts) where steps is ``N`` or ``A-B``,
action is ``kill`` (SIGKILL itself), ``raise`` (RuntimeError), ``sleep=S`` (stall S seconds),
``signal=NAME`` (send itself that signal, e.g. a preemption's SIGTERM), ``interrupt`` (raise
KeyboardInterrupt, as Ctrl-C does: a SIGINT is ignored by a process a background shell started) or
``nan`` (poison the loss;
point ``loss`` only), and attempt (optional) limits the fault to that
torchrun restart attempt (``TORCHELASTIC_RESTART_COUNT``), so a restarted run can get past it.
Points: ``save`` (inside a checkpoint save, after this rank wrote part of it), ``commit`` (in an
async save's background thread, after DCP wrote it, before the commit), ``resume`` (as a checkpoint
of the given step is loaded, after its checks), ``step`` (after a
training step), ``sample`` (before a text sample is generated), ``loss`` (the first micro-batch's
loss), ``init_from`` (step 0: before this rank reads the initial weights). Unset, this costs one
dictionary lookup. Never set it in production.
"""

from __future__ import annotations

import os
import signal
import time

import torch

ENV = "SHARDTRAIN_FAULT"


def _match(point: str, rank: int, step: int) -> str | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    for fault in filter(None, (entry.strip() for entry in spec.split(","))):  # "a," has an empty one
        want_point, want_rank, steps, action, *attempt = fault.split(":")
        first, _, last = steps.partition("-")
        if want_point != point or int(want_rank) != rank:
            continue
        if attempt and int(attempt[0]) != int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)):
            continue
        if int(first) <= step <= int(last or first):
            return action
    return None


def inject(point: str, rank: int, step: int) -> None:
    action = _match(point, rank, step)
    if action is None:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action.startswith("signal="):
        os.kill(os.getpid(), getattr(signal, action.split("=", 1)[1]))
        return
    if action.startswith("sleep="):
        time.sleep(float(action.split("=", 1)[1]))
        return
    if action == "interrupt":  # Ctrl-C as Python delivers it; a SIGINT a background shell ignores is lost
        raise KeyboardInterrupt
    raise RuntimeError(f"injected fault: rank {rank} failed at {point} of step {step} ({ENV})")


def poison_loss(rank: int, step: int, loss: torch.Tensor) -> torch.Tensor:
    return loss * float("nan") if _match("loss", rank, step) == "nan" else loss
