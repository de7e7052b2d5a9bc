"""Run the real ``shardtrain`` command as a process of its own, with a deadline."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardtrain.cli.launch import child_processes, descendants

SHARDTRAIN = [sys.executable, "-m", "shardtrain"]


def clean_env(**extra: str) -> dict:
    """This process's environment without torchrun's variables (tests may run under torchrun)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def holders(*files: Path) -> list[int]:
    """The processes that have one of ``files`` open, from /proc."""
    targets, found = {str(file) for file in files}, []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/fd/{fd}") in targets:
                        found.append(int(entry))
                        break
    return found


class Preloaded:
    """The client of ``preloaded.py``: ``shardtrain`` commands forked from one interpreter that has
    imported torch and shardtrain (see there for what differs from a new interpreter). Started at
    the first command, again if it died or a command was interrupted, stopped when this process
    exits."""

    def __init__(self) -> None:
        self.server: subprocess.Popen | None = None
        self.pending = b""

    def start(self) -> subprocess.Popen:
        if self.server is None or self.server.poll() is not None:
            env = {k: v for k, v in clean_env().items() if k != "PYTHONPATH"}  # each command's own
            self.server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("preloaded.py"))],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            self.pending = b""
            atexit.register(self.server.stdin.close)  # its loop ends, and so does it
        return self.server

    def answer(self, deadline: float | None) -> int | None:
        """The server's next line as a number, or None past ``deadline``."""
        fd = self.server.stdout.fileno()
        while b"\n" not in self.pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not select.select([fd], [], [], left)[0]):
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the preloaded interpreter died (status {self.server.wait()}); "
                                   "its traceback is in the test's output above")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return int(line)

    def run(self, args: list[str], timeout: float, env: dict) -> subprocess.CompletedProcess:
        server = self.start()
        command, deadline = [*SHARDTRAIN, *args], time.monotonic() + timeout
        with tempfile.TemporaryDirectory(prefix="shardtrain-cli-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"args": args, "env": env, "cwd": os.getcwd(), "stdout": str(out), "stderr": str(err)}
            pid = None
            try:
                server.stdin.write((json.dumps(request) + "\n").encode())
                server.stdin.flush()
                pid = self.answer(None)
                status = self.answer(deadline)
                # Done, as subprocess.run is, once every process the command started has let go of
                # its output as well: an agent or a worker left running fails the test.
                left = [] if status is None else holders(out, err)
                while left and time.monotonic() < deadline:
                    time.sleep(0.05)
                    left = holders(out, err)
                if status is None or left:
                    stop(pid, out, err)
                    if status is None:
                        self.answer(None)  # the server has reaped it
            except BaseException:  # out of step with the server (Ctrl-C): both go
                if pid is not None:
                    stop(pid, out, err)
                server.kill()
                server.wait()
                self.server = None
                raise
            if status is None or left:
                raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(command, status, out.read_text(), err.read_text())


def stop(pid: int, *files: Path) -> None:
    """SIGKILL a command, everything it started (also what went into a session of its own, or was
    orphaned) and whatever still writes its output."""
    for target in (*descendants(pid), pid, *holders(*files)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)


PRELOADED = Preloaded()


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``shardtrain args`` as its own process, with a deadline: forked from the preloaded
    interpreter (``preloaded.py``), not started anew."""
    return PRELOADED.run(list(args), timeout, clean_env(**(env or {})))


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def launch(args, env=None) -> subprocess.Popen:
    full_env = {**os.environ, **(env or {})}
    return subprocess.Popen([*SHARDTRAIN, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=full_env, stdin=subprocess.DEVNULL, start_new_session=True)


def preempt(args, run_dir, step: int, env=None) -> tuple[int, str]:
    """Start ``shardtrain args``, SIGTERM its whole process group (as Slurm does) once training has
    logged ``step``; its exit status and output."""
    return terminate_when(args, lambda proc: wait_for_step(run_dir, step, proc), env)


def preempt_at_start(args, env=None) -> tuple[int, str]:
    """Start ``shardtrain args`` and SIGTERM its process group as soon as its training processes
    exist (start-up: they are importing, building, loading), as a scheduler may; status and output."""
    def workers_exist(proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + 120
        while not any(grandchildren(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)

    return terminate_when(args, workers_exist, env, timeout=300)


# ``shardtrain ARGS`` that SIGTERMs itself in its first moment: after the command's catcher is in,
# before the config is composed and torch loaded (its own function wrapped, nothing of torch's).
SIGNALLED_AT_ONCE = """
import os, signal, sys
import shardtrain.cli.main as main
compose = main.compose_checked
def signalled(overrides):
    os.kill(os.getpid(), signal.SIGTERM)
    return compose(overrides)
main.compose_checked = signalled
sys.exit(main.main(sys.argv[1:]))
"""


def preempt_before_torch(args, env=None) -> tuple[int, str]:
    """``shardtrain args`` SIGTERMed in its first moment (SIGNALLED_AT_ONCE); status and output."""
    proc = subprocess.run([sys.executable, "-c", SIGNALLED_AT_ONCE, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def terminate_when(args, ready, env=None, timeout: float = 120) -> tuple[int, str]:
    """Start ``shardtrain args``, wait for ``ready(proc)``, SIGTERM its process group; status, output."""
    proc = launch(args, env)
    try:
        ready(proc)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


def grandchildren(pid: int) -> list[int]:
    """The launcher's agent's children: its training processes."""
    children = child_processes()
    return [worker for agent in children.get(pid, []) for worker in children.get(agent, [])]


def wait_for_step(run_dir, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if read_metrics(run_dir) and read_metrics(run_dir)[-1]["step"] >= step:
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"training did not reach step {step}")
