"""Start the right number of processes on torchrun, never on a launcher protocol of our own.

``trainer.devices=N`` outside torchrun re-executes the same command under
``torch.distributed.run --standalone --nproc-per-node N``. Multi-node runs are started by the user
(or Slurm) with torchrun on every node; here we only check that the world matches the config.
"""

from __future__ import annotations

import os
import sys

from shardtrain.config.loader import devices_count
from shardtrain.config.schema import Config
from shardtrain.distributed.env import accelerator_count, under_torchrun
from shardtrain.errors import ConfigError


def processes_per_node(cfg: Config) -> int:
    """``trainer.devices`` resolved: "auto" is one process per accelerator, or one on a CPU."""
    return devices_count(cfg.trainer.devices) or max(1, accelerator_count())


def torchrun_argv(nproc: int, command: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "shardtrain", *command]


def relaunch_if_needed(cfg: Config, command: list[str]) -> None:
    """Re-exec under torchrun when more than one local process is wanted; else return."""
    nproc = processes_per_node(cfg)
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        explicit = devices_count(cfg.trainer.devices)
        expected = explicit * cfg.trainer.num_nodes if explicit else None
        if expected is not None and expected != world:
            raise ConfigError(
                f"torchrun started {world} processes but trainer.devices={explicit} x "
                f"trainer.num_nodes={cfg.trainer.num_nodes} = {expected}; make them agree "
                "(or set trainer.devices=auto under torchrun)"
            )
        return
    if cfg.trainer.num_nodes > 1:
        raise ConfigError(
            f"trainer.num_nodes={cfg.trainer.num_nodes}: start torchrun on every node, e.g. "
            f"torchrun --nnodes {cfg.trainer.num_nodes} --nproc-per-node {nproc} "
            "--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id RUN -m shardtrain train ..."
        )
    if nproc > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        argv = torchrun_argv(nproc, command)
        os.execv(argv[0], argv)
