"""A window of training steps traced by torch's profiler (``diagnostics.profile_at``,
``diagnostics.profile_steps``): every rank (or those ``diagnostics.profile_ranks`` names) writes its
Chrome trace (https://ui.perfetto.dev or chrome://tracing) to ``run.dir/profiles/steps-A-B/``, and
rank 0, where it traces, logs the operators that took the most time. On CUDA,
``diagnostics.memory_snapshot`` also records the caching allocator's history over the window
(https://pytorch.org/memory_viz).

The data, the step and the evaluation and sampling due at it are traced (a periodic checkpoint save
too, except at the window's last step); the window closes before the final save and sample. Nothing
here is a collective, and a trace that cannot be written (or a table that cannot be made) is a
warning, so the ranks go on together whatever one rank meets.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from shardtrain.accelerator import dump_memory_snapshot, profiler_activities, record_memory_history
from shardtrain.config.schema import DiagnosticsConfig
from shardtrain.errors import ConfigError

log = logging.getLogger("shardtrain")

# Rows of the operator table rank 0 logs.
TOP_OPERATORS = 15
# Past this world size, tracing every rank is warned of: a trace a rank (hundreds of MB each for a
# large model) written at once to the shared run.dir.
MANY_TRACES = 64


class StepProfiler:
    """Starts torch's profiler before step ``profile_at`` and writes what it recorded after step
    ``profile_at + profile_steps - 1`` (or when training ends inside the window)."""

    def __init__(self, cfg: DiagnosticsConfig, run_dir: Path, rank: int, device: torch.device,
                 max_steps: int, world_size: int = 1) -> None:
        self.first = cfg.profile_at
        self.last = min(cfg.profile_at + cfg.profile_steps - 1, max_steps)
        self.snapshot = cfg.memory_snapshot
        self.run_dir = run_dir
        self.rank = rank
        self.device = device
        self.profiler: torch.profiler.profile | None = None
        if outside := [r for r in cfg.profile_ranks if r >= world_size]:
            raise ConfigError(f"diagnostics.profile_ranks holds rank {outside[0]}, and the world size is "
                              f"{world_size} (ranks 0-{world_size - 1})")
        self.ranks = sorted(set(cfg.profile_ranks)) or None  # None: every rank
        self.traces = self.ranks is None or rank in self.ranks
        if rank == 0 and self.first and self.ranks is None and world_size > MANY_TRACES:
            log.warning(f"profiler: every one of the {world_size} ranks will write a trace to "
                        f"{run_dir / 'profiles'} at once; diagnostics.profile_ranks=[0,...] names a few")

    def before_step(self, step: int) -> None:
        """Before step ``step`` (1-based) runs."""
        if step != self.first or self.profiler is not None:  # profile_at=0: no step is 0
            return
        if self.rank == 0:
            which = "" if self.ranks is None else f" on rank{'s' if len(self.ranks) > 1 else ''} " + \
                ", ".join(map(str, self.ranks))
            log.info(f"profiler: tracing steps {self.first}-{self.last}{which}")
        if not self.traces:
            return
        if self.snapshot:
            record_memory_history(self.device, True)
        self.profiler = torch.profiler.profile(activities=profiler_activities(self.device),
                                               record_shapes=True, profile_memory=True)
        self.profiler.start()

    def writes_after(self, step: int) -> bool:
        """Whether ``after_step(step)`` (or ``close``, at the end of training) writes the trace."""
        return self.profiler is not None and step >= self.last

    def after_step(self, step: int) -> None:
        """After step ``step`` and what was due at it."""
        if self.writes_after(step):
            self.finish(step)

    def close(self, step: int) -> None:
        """Training ended (or failed, inside step ``step + 1``) with the window open: write what was
        traced. Never raises: it also runs while a training failure propagates."""
        if self.profiler is None:
            return
        try:
            self.finish(max(step, self.first))
        except Exception as exc:  # the profiler's own failure must not replace the run's
            self.profiler = None
            log.warning(f"profiler: rank {self.rank} could not finish its trace ({type(exc).__name__}: "
                        f"{exc})")

    def finish(self, step: int) -> None:
        profiler, self.profiler = self.profiler, None
        folder = self.run_dir / "profiles" / f"steps-{self.first}-{step}"
        try:
            profiler.stop()
            folder.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(folder / f"rank{self.rank}.json"))
            if self.snapshot:
                dump_memory_snapshot(str(folder / f"rank{self.rank}-memory.pickle"))
            if self.rank == 0:
                # By the device's time where the profiler recorded the device's kernels.
                device_time = len(profiler_activities(self.device)) > 1
                table = profiler.key_averages().table(
                    sort_by="self_device_time_total" if device_time else "self_cpu_time_total",
                    row_limit=TOP_OPERATORS)
                log.info(f"profiler: steps {self.first}-{step} traced, each traced rank's trace in "
                         f"{folder}; rank 0's costliest operators:\n{table}")
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            log.warning(f"profiler: rank {self.rank} could not write its trace to {folder} ({exc}); "
                        "training goes on")
        finally:
            if self.snapshot:
                record_memory_history(self.device, False)
