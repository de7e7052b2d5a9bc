"""Start the right number of processes on torchrun, never on a launcher protocol of our own.

``trainer.devices=N`` outside torchrun runs the same command under
``torch.distributed.run --standalone --nproc-per-node N`` and returns its exit status. Multi-node runs
are started by the user (or Slurm) with torchrun on every node; then we only check that the world
torchrun built matches the config.

Preemption signals (``checkpoint.preemption_signals``) must reach the training processes, which save
and exit 0, and must not make torchrun's agent tear the job down as a failure. So the agent runs in
its own session with those signals ignored and left out of ``--signals-to-handle``, and this
process forwards them to the agent's worker processes (which torchrun starts in sessions of their
own, so a process-group signal would not reach them). Finding the workers reads /proc (Linux).
The signals the agent handles (SIGTERM when it is not a preemption signal, ``AGENT_SIGNALS``) are
forwarded to the agent, which stops its workers: this process must not die of them first, leaving
the agent and its workers running. An agent that dies of a signal itself (SIGKILL) leaves its
workers orphaned and training; this process sends them the first preemption signal.

The agent is this process forked, running ``python -m torch.distributed.run`` (``runpy``), not a new
interpreter: this process has imported torch for its checks already, and a new one would spend 1.6 s
(on one core) importing it again before the workers start. The fork happens before this process
starts a thread; torch's own native threads are those a DataLoader's forked workers inherit too, and
the agent does no tensor work. The workers are new interpreters, as torchrun makes them.

Console: the workers' log lines (``[shardtrain ...]``) are shown as they come; everything else the
agent and the workers write to stderr (tracebacks, every rank's copy of an error, torchrun's
``ChildFailedError`` report) goes to a log file under ``run.dir/logs/``, and the caller prints one
line naming the rank that failed first. The agent's stderr is read to its end even when the log or
the console can no longer be written.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import re
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from shardtrain.cli.early_signals import EarlySignals
from shardtrain.config.plan import check_world, launch_shape
from shardtrain.config.schema import Config
from shardtrain.distributed.env import (
    check_manual_launch_shape,
    check_not_one_of_many,
    under_torchrun,
)
from shardtrain.errors import ConfigError
from shardtrain.logs import LOG_PREFIX

log = logging.getLogger("shardtrain")
# Set for the workers of the built-in launcher (trainer.devices=N), whose trainer.max_restarts is the
# agent's --max-restarts.
BUILT_IN_LAUNCH = "SHARDTRAIN_BUILT_IN_LAUNCH"

AGENT_SIGNALS = ("SIGINT", "SIGHUP", "SIGQUIT")
# Other signals that end a process by default (a batch system's warning signal, CPU-time and
# file-size limits): left at their default they killed this process alone, and the agent (in a
# session of its own) and the workers trained on, orphaned. The agent is asked to stop instead, by a
# signal it handles: SIGTERM, or SIGHUP where SIGTERM is a preemption signal (the agent ignores it).
STOPPING_SIGNALS = tuple(getattr(signal, name) for name in (
    "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGXCPU", "SIGXFSZ", "SIGPWR")
    if hasattr(signal, name))
# How a command's last line to stderr begins (cli/main.py), a worker's too.
COMMAND_END = "shardtrain: "
ERROR_START = f"{COMMAND_END}error: "
# A worker of a multi-process world names its rank in its error line (cli/main.py error_line).
RANK_TAG = re.compile(re.escape(ERROR_START) + r"\[rank \d+\] ")


# The module the agent runs, as ``python -m`` would.
AGENT_MODULE = "torch.distributed.run"


def torchrun_args(nproc: int, command: list[str], preemption_signals: Sequence[str],
                  max_restarts: int = 0) -> list[str]:
    # The agent handles (stops its workers on) every signal that is not a preemption signal.
    handled = [s for s in ("SIGTERM", *AGENT_SIGNALS) if s not in preemption_signals]
    return ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            f"--signals-to-handle={','.join(handled)}", "-m", "shardtrain", *command]


def agent_env(max_restarts: int) -> dict[str, str]:
    """What the agent's environment adds to this process's."""
    env = {BUILT_IN_LAUNCH: "1"}
    if max_restarts:
        # The agent's shared store survives restarts and hands a restarted attempt the dead
        # attempt's keys (pytorch/pytorch#135712); without sharing, each attempt has its own store.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_call() -> Callable[..., int] | None:
    """libc's ``prctl`` on Linux (looked up before a fork: a dynamic-loader lookup in the child of a
    threaded process may deadlock), else None."""
    return ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def stop_when_parent_dies(prctl: Callable[..., int] | None, sig: int, parent: int) -> None:
    """This process gets ``sig`` when its parent, ``parent``, dies (Linux's PR_SET_PDEATHSIG;
    without ``prctl`` nothing), at once if it is gone already: a launcher killed by SIGKILL (by hand,
    a CI cancel, a process-group kill that missed the agent's session) left the agent and its
    workers training with no parent (found by review). Called once ``sig`` has its default or the
    agent's handler: the launcher's early catcher, inherited, would swallow it."""
    if prctl is not None and prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0 and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def fork_agent(module: str, args: list[str], env: dict[str, str], ignored: Sequence[int],
               stderr_pipe: tuple[int, int] | None, defaults: Sequence[int] = (),
               stop_signal: int = signal.SIGTERM) -> int:
    """The process id of a fork of this process running ``python -m module args`` in a session of
    its own, with ``ignored`` signals ignored and ``defaults`` at their default (the launcher's own
    catchers are no agent's), no stdin (no worker may wait at a prompt: W&B's login) and, with
    ``stderr_pipe`` (read end, write end), its stderr into that pipe; ``stop_signal`` (one the agent
    stops its workers on) reaches it when this process dies."""
    launcher, prctl = os.getpid(), parent_death_call()
    # Signals wait, blocked, across the fork until the child's own dispositions are in: the
    # launcher forwards an early-caught SIGTERM at once, which the child's inherited copy of the
    # early catcher swallowed (found by review: the run trained to its end, exit 0). A pending
    # signal is not inherited: the parent's own are delivered to it when it unblocks them.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = os.fork()
    finally:  # in the parent (a failed fork too: left blocked, Ctrl-C did nothing; the diff review)
        if os.getpid() == launcher:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if pid:
        return pid
    status, interrupted = 1, False
    try:
        os.setsid()
        for sig in defaults:
            signal.signal(sig, signal.SIG_DFL)
        for sig in ignored:
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        stop_when_parent_dies(prctl, stop_signal, launcher)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        if stderr_pipe is not None:
            # Not the read end: were this process to hold it, the launcher's death would leave the
            # workers writing into a pipe nobody reads, blocking once it is full, not failing.
            os.close(stderr_pipe[0])
            os.dup2(stderr_pipe[1], 2)
            os.close(stderr_pipe[1])
        os.environ.update(env)
        # Logging as a new interpreter has it: torch's records must not take this command's format.
        logging.root.handlers.clear()
        logging.root.setLevel(logging.WARNING)
        gc.freeze()  # the launcher's objects: neither walked nor finalised here
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:  # the interpreter's report of an uncaught error (torchrun's failure report)
        traceback.print_exc()
    finally:
        # Never back into the launcher's code, whatever a signal handler raises from here on.
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()
                sys.stderr.flush()
            if interrupted:  # as the interpreter ends on Ctrl-C: killed by SIGINT
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        finally:
            os._exit(status & 0xFF)  # not the launcher's exit handlers; a status as the system keeps it


# How the launcher tags the lines it adds itself (a log line, so the console keeps it).
LAUNCHER_TAG = f"{LOG_PREFIX} launcher]"


def write_line(sink: IO[str], line: str) -> str | None:
    """None once ``line`` is written, else why it could not be."""
    try:
        sink.write(line)
        sink.flush()
    except (OSError, ValueError) as exc:  # ValueError: the file was closed
        return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return None


SIGNAL_NUMBERS = {int(sig) for sig in signal.Signals}
# torchrun's agent's line for a worker that failed: "failed (exitcode: -9) local_rank: 1 (pid: 7)"
WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def restart_line(line: str, restarts_left: int, restarts: int) -> str | None:
    """The console's line for a worker failure the agent restarts from (``line`` its log line),
    else None: the restart was said in the log alone, the console going from a step to a resume
    without a word (found by a trial). The last failure is the launch's own error line."""
    failed = WORKER_FAILED.search(line)
    if failed is None or restarts_left <= 0:
        return None
    code, rank = int(failed[1]), failed[2]
    if code < 0:  # a realtime signal has no name: a ValueError here would stop the pipe's reader
        how = f"was killed by {signal.Signals(-code).name if -code in SIGNAL_NUMBERS else f'signal {-code}'}"
    else:
        how = f"exited with status {code}"
    attempt = restarts - restarts_left + 1
    return (f"{LAUNCHER_TAG} local rank {rank} {how}; restarting the workers from the newest "
            f"checkpoint (restart {attempt} of {restarts}, trainer.max_restarts)\n")


# What a launch log could not take (run.dir's disk full) of what its readers below look for: the
# workers' last lines and torchrun's final report, kept by the pipe's reader, by the log's path. The
# console's one line then still names the failure and its exit status (found by a trial: "exited
# with status 1 without an error record", the workers' "free space" line lost with the log).
UNWRITTEN: dict[str, list[str]] = {}
UNWRITTEN_MOST = 2000


def keep_unwritten(log: IO[str], line: str, reporting: bool) -> None:
    """Keep ``line`` for the log's readers if it is one they look for (``reporting``: inside
    torchrun's final report)."""
    kept = UNWRITTEN.setdefault(str(getattr(log, "name", "")), [])
    if (reporting or line.startswith(COMMAND_END)) and len(kept) < UNWRITTEN_MOST:
        kept.append(line)


def split_stderr(stream: IO[str], log: IO[str], console: IO[str] | None = None, restarts: int = 0) -> None:
    """Workers' log lines to the console (default ``sys.stderr``), every line to the log file, and
    a line for each of the ``restarts`` torchrun's agent may make.

    The pipe is read to its end whatever happens to the sinks: once nobody reads it, every worker
    blocks at its next stderr write and the job hangs. A sink that fails (run.dir's disk full, the
    console's pipe closed) is dropped, and the other one told once.
    """
    sinks: dict[str, IO[str] | None] = {"log": log, "console": sys.stderr if console is None else console}
    restarts_left = restarts
    reporting = False
    for line in stream:
        reporting = reporting or "ChildFailedError" in line
        if (said := restart_line(line, restarts_left, restarts)) is not None:
            restarts_left -= 1
            if sinks["console"] is not None and write_line(sinks["console"], said):
                sinks["console"] = None  # the log still gets the agent's own line, below
        for name, other in (("log", "console"), ("console", "log")):
            sink = sinks[name]
            if sink is None or (name == "console" and not line.startswith(LOG_PREFIX)):
                continue
            why = write_line(sink, line)
            if why is None:
                continue
            sinks[name] = None
            if name == "log":
                note = (f"cannot write the launch log {getattr(log, 'name', '')} ({why}); the workers' "
                        "stderr other than their log lines is lost from here on")
            else:
                note = f"cannot write the console ({why}); the workers' log lines go to this file only"
            if sinks[other] is not None and write_line(sinks[other], f"{LAUNCHER_TAG} {note}\n"):
                sinks[other] = None
        if sinks["log"] is None:  # refused now or before: kept for the log's readers
            keep_unwritten(log, line, reporting)


def close_quietly(log: IO[str]) -> None:
    # A log that could not be written fails again on close, with the lines split_stderr has dropped.
    with contextlib.suppress(OSError):
        log.close()


def child_processes() -> dict[int, list[int]]:
    """Every process's children, from /proc in one pass."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(root: int) -> list[int]:
    """All processes below ``root`` (children, grandchildren, ...), from /proc."""
    children = child_processes()
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def ignores(pid: int, sig: int) -> bool:
    """Whether process ``pid`` ignores ``sig`` (or is gone), from /proc/PID/status's SigIgn mask."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line.split()[1] for line in f if line.startswith("SigIgn:"))
    except (OSError, StopIteration, IndexError):
        return True
    return bool(int(mask, 16) >> (sig - 1) & 1)


def pipe_writers(read_fd: int) -> list[int]:
    """The processes whose stderr is the pipe ``read_fd`` reads, but those whose parent's is too:
    the agent's workers once the agent is gone (not what they started: W&B's service, compile
    workers), from /proc."""
    target = f"pipe:[{os.fstat(read_fd).st_ino}]"
    writers = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/fd/2") == target:
                    writers.add(int(entry))
    children = child_processes()
    below = {child for pid in writers for child in children.get(pid, [])}
    return sorted(writers - below)


def orphans_stop_signal(killed_by: int, signals: Sequence[int]) -> int:
    """The signal the workers of an agent killed by ``killed_by`` are sent, said on the console: an
    interrupt (Ctrl-C while the agent started) interrupts them; else the first preemption signal
    (with checkpoints on, they save and stop), or SIGTERM where there is none."""
    if killed_by == signal.SIGINT:
        stop, what = signal.SIGINT, "torchrun's agent was interrupted (SIGINT)"
        then = "they stop"
    else:
        stop = signals[0] if signals else signal.SIGTERM
        what = f"torchrun's agent was killed by {signal.Signals(killed_by).name}"
        then = ("with checkpoints on they save one and stop, as at a preemption" if signals
                else "it stops them")
    with contextlib.suppress(OSError, ValueError):
        print(f"{LAUNCHER_TAG} {what}, leaving its workers running: sending them "
              f"{signal.Signals(stop).name} ({then})", file=sys.stderr, flush=True)
    return stop


def stop_orphaned_workers(read_fd: int, reader: threading.Thread, sig: int) -> None:
    """The agent died of a signal (SIGKILL: by hand, or the out-of-memory killer) and left its
    workers running, orphaned, with no one to restart or stop them: they train on to the end while
    this process waits for their pipe. Each is sent ``sig`` (a preemption signal: they save and stop
    at the next step) once it no longer ignores it, until the pipe ends."""
    asked: set[int] = set()
    while reader.is_alive():
        for pid in pipe_writers(read_fd):
            if pid not in asked and not ignores(pid, sig):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                asked.add(pid)
        reader.join(0.5)


def run_under_torchrun(nproc: int, command: list[str], preemption_signals: Sequence[str],
                       max_restarts: int = 0, log_file: Path | None = None,
                       early: EarlySignals | None = None) -> int:
    """torchrun's exit status. With ``log_file``, only log lines reach the console (see above).
    ``early``: the signals caught before this process's handlers are in, acted on as they are."""
    signals = [getattr(signal, name) for name in preemption_signals]
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.ExitStack() as stack:
        log = open(log_file, "a") if log_file is not None else None
        if log is not None:
            stack.callback(close_quietly, log)
        pipe = os.pipe() if log is not None else None
        # The agent's status is waited for: a SIGCHLD ignored by whoever started this process would
        # have the system reap it unasked.
        stack.callback(signal.signal, signal.SIGCHLD, signal.signal(signal.SIGCHLD, signal.SIG_DFL))
        agent_stop = signal.SIGHUP if signal.SIGTERM in signals else signal.SIGTERM
        agent = fork_agent(AGENT_MODULE, torchrun_args(nproc, command, preemption_signals, max_restarts),
                           agent_env(max_restarts), signals, pipe,
                           defaults=list(early.previous) if early is not None else (), stop_signal=agent_stop)
        reader = None
        if pipe is not None:
            os.close(pipe[1])  # the pipe ends when the agent and the workers have closed it
            stderr = stack.enter_context(open(pipe[0], errors="replace"))
            reader = threading.Thread(target=split_stderr, args=(stderr, log, None, max_restarts),
                                      daemon=True)
            reader.start()

        # Preemption signals received, and the workers each has reached. A worker inherits the
        # agent's ignoring of them until its trainer installs a handler (start-up: imports, the
        # model's build, a resume's load, minutes at scale), and a signal may come before the
        # workers exist: it is delivered to each worker once that worker no longer ignores it.
        pending: set[int] = set()
        delivered: set[tuple[int, int]] = set()
        # Set once the agent is reaped: its process id may be another process's from then on.
        orphaned: list[int] = []
        stopped_by: list[int] = []  # the signals, not preemption ones, that stopped the run

        def deliver() -> None:
            # Only to the workers, the agent's children (the agent ignores these signals); not
            # further down: W&B's service and compile workers keep their own sessions so that the
            # trainer's signals miss them.
            for pid in child_processes().get(agent, []):
                for sig in tuple(pending):
                    if (pid, sig) not in delivered and not ignores(pid, sig):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, sig)
                        delivered.add((pid, sig))

        def forward(signum, frame) -> None:
            if orphaned:  # the agent is gone: its workers, left running, get every signal now
                for pid in pipe_writers(orphaned[0]):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signum)
            elif signum in signals:
                pending.add(signum)
                deliver()
            else:  # the agent stops its workers: at the signals it handles, and at agent_stop for others
                stopped_by.append(signum)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(agent, agent_stop if signum in STOPPING_SIGNALS else signum)

        # Every signal the agent handles, too: left at its default, SIGHUP or SIGQUIT would kill this
        # process and leave the agent (in a session of its own) and the workers running.
        agents = (getattr(signal, name) for name in ("SIGTERM", *AGENT_SIGNALS))
        handled = {*signals, *agents, *STOPPING_SIGNALS}
        previous = {sig: signal.signal(sig, forward) for sig in handled}
        if early is not None:
            for sig in dict.fromkeys(early.caught):
                if sig in handled:
                    forward(sig, None)
            previous.update(early.hand_over(handled))  # not its catcher: what was there before it
        for sig, handler in previous.items():
            # Put back once the agent is gone: a late signal must not reach a reused process id.
            stack.callback(signal.signal, sig, handler)
        status = wait_delivering(agent, pending, deliver)
        if reader is not None:
            if status < 0:
                orphaned.append(stderr.fileno())
                stop_orphaned_workers(stderr.fileno(), reader, orphans_stop_signal(-status, signals))
            reader.join()
    # An agent killed by a signal: the shell's 128 + its number (sys.exit(-2) would exit 254).
    status = 128 - status if status < 0 else status
    if stopped_by and 0 < status <= 128:
        # Stopped at a signal this process got (not a preemption's, which saves and ends with 0):
        # the status says which, as a shell's does for a process that signal killed; torchrun's 1
        # said nothing.
        status = 128 + stopped_by[0]
    return status


