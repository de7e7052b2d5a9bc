"""The command line end to end: the default run, relaunch under torchrun, two 'nodes', errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cli_utils import read_metrics, run_cli
from distributed import free_port


def test_default_train_runs_and_loss_falls(tmp_path):
    run_dir = tmp_path / "default"
    proc = run_cli("train", "trainer.max_steps=40", "trainer.eval_every=20", "trainer.log_every=10",
                   "trainer.sample_tokens=16", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(run_dir)
    losses = [r["loss"] for r in records]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(losses) == 4 and len(vals) == 2
    assert losses[0] > 3.5  # starts near ln(256) = 5.55 nats per byte
    assert losses[-1] < losses[0] - 1.0 and vals[-1] < vals[0]
    assert vals[-1] < 3.0
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_mib"] > 0 for r in records)
    assert all(r["mfu"] is None for r in records)  # CPU peak unknown: never a made-up MFU
    assert (run_dir / "config.yaml").is_file() and any((run_dir / "tensorboard").iterdir())
    assert read_metrics(run_dir, "sample")[0]["text"].startswith("def ")
    assert "resolved config:" in proc.stderr and "val_loss" in proc.stderr


def quick_losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


QUICK = ["experiment=quick", "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=0",
         "trainer.sample_tokens=0", "trainer.micro_batch_size=2", "run.trackers=[]"]


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    """Global batch 8: one process with micro-batch 2 and 4 accumulation steps."""
    run_dir = tmp_path_factory.mktemp("single")
    proc = run_cli("train", *QUICK, "trainer.grad_accum_steps=4", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return quick_losses(run_dir)


def test_devices_relaunches_under_torchrun(tmp_path, single_process_losses):
    run_dir = tmp_path / "two"
    proc = run_cli("train", *QUICK, "trainer.devices=2", "trainer.grad_accum_steps=2",
                   "strategy=shard_grad_op", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world size 2" in proc.stderr and "SHARD_GRAD_OP" in proc.stderr
    for a, b in zip(quick_losses(run_dir), single_process_losses, strict=True):
        assert abs(a - b) / b < 1e-5


def test_two_torchrun_agents_as_two_nodes_hybrid_shard(tmp_path, single_process_losses):
    """Two torchrun agents (2 processes each) rendezvous over c10d on 127.0.0.1 as two 'nodes'."""
    run_dir = tmp_path / "two_nodes"
    port = free_port()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
             f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             "--rdzv-id=two-node-test", "-m", "shardtrain", "train", *QUICK,
             "strategy=hybrid_shard", "trainer.devices=2", "trainer.num_nodes=2",
             f"run.dir={run_dir}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
        )
        for node in range(2)
    ]
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=300)
            outputs.append(out)
    finally:
        for agent in agents:
            agent.kill()
    assert all(a.returncode == 0 for a in agents), "\n".join(o[-3000:] for o in outputs)
    log = "\n".join(outputs)
    assert "world size 4" in log
    assert "HYBRID_SHARD: mesh [dp_replicate=2 x dp_shard=2]" in log
    for a, b in zip(quick_losses(run_dir), single_process_losses, strict=True):
        assert abs(a - b) / b < 1e-5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["trainer.max_step=3"], "did you mean 'trainer.max_steps'?"),
        (["strategy=fulll_shard"], "did you mean 'full_shard'?"),
        (["data.source=files", "data.paths=[/nonexistent/dir]", "trainer.max_steps=1"],
         "data path '/nonexistent/dir' does not exist"),
        (["trainer.devices=2", "trainer.num_nodes=2"], "start torchrun on every node"),
    ],
)
def test_bad_input_exits_nonzero_with_message(args, message, tmp_path):
    proc = run_cli("train", *args, f"run.dir={tmp_path}", timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
