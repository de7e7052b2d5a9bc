"""Where an async save copies the state before training goes on: buffers kept between saves.

DCP's default stages every async save into a fresh copy in pageable host memory: on an H100 that
copy of 13 GB (1.1B parameters with Adam state) blocked training 11 s (docs/checkpoints.md), most of
it allocating and faulting in new pages. A stager kept for the whole run copies into the same host
buffers every time (page-locked on an accelerator, so the copy runs at the link's speed), at the cost
of holding one host copy of this rank's state between saves (``checkpoint.reuse_staging``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from shardtrain import accelerator
from shardtrain.distributed.agreement import run_agreed

log = logging.getLogger("shardtrain")


def reuses_buffers(stager: DefaultStager) -> bool:
    """Whether a second staging through ``stager`` copies into the first one's buffer.

    torch 2.11's stager tore down its own copier after each staging, so the second async save
    failed (``KeyError: <class 'type'>``, pytorch/pytorch#183413): the installed torch is asked, by
    doing it, rather than guessed from its version.
    """
    probe = {"probe": torch.zeros(4)}
    try:
        first = stager.stage(probe)["probe"]
        second = stager.stage(probe)["probe"]
    except Exception:  # the failure above is a KeyError deep in a deepcopy; any failure means no
        return False
    return first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()


def reused_stager(device: torch.device) -> DefaultStager | None:
    """A stager whose host buffers every async save of the run reuses, or None where the installed
    torch cannot reuse them (DCP then stages into a fresh copy each time, as by default)."""
    on_accelerator = accelerator.pin_offloaded_memory(device.type)
    stager = DefaultStager(StagingOptions(
        use_pinned_memory=on_accelerator,
        use_shared_memory=False,  # saves run in a thread of this process, not in another process
        use_async_staging=False,  # training must not change the state while it is being copied
        use_non_blocking_copy=on_accelerator,  # copies queued together, one synchronisation
    ))
    if reuses_buffers(stager):
        return stager
    stager.close()
    log.warning("checkpoint.reuse_staging: this torch (%s) cannot reuse DCP's staging buffers "
                "(pytorch/pytorch#183413); async saves copy the state into fresh host memory each time",
                torch.__version__)
    return None


class AgreedStager(AsyncStager):
    """Stages through ``reused`` (or, where None, a fresh copy as DCP's default makes one), then
    every rank learns in one all-gather on ``group`` how its staging went, before DCP starts the
    write: staging is each rank's own copy, with no collective, and a rank whose copy failed (its
    host out of memory) raised alone while the others went on, their writes waiting in DCP's
    collectives and their training in the next step's until a timeout (found by review). Every rank
    raises the failed rank's one line, made by ``errors()`` around its staging."""

    def __init__(self, reused: DefaultStager | None, group: dist.ProcessGroup,
                 errors: Callable[[], AbstractContextManager]) -> None:
        self.owned = reused is None
        self.inner = reused if reused is not None else DefaultStager(StagingOptions(
            use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
            use_non_blocking_copy=False))
        self.group = group
        self.errors = errors

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self.inner.should_synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> Any:
        def staged() -> Any:
            with self.errors():
                return self.inner.stage(state_dict)
        return run_agreed(staged, self.group)

    def synchronize_staging(self) -> None:
        self.inner.synchronize_staging()

    def release_after(self, written: Future | None) -> None:
        """Close a fresh copy's stager once ``written`` (the write) is done, or now (None: the save
        failed); the run's reused one stays."""
        if not self.owned:
            return
        if written is None:
            self.inner.close()
        else:
            written.add_done_callback(lambda _: self.inner.close())