def wait_delivering(pid: int, pending: set[int], deliver: Callable[[], None]) -> int:
    """The exit status of child ``pid`` (minus the signal that killed it), calling ``deliver``
    every half second while signals are ``pending``."""
    delivered_at = 0.0
    while True:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(wait_status)
        if pending and time.monotonic() - delivered_at >= 0.5:
            deliver()
            delivered_at = time.monotonic()
        time.sleep(0.05)


# One worker in torchrun's final ChildFailedError report: "rank : 1 (local_rank: 1)" then
# "exitcode : -9 (pid: 123)  (SIGKILL)".
REPORTED_WORKER = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
ROOT_CAUSE = "Root Cause (first observed failure)"  # the report lists the other failures before it


# A worker these signals killed left no Python error: SIGKILL from outside (by hand, the
# out-of-memory killer), the others from a crash in native code, unless its own record or line says
# what came before. SIGTERM is what torchrun itself sends to stop the remaining workers, the notices
# and interrupts the launcher forwards are the workers' to act on, and SIGABRT is also how NCCL's
# watchdog stops a rank whose peer failed (found by the diff review: that victim could be named):
# none of those names a root cause.
CRASH_SIGNALS = {signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}


def log_text(log_file: Path) -> str:
    """The launch log, and what of it could not be written (``UNWRITTEN``)."""
    try:
        text = log_file.read_text(errors="replace")
    except OSError:
        text = ""
    kept = "".join(UNWRITTEN.get(str(log_file), ()))
    # A write cut short by the full disk left half a line: the kept lines start on their own.
    return text + ("\n" if kept and text and not text.endswith("\n") else "") + kept


