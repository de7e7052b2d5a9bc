"""Preemption: a signal sets a flag; all ranks agree on it at a step boundary, save and stop.

The handler does nothing but set the flag (no I/O, no collectives inside a signal handler). Ranks
may receive the signal at different moments, so the decision is a sum over ranks of their flags,
carried by the training step's own loss all-reduce (``train_step(stop_requested=...)``): every rank
then takes the same path after that step, at no extra collective or host synchronisation.
"""

from __future__ import annotations

import os
import signal

# torchrun's agent sets it from --signals-to-handle (default SIGTERM,SIGINT,SIGHUP,SIGQUIT), and its
# workers inherit it: the signals the agent acts on itself.
AGENT_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"


def handled_by_the_agent(signal_names: list[str]) -> list[str]:
    """The preemption signals torchrun's agent handles itself: on one it stops the workers as a
    failure and SIGKILLs them after its shutdown timeout (30 s), cutting a preemption's save short."""
    handled = {name.strip() for name in os.environ.get(AGENT_SIGNALS_ENV, "").split(",")}
    return [name for name in signal_names if name in handled]


class PreemptionFlag:
    def __init__(self, signal_names: list[str]) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self._previous = {}
        for name in signal_names:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def signals(self) -> list[int]:
        return list(self._previous)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def take(self, caught: list[int], originals: dict[int, object]) -> None:
        """Signals of this flag's caught before it was set up (the command's first moments), and the
        handlers its signals had before that catcher, which ``restore`` puts back."""
        for signum in caught:
            if signum in self._previous:
                self._handle(signum, None)
        self._previous.update({sig: handler for sig, handler in originals.items() if sig in self._previous})

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

