"""Preemption signals caught from a command's first moment, before its own handlers are in."""

from __future__ import annotations

import os
import signal


class EarlySignals:
    """The default preemption signals, caught from the command's first moment: until the run's own
    handler is in (the launcher's, or the trainer's), after the config and torch are loaded, a
    preemption signal killed the process without a word, and a Slurm job signalled then was never
    requeued (found by a trial). A signal ignored here (a worker under the built-in launcher's agent)
    stays ignored: the launcher delivers it."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.caught: list[int] = []
        self.previous: dict[int, object] = {}
        for name in names:
            sig = getattr(signal, name)
            if signal.getsignal(sig) is signal.SIG_DFL:
                self.previous[sig] = signal.signal(sig, self.catch)

    def catch(self, signum: int, frame: object) -> None:
        self.caught.append(signum)

    def hand_over(self, handled: set[int] = frozenset()) -> dict[int, object]:
        """Once whoever acts on the ``handled`` signals has its handlers in (and has read
        ``caught``): the others get their handlers back, and a caught one among them is raised again
        (it would have stopped the process). Returns the handlers the ``handled`` ones had before
        this, for the taker to put back when it is done (not ``catch``: a signal after training
        would be swallowed)."""
        originals = {sig: previous for sig, previous in self.previous.items() if sig in handled}
        for sig, previous in self.previous.items():
            if sig not in handled:
                signal.signal(sig, previous)
        self.previous.clear()
        for sig in dict.fromkeys(self.caught):
            if sig not in handled:
                os.kill(os.getpid(), sig)
        return originals
