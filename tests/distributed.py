"""Run a function on N real gloo processes (spawned, never mocked) with a hard deadline."""

from __future__ import annotations

import faulthandler
import gc
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp

from shardtrain.distributed.env import destroy_distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, error_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # A rank that dies of a signal (SIGSEGV in native code) writes no traceback of its own: Python's
    # fault handler puts every thread's stack in the error directory, which the report below reads.
    crash_log = Path(error_dir, f"rank{rank}-fatal-signal.txt").open("w")
    faulthandler.enable(crash_log, all_threads=True)
    try:
        fn(*args)
    except BaseException:
        Path(error_dir, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        destroy_distributed()  # drops shardtrain's cached meshes, then the groups
        gc.collect()
    # A rank that passed leaves without finalising the interpreter. A group something still holds
    # (a trainer, a mesh, a caught error's frames) is destroyed there, after Python is gone, and its
    # gloo worker threads then aborted ranks that had passed every check, rarely and in any test
    # ("terminate called without an active exception", SIGABRT). Nothing of the result is unwritten.
    faulthandler.disable()
    crash_log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(fn, world_size: int, *args, tmp_path: Path, timeout_s: float = 600) -> None:
    """Call ``fn(*args)`` on ``world_size`` spawned processes; raise with every rank's traceback."""
    error_dir = tmp_path / f"errors-{world_size}-{time.monotonic_ns()}"
    error_dir.mkdir(parents=True)
    ctx = mp.start_processes(
        _entry, args=(world_size, free_port(), fn, args, str(error_dir)), nprocs=world_size,
        join=False, start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size}-process run exceeded {timeout_s}s")
    except Exception as exc:
        reports = "\n".join(text for p in sorted(error_dir.glob("*.txt")) if (text := p.read_text()))
        raise AssertionError(f"distributed run failed: {exc}\n{reports}") from exc
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