def final_report(log_file: Path) -> str:
    """torchrun's final ChildFailedError report in ``log_file`` ("" without one)."""
    text = log_text(log_file)
    return text[text.rfind("ChildFailedError"):] if "ChildFailedError" in text else ""


def killed_first(log_file: Path) -> tuple[int, str] | None:
    """(rank, signal name) of the worker torchrun's report names as the root cause (the first
    observed failure) where a signal killed it: SIGKILL from outside (by hand, or the out-of-memory
    killer), or a crash in native code (SIGSEGV, SIGBUS, SIGILL, SIGFPE); the errors its peers recorded
    ("connection reset") are fallout (found by review: a segfaulting rank's peer was named, with
    its "Connection reset by peer"). None otherwise: a worker torchrun itself stopped after another's
    failure (its SIGTERM only asks a worker to stop at a step's end; one waiting in a collective on
    the dead peer is SIGKILLed 30 s later, not the root cause) is fallout too. The caller prefers the
    rank's own record or line, where it left one, to a crash's signal (an abort after an error)."""
    cause = root_cause(log_file)
    if cause is None or cause[1] >= 0 or -cause[1] not in CRASH_SIGNALS:
        return None
    return cause[0], signal.Signals(-cause[1]).name


def killed_reason(rank: int, name: str) -> str:
    if name == "SIGKILL":
        return (f"rank {rank} was killed by {name} without a Python error (killed from outside, or by the "
                "out-of-memory killer); its peers' errors are fallout")
    return (f"rank {rank} died of {name} without a Python error (a crash in native code: a C extension, "
            "the accelerator's runtime or driver); its peers' errors are fallout")


