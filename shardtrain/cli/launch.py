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
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from shardtrain.config.plan import check_world, launch_shape
from shardtrain.config.schema import Config
from shardtrain.distributed.env import under_torchrun
from shardtrain.errors import ConfigError

AGENT_SIGNALS = ("SIGINT", "SIGHUP", "SIGQUIT")


def torchrun_argv(nproc: int, command: list[str], preemption_signals: Sequence[str]) -> list[str]:
    handled = [s for s in AGENT_SIGNALS if s not in preemption_signals]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", f"--signals-to-handle={','.join(handled)}",
            "-m", "shardtrain", *command]


def descendants(root: int) -> list[int]:
    """All processes below ``root`` (children, grandchildren, ...), from /proc."""
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
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def run_under_torchrun(nproc: int, command: list[str], preemption_signals: Sequence[str]) -> int:
    signals = [getattr(signal, name) for name in preemption_signals]

    def ignore_preemption_signals() -> None:  # runs in the child before exec
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)

    sys.stdout.flush()
    sys.stderr.flush()
    agent = subprocess.Popen(torchrun_argv(nproc, command, preemption_signals),
                             preexec_fn=ignore_preemption_signals, start_new_session=True)

    def forward(signum, frame) -> None:
        targets = descendants(agent.pid) if signum != signal.SIGINT else [agent.pid]
        for pid in targets:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for sig in {*signals, signal.SIGINT}:
        signal.signal(sig, forward)
    return agent.wait()


def relaunch_if_needed(cfg: Config, command: list[str]) -> int | None:
    """Exit status of a torchrun run started here, or None when this process should train."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        check_world(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        return None
    per_node, _ = launch_shape(cfg)
    if cfg.trainer.num_nodes > 1:
        raise ConfigError(
            f"trainer.num_nodes={cfg.trainer.num_nodes}: start torchrun on every node, e.g. "
            f"torchrun --nnodes {cfg.trainer.num_nodes} --nproc-per-node {per_node} "
            "--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id RUN -m shardtrain train ..."
        )
    if per_node > 1:
        return run_under_torchrun(per_node, command, list(cfg.checkpoint.preemption_signals))
    return None
