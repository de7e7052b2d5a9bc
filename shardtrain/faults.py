"""Fault injection for tests: make one rank die or raise at a named point of a chosen step.

Set ``SHARDTRAIN_FAULT=<point>:<rank>:<step>:<action>`` (action ``kill`` = SIGKILL itself, ``raise``
= RuntimeError). Points: ``save`` (inside a checkpoint save, after this rank wrote part of it) and
``step`` (after a training step). Unset, this costs one dictionary lookup. Never set it in production.
"""

from __future__ import annotations

import os
import signal

ENV = "SHARDTRAIN_FAULT"


def inject(point: str, rank: int, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    want_point, want_rank, want_step, action = spec.split(":")
    if (want_point, int(want_rank), int(want_step)) != (point, rank, step):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault: rank {rank} failed at {point} of step {step} ({ENV})")
