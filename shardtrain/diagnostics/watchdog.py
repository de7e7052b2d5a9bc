"""A per-rank watchdog thread: stack dumps for stalls, a hard stop for hangs.

The training thread calls ``beat(phase)`` when a step (or an evaluation, or a save) starts and
``done(seconds)`` when a step ends. If the current phase runs longer than ``stall_factor`` times the
median of recent steps (and at least ``stall_min_s``), every thread's Python stack is written to
``run.dir/stalls/`` once for that phase. If it runs longer than the timeout (the phase's own, given
to ``beat``, e.g. ``checkpoint.save_timeout_s`` for saves; else ``startup_timeout_s`` until the first
step has finished, ``timeout_s`` after), the stacks go to ``run.dir/hangs/``, the collective flight
recorder (when enabled) to ``run.dir/flight_recorder/``, a failure record is written, and the
process exits with status 124, so a hung collective cannot keep a job alive forever whatever the
backend's own timeout is.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from shardtrain.diagnostics.failures import record_failure, write_whole

log = logging.getLogger("shardtrain")
HANG_EXIT_STATUS = 124


def stacks_text(header: str) -> str:
    """Every thread's Python stack under ``header``, as text: made in memory, so that writing it to a
    stalled filesystem blocks only the writing thread (faulthandler writes holding the GIL)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = [header, ""]
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {ident:#x} ({names.get(ident, 'unnamed')}), most recent call last:")
        parts += [line.rstrip("\n") for line in traceback.format_stack(frame)]
        parts.append("")
    return "\n".join(parts)


def dump_stacks(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, text)


# How long the watchdog waits for each piece of evidence it writes into run.dir before it stops.
EVIDENCE_WAIT_S = 30.0
MESSAGE_WAIT_S = 5.0  # ... and for its last message to reach stderr
# The longest a stop takes once its bound has passed: stacks, flight recorder, failure record, message.
# The process group's own timeout is this much longer than the watchdog's bounds, so that the
# watchdog's stop, with its evidence and status 124, comes first.
STOP_WAIT_S = 3 * EVIDENCE_WAIT_S + MESSAGE_WAIT_S


def bounded(work: Callable[[], None], name: str, wait_s: float | None = None) -> bool:
    """``work()`` in a thread, waited for at most ``wait_s``; whether it finished. A stalled shared
    filesystem is a common cause of a hang, and run.dir is on it: writing the evidence there must
    not keep the watchdog from stopping the process."""
    ended, succeeded = threading.Event(), []

    def run() -> None:
        try:
            work()
            succeeded.append(True)
        except Exception:  # noqa: BLE001 - evidence is best effort: the stop is what matters
            pass
        finally:
            ended.set()

    threading.Thread(target=run, name=f"shardtrain-{name}", daemon=True).start()
    return ended.wait(EVIDENCE_WAIT_S if wait_s is None else wait_s) and bool(succeeded)


def flight_recorder_trace() -> bytes:
    """This process's collective flight recorder, pickled as torch's own dumps are.

    Private torch APIs, and the watchdog's one backend branch: NCCL keeps its own recorder
    (``_dump_nccl_trace``, CUDA builds only, never run here); gloo records into the CPU one
    (``_dump_fr_trace``). Both fill only while ``TORCH_FR_BUFFER_SIZE`` (or
    ``TORCH_NCCL_TRACE_BUFFER_SIZE``) is above 0.
    """
    c10d = torch._C._distributed_c10d
    # "nccl", or "cpu:gloo,cuda:nccl" when CPU offload adds a CPU backend: NCCL runs the training.
    if dist.is_initialized() and "nccl" in dist.get_backend():
        return c10d._dump_nccl_trace()
    return c10d._dump_fr_trace()


def dump_flight_recorder(prefix: str, rank: int, wait_s: float | None = None) -> Path | None:
    """Write the flight recorder to ``<prefix><rank>`` (the name NCCL's own dump on timeout uses).

    ``bounded``: on a hung backend the dump itself might block, and nothing may keep the watchdog
    from stopping the process. None if it failed or did not finish within ``wait_s``.
    """
    path = Path(f"{prefix}{rank}")

    def write() -> None:
        data = flight_recorder_trace()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    return path if bounded(write, "flight-recorder", wait_s) else None


# How a hang's message says that its rank waits for another (``stop_hung`` records it as fallout).
WAITING_IN_COLLECTIVE = "waiting in the collective"


def main_thread_location() -> str:
    """Where the main thread is, for a hang's message: the innermost call of shardtrain's (or the
    user's) code, and whether it is waiting inside a torch.distributed collective. A rank waiting
    for a stuck peer times out too, sometimes first: this tells the waiting rank from the stuck one
    without reading the stacks."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    calls = []
    while frame is not None:
        calls.append((frame.f_code.co_filename, frame.f_code.co_name))
        frame = frame.f_back
    own = next(((Path(file).name, name) for file, name in calls if "torch" not in Path(file).parts),
               (Path(calls[0][0]).name, calls[0][1]))
    collective = next((name for file, name in calls if Path(file).name == "distributed_c10d.py"), None)
    where = f"its main thread is in {own[1]} ({own[0]})"
    if collective is not None:
        return f"{where}, {WAITING_IN_COLLECTIVE} {collective}: another rank may be the one stuck"
    return where


# Stall dumps one rank writes in a run: every rank dumps at each slow phase (the slow one shows
# where it is, the others the collective they wait in), and a flaky node slowing step after step
# made a thousand files a step at 1,024 ranks, without end. The first ones hold the evidence.
MAX_STALL_DUMPS = 10


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, timeout_s: float, startup_timeout_s: float,
                 stall_factor: float, stall_min_s: float, poll_s: float = 0.25,
                 flight_recorder: bool = False) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.stall_factor = stall_factor
        self.stall_min_s = stall_min_s
        self.poll_s = poll_s
        self.flight_recorder = flight_recorder
        self.recent: deque[float] = deque(maxlen=20)
        self.phase = "start-up"
        self.step = 0
        self.steps_done = 0
        self.phase_limit: tuple[float, str] | None = None  # (seconds, config key) from beat
        self.started = time.monotonic()
        self.stall_dumped = False
        self.stall_dumps = 0  # dumped in this run, up to MAX_STALL_DUMPS
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("the watchdog is already watching: stop it first")
        with self._lock:  # the start-up bound runs from here, not from construction (a resume's load)
            self.started = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="shardtrain-watchdog", daemon=True)
        self._thread.start()
        return self

    @contextmanager
    def watching(self, phase: str, timeout_s: float, key: str) -> Iterator[None]:
        """``phase`` bounded by ``timeout_s`` before the watch proper starts (a resume inside
        ``Trainer.create``: its checkpoint reads and collectives); unwatched again after it."""
        self.start()
        self.beat(phase, 0, timeout_s, key)
        try:
            yield
        finally:
            self.stop()
            self._thread.join()  # within one poll: start() makes the next thread
            with self._lock:
                self.phase, self.phase_limit = "start-up", None

    def stop(self) -> None:
        self._stop.set()

    def beat(self, phase: str, step: int, timeout_s: float | None = None,
             key: str = "the phase's own limit", under_way: bool = False) -> None:
        """``phase`` of ``step`` starts now. ``timeout_s`` (the config ``key`` that set it, for the
        message) bounds this phase instead of the step bound; the next beat without it returns to
        the step bound. ``under_way``: ``step`` is the step being trained, not one done (a failure
        record counts the steps done)."""
        with self._lock:
            self.phase, self.step = phase, step
            self.steps_done = step - 1 if under_way else step
            self.phase_limit = None if timeout_s is None else (timeout_s, key)
            self.started = time.monotonic()
            self.stall_dumped = False

    def done(self, seconds: float) -> None:
        with self._lock:
            self.recent.append(seconds)

    def limits(self) -> tuple[float, float, str]:
        """(stall, timeout, the config key of the timeout) for the current phase.

        A phase with a limit of its own (a checkpoint save) is not a step: comparing it with the
        steps' median would call every large save a stall (seen: a 1.1B model's final save). Its
        stacks are dumped at half its limit instead, still well before the stop.
        """
        if self.phase_limit is not None:
            timeout, key = self.phase_limit
            return timeout / 2, timeout, key
        if self.recent:
            timeout, key = self.timeout_s, "dist.timeout_s"
        elif self.startup_timeout_s >= self.timeout_s:
            timeout, key = self.startup_timeout_s, "dist.startup_timeout_s"
        else:  # the first step never has less than the others (found by a review: 600 s of 1800)
            timeout, key = self.timeout_s, "dist.timeout_s"
        # At most half the timeout: steps of 30 s made the stall bound (10 x median) the timeout
        # itself, and the hang stopped the process before any stall evidence (found by a review).
        stall = min(max(self.stall_min_s, self.stall_factor * statistics.median(self.recent)), timeout / 2) \
            if self.recent else timeout
        return stall, timeout, key

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                elapsed = time.monotonic() - self.started
                phase, step, dumped, steps_done = self.phase, self.step, self.stall_dumped, self.steps_done
                stall, timeout, key = self.limits()
                median = statistics.median(self.recent) if self.recent else 0.0
                if elapsed > stall and not dumped:
                    self.stall_dumped = True  # this phase's, decided under the lock a beat takes
                    self.stall_dumps += 1
                dumps = self.stall_dumps
            where = f"{phase} of step {step}" if step else phase
            # A main thread that stopped the watch meanwhile has left the phase (finished it, or a
            # peer's exit failed its collective and it is unwinding): not a hang of this rank.
            if elapsed > timeout and not self._stop.is_set():
                self.stop_hung(steps_done, f"rank {self.rank}: {where} has run {elapsed:.0f}s, over the "
                                     f"{timeout:g}s limit ({key}); {main_thread_location()}; stopping")
            if elapsed > stall and not dumped and dumps <= MAX_STALL_DUMPS:
                # Written and said by a thread of its own: a stalled filesystem or stderr (where the
                # warning goes) must not hold up the hang check above.
                header = (f"rank {self.rank}: {where} has run {elapsed:.1f}s; recent steps took "
                          f"{median:.2f}s (median)")
                threading.Thread(target=self.report_stall, name="shardtrain-stall-report", daemon=True,
                                 args=(self.stall_file(phase, step), stacks_text(header), where, elapsed,
                                       median, dumps == MAX_STALL_DUMPS)).start()

    def stall_file(self, phase: str, step: int) -> Path:
        """Where a stall of ``phase`` at ``step`` is written: a training step's by its step alone, any
        other phase's (an evaluation, a save at the same step) under its own name beside it."""
        slug = "" if phase == "training step" else "-" + "-".join(re.findall(r"[a-z0-9]+", phase.lower()))
        return self.run_dir / "stalls" / f"rank-{self.rank}-step-{step}{slug}.txt"

    def report_stall(self, path: Path, text: str, where: str, elapsed: float, median: float,
                     last: bool = False) -> None:
        """``last``: the run's last dump (``MAX_STALL_DUMPS``), which says that later slow phases
        go unreported."""
        written = bounded(functools.partial(dump_stacks, path, text), "stall-dump")
        log.warning("rank %d: %s is slow (%.1fs, recent median %.2fs); %s%s", self.rank, where, elapsed,
                    median, f"Python stacks in {path}" if written else
                    f"its Python stacks could not be written to {path} in {EVIDENCE_WAIT_S:g}s",
                    f"; the {MAX_STALL_DUMPS}th stall of this rank: later ones are neither dumped nor "
                    "said (the hang bound still stops a stuck phase)" if last else "")

    def stop_hung(self, step: int, message: str) -> None:
        """Leave the evidence (stacks, flight recorder, failure record), each written within
        ``EVIDENCE_WAIT_S`` or given up, and exit with status 124. ``step``: the steps done."""
        detected = time.time()  # the record's time: not after up to a minute of evidence writes
        path = self.run_dir / "hangs" / f"rank-{self.rank}.txt"
        text = stacks_text(message)
        stacks = (f"stacks in {path}" if bounded(lambda: dump_stacks(path, text), "hang-dump")
                  else f"stacks could not be written to {path} in {EVIDENCE_WAIT_S:g}s")
        # We stop before the process group's own (longer) timeout, and so before NCCL's own dump.
        evidence = f"{stacks}{self.dump_flight_recorder()}"
        # A rank waiting in a collective for a stuck peer is that peer's fallout, not the root cause
        # the launcher names (found by a review: the waiting ranks, quick to record, were named first).
        waiting = WAITING_IN_COLLECTIVE in message
        bounded(lambda: record_failure(self.run_dir, self.rank, step, "Timeout", f"{message}; {evidence}",
                                      exit_status=HANG_EXIT_STATUS, fallout=waiting, when=detected),
                "failure-record")
        # Said within a bound as well: a stalled stderr (a pipe nobody drains, a log file on the
        # stalled filesystem) would block the message, and with it the exit, forever.
        def say() -> None:
            log.error("%s; %s", message, evidence)
            logging.shutdown()

        bounded(say, "hang-message", MESSAGE_WAIT_S)
        os._exit(HANG_EXIT_STATUS)

    def dump_flight_recorder(self) -> str:
        """With ``dist.flight_recorder``, dump it where NCCL's own dump would go; say where, for the
        failure message (empty when off)."""
        if not self.flight_recorder:
            return ""
        prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or str(self.run_dir / "flight_recorder" / "rank_")
        path = dump_flight_recorder(prefix, self.rank)
        return f", flight recorder in {path}" if path else ", flight recorder dump failed"
