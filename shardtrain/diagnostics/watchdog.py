"""A per-rank watchdog thread: stack dumps for stalls, a hard stop for hangs.

The training thread calls ``beat(phase)`` when a step (or an evaluation, or a save) starts and
``done(seconds)`` when a step ends. If the current phase runs longer than ``stall_factor`` times the
median of recent steps (and at least ``stall_min_s``), every thread's Python stack is written to
``run.dir/stalls/`` once for that phase. If it runs longer than the timeout (``startup_timeout_s``
until the first step has finished, ``timeout_s`` after), the stacks go to ``run.dir/hangs/``, a
failure record is written, and the process exits with status 124, so a hung collective cannot keep
a job alive forever whatever the backend's own timeout is.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import statistics
import threading
import time
from collections import deque
from pathlib import Path

from shardtrain.diagnostics.failures import record_failure

log = logging.getLogger("shardtrain")
HANG_EXIT_STATUS = 124


def dump_stacks(path: Path, header: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(header + "\n\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, timeout_s: float, startup_timeout_s: float,
                 stall_factor: float, stall_min_s: float, poll_s: float = 0.25) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.stall_factor = stall_factor
        self.stall_min_s = stall_min_s
        self.poll_s = poll_s
        self.recent: deque[float] = deque(maxlen=20)
        self.phase = "start-up"
        self.step = 0
        self.started = time.monotonic()
        self.stall_dumped = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="shardtrain-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def beat(self, phase: str, step: int) -> None:
        with self._lock:
            self.phase, self.step = phase, step
            self.started = time.monotonic()
            self.stall_dumped = False

    def done(self, seconds: float) -> None:
        with self._lock:
            self.recent.append(seconds)

    def limits(self) -> tuple[float, float]:
        timeout = self.timeout_s if self.recent else self.startup_timeout_s
        stall = max(self.stall_min_s, self.stall_factor * statistics.median(self.recent)) \
            if self.recent else timeout
        return stall, timeout

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                elapsed = time.monotonic() - self.started
                phase, step, dumped = self.phase, self.step, self.stall_dumped
                stall, timeout = self.limits()
            where = f"{phase} of step {step}"
            if elapsed > timeout:
                message = (f"rank {self.rank}: {where} has run {elapsed:.0f}s, over the "
                           f"{timeout:.0f}s limit (dist.timeout_s / dist.startup_timeout_s); stopping")
                path = self.run_dir / "hangs" / f"rank-{self.rank}.txt"
                dump_stacks(path, message)
                record_failure(self.run_dir, self.rank, step, "Timeout", f"{message}; stacks in {path}")
                log.error("%s; stacks in %s", message, path)
                logging.shutdown()
                os._exit(HANG_EXIT_STATUS)
            if elapsed > stall and not dumped:
                path = self.run_dir / "stalls" / f"rank-{self.rank}-step-{step}.txt"
                median = statistics.median(self.recent) if self.recent else 0.0
                dump_stacks(path, f"rank {self.rank}: {where} has run {elapsed:.1f}s; recent steps "
                                  f"took {median:.2f}s (median)")
                log.warning("rank %d: %s is slow (%.1fs, recent median %.2fs); Python stacks in %s",
                            self.rank, where, elapsed, median, path)
                with self._lock:
                    self.stall_dumped = True
