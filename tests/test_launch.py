"""Launching: restarts after a lost rank, one clear error line, and checks before any worker starts.

Real processes throughout: the built-in launcher and plain torchrun with 2 gloo workers, faults
injected from outside (SIGKILL of a worker, an exception in a worker).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_utils import clean_env, run_cli
from distributed import free_port
from safetensors.torch import load_file

from shardtrain.cli.main import main

QUICK = ["experiment=quick", "trainer.max_steps=10", "checkpoint.interval=3", "trainer.log_every=1",
         "trainer.eval_every=0", "trainer.sample_tokens=0"]
# Rank 1 kills itself after step 5, on the first attempt only (a restarted attempt gets past it).
KILL_RANK_1 = {"SHARDTRAIN_FAULT": "step:1:5:kill:0"}


def final_weights(run_dir, out):
    proc = run_cli("consolidate", str(run_dir / "checkpoints" / "step-10"), str(out))
    assert proc.returncode == 0, proc.stderr
    return load_file(str(out))


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].equal(b[name]), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, dict]:
    """(run directory, final weights) of the run every interrupted one must reproduce."""
    run_dir = tmp_path_factory.mktemp("launch") / "uninterrupted"
    proc = run_cli("train", *QUICK, "trainer.devices=2", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, final_weights(run_dir, run_dir.parent / "uninterrupted.safetensors")


def test_lost_rank_restarts_and_ends_bit_for_bit(tmp_path, uninterrupted):
    run_dir = tmp_path / "restarted"
    proc = run_cli("train", *QUICK, "trainer.devices=2", "trainer.max_restarts=2", f"run.dir={run_dir}",
                   env=KILL_RANK_1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step-3" in proc.stderr  # the newest complete one
    assert_bitwise_equal(final_weights(run_dir, tmp_path / "w.safetensors"), uninterrupted[1])


def test_lost_rank_without_restarts_is_one_error_line(tmp_path):
    proc = run_cli("train", *QUICK, "trainer.devices=2", f"run.dir={tmp_path / 'r'}", env=KILL_RANK_1)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("[shardtrain")]
    assert len(errors) == 1 and errors[0].startswith("shardtrain: error: "), proc.stderr[-3000:]
    assert "rank 1 was killed by SIGKILL without a Python error" in errors[0] and "full log:" in errors[0]


def test_plain_torchrun_with_restarts_and_a_shared_store(tmp_path, uninterrupted):
    """torchrun's default shares its rendezvous store with the workers across restarts; the
    workers keep each attempt's keys apart, so the restarted attempt does not read stale ones."""
    run_dir = tmp_path / "torchrun"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=2",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=restarts",
         "-m", "shardtrain", "train", *QUICK, f"run.dir={run_dir}", "dist.startup_timeout_s=60"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        env=clean_env(**KILL_RANK_1),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr
    assert_bitwise_equal(final_weights(run_dir, tmp_path / "w.safetensors"), uninterrupted[1])


def test_worker_failure_is_one_line_naming_the_rank(tmp_path):
    run_dir = tmp_path / "failing"
    proc = run_cli("train", *QUICK, "trainer.devices=2", f"run.dir={run_dir}",
                   env={"SHARDTRAIN_FAULT": "step:1:4:raise"})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("[shardtrain")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("shardtrain: error: rank 1 (host ") and "at step 4: RuntimeError" in errors[0]
    logs = list((run_dir / "logs").glob("launch-*.log"))
    assert len(logs) == 1 and logs[0].name in errors[0]
    kept = logs[0].read_text()
    assert "Traceback" in kept and "ChildFailedError" in kept  # kept for whoever digs deeper


@pytest.mark.parametrize(
    ("make", "override", "message"),
    [
        (None, "checkpoint.resume={tmp}/missing", "does not exist"),
        ("empty_dir", "checkpoint.resume={tmp}/empty", "is empty"),
        ("truncated", "checkpoint.resume={tmp}/truncated", "is unreadable"),
        (None, "model.init_from={tmp}/nothing.safetensors", "does not exist"),
        (None, "model.init_from=hf:{tmp}/no_model", "is not a directory"),
        ("file", "run.dir={tmp}/a_file", "is a file; run.dir must be a directory"),
    ],
)
def test_broken_paths_fail_before_any_worker_starts(tmp_path, capsys, make, override, message):
    """The launching process answers (here in this one: it never gets as far as starting torchrun)."""
    if make == "empty_dir":
        (tmp_path / "empty").mkdir()
    elif make == "truncated":
        (tmp_path / "truncated").mkdir()
        (tmp_path / "truncated" / ".metadata").write_bytes(b"\x80\x04trunc")
    elif make == "file":
        (tmp_path / "a_file").write_text("not a directory")
    args = ["train", *QUICK, "trainer.devices=2", override.format(tmp=tmp_path)]
    if not override.startswith("run.dir"):
        args.append(f"run.dir={tmp_path / 'run'}")
    status = main(args)
    stderr = capsys.readouterr().err
    assert status == 2, stderr[-2000:]
    assert message in stderr and stderr.startswith("shardtrain: error: "), stderr
    assert "world size" not in stderr and "Traceback" not in stderr  # no worker started
    assert not (tmp_path / "run" / "logs").exists()


def test_outputs_are_checked_before_reading(tmp_path, uninterrupted):
    ckpt = uninterrupted[0] / "checkpoints" / "step-10"
    inside = run_cli("consolidate", str(ckpt), str(ckpt / "out.safetensors"))
    assert inside.returncode == 2 and "inside the checkpoint it reads" in inside.stderr
    (tmp_path / "file").write_text("x")
    into_file = run_cli("export-hf", str(ckpt), str(tmp_path / "file"))
    assert into_file.returncode == 2 and "is a file; pass a directory" in into_file.stderr
    assert not (ckpt / "out.safetensors").exists()
