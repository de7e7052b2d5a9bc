"""The training step's own contract at 2 real gloo ranks: a stop request from one rank reaches
every rank through the step's loss all-reduce, and a step with no target tokens fails on all ranks
together (both now decided at the step's one host synchronisation), and that synchronisation is the
step's only read of a tensor's value by the host besides the embedding exchange's split sizes."""

from __future__ import annotations

import json

from distributed import run_on_ranks
from step_workers import agreement_and_empty_steps


def test_one_ranks_stop_request_reaches_all_and_empty_steps_fail_everywhere(tmp_path):
    run_on_ranks(agreement_and_empty_steps, 2, str(tmp_path), tmp_path=tmp_path)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["signalled"] is True, (rank, result)  # only the last rank asked
        assert result["quiet"] is False, (rank, result)
        assert result["error"] and "a count of 0 on every rank" in result["error"], (rank, result)
        # docs/metrics.md: one host synchronisation per step (the old step read twice), after the
        # update is queued (fused AdamW skips a non-finite step on the device; it read before), and
        # one in each micro-batch's forward where the embedding exchanges rows: its split sizes
        assert result["host_reads"] == ["tolist", "optimizer.step", "tolist"], (rank, result["host_reads"])
        assert result["host_resident_reads"] > 0  # the filter above saw what it filters
