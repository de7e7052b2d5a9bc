"""Preemption: a signal sets a flag; all ranks agree on it at a step boundary, save and stop.

The handler does nothing but set the flag (no I/O, no collectives inside a signal handler). Ranks
may receive the signal at different moments, so the decision is an all-reduce (MAX) at the next step
boundary: every rank then takes the same path.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class PreemptionFlag:
    def __init__(self, signal_names: list[str], device: torch.device) -> None:
        self.device = device
        self.requested = False
        self.signal_name: str | None = None
        self._previous = {}
        for name in signal_names:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def agreed(self) -> bool:
        """True on every rank if any rank was signalled (a collective: call on all ranks)."""
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