def own_line(log_file: Path, rank: int) -> bool:
    """Whether worker ``rank`` ended with an error line of its own."""
    return any(line.startswith(f"{ERROR_START}[rank {rank}] ") for line in worker_lines(log_file))


def root_cause(log_file: Path) -> tuple[int, int] | None:
    """The rank and exit code torchrun's final report gives its root cause (the first observed
    failure; the code negative for a signal), None without one (best effort, as ``killed_workers``)."""
    report = final_report(log_file)
    found = REPORTED_WORKER.search(report, report.find(ROOT_CAUSE)) if ROOT_CAUSE in report else None
    return (int(found.group(1)), int(found.group(2))) if found else None


def worker_lines(log_file: Path) -> list[str]:
    """The lines the workers' commands ended with (``shardtrain: error: [rank N] ...``,
    ``shardtrain: interrupted``), in the log's order; none if none did (a crash)."""
    return [line.strip() for line in log_text(log_file).splitlines() if line.startswith(COMMAND_END)]


def first_worker_line(log_file: Path) -> str | None:
    return next(iter(worker_lines(log_file)), None)


def failed_rank_line(log_file: Path, rank: int | None) -> str | None:
    """The error line of worker ``rank`` (the first to fail, by torchrun's report), without its rank
    tag; the first worker line when that rank left none (or ``rank`` is None). Every rank may fail,
    and in the log a peer's fallout can come before the first failure's own line."""
    lines = worker_lines(log_file)
    tagged = f"{ERROR_START}[rank {rank}] "
    # Its last: with restarts, an earlier attempt's line may name a failure a restart went past.
    line = next((line for line in reversed(lines) if line.startswith(tagged)), lines[0] if lines else None)
    return RANK_TAG.sub(ERROR_START, line, count=1) if line else None


def failed_worker(log_file: Path) -> tuple[str | None, int | None]:
    """The error line of the worker torchrun's report names as the root cause (``failed_rank_line``)
    and the status it exited with (None where the report gives none, or a signal's)."""
    cause = root_cause(log_file)
    line = failed_rank_line(log_file, cause[0] if cause else None)
    return line, (cause[1] if cause is not None and cause[1] > 0 else None)


def launch_log_path(run_dir: Path, started: float) -> Path:
    return run_dir / "logs" / f"launch-{time.strftime('%Y%m%d-%H%M%S', time.localtime(started))}.log"


def relaunch_if_needed(cfg: Config, command: list[str], log_file: Path,
                       early: EarlySignals | None = None) -> int | None:
    """Exit status of a torchrun run started here, or None when this process should train (with
    ``early``'s signals still to act on)."""
    if under_torchrun():
        check_manual_launch_shape(cfg.trainer.num_nodes)  # before check_world, whose message misleads
        world = int(os.environ["WORLD_SIZE"])
        check_world(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
        by_hand = os.environ.get(BUILT_IN_LAUNCH) != "1"  # the built-in launcher's workers: it is in use
        if cfg.trainer.max_restarts and by_hand and os.environ.get("RANK") == "0" and (
                "TORCHELASTIC_RUN_ID" in os.environ):
            log.warning(f"trainer.max_restarts={cfg.trainer.max_restarts} is the built-in launcher's "
                        f"(trainer.devices=N); under torchrun its own --max-restarts ({restarts}) decides")
        return None
    per_node, _ = launch_shape(cfg)
    check_not_one_of_many(starts_torchrun=per_node > 1)
    if cfg.trainer.num_nodes > 1:
        raise ConfigError(
            f"trainer.num_nodes={cfg.trainer.num_nodes}: start torchrun on every node, e.g. "
            f"torchrun --nnodes {cfg.trainer.num_nodes} --nproc-per-node {per_node} "
            "--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id RUN -m shardtrain train ..."
        )
    if per_node > 1:
        try:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            log_file.touch()
        except OSError as exc:  # run.dir was checked writable: a full disk, a quota, a read-only remount
            raise ConfigError(f"cannot write the launch log {log_file} ({exc.strerror or exc}); free space "
                              "in run.dir or choose another run.dir") from exc
        # Without checkpoints no signal is a preemption: each stops the run, and the launcher exits
        # with 128 + its number (it exited 1, "without an error record", at a SIGTERM: found by review)
        preemption = list(cfg.checkpoint.preemption_signals) if cfg.checkpoint.enabled else []
        return run_under_torchrun(per_node, command, preemption, cfg.trainer.max_restarts, log_file, early)
    if cfg.trainer.max_restarts:
        raise ConfigError(f"trainer.max_restarts={cfg.trainer.max_restarts} needs the built-in launcher "
                          "(trainer.devices=N with N > 1) or torchrun --max-restarts")
    return None
