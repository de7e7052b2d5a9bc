"""Launching: restarts after a lost rank, one clear error line, and checks before any worker starts.

Real processes throughout: the built-in launcher and plain torchrun with 2 gloo workers, faults
injected from outside (SIGKILL of a worker, an exception in a worker). The launcher's own plumbing
(the stderr pipe, signal forwarding) is also tested with a stand-in for torchrun's agent.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_utils import clean_env, run_cli
from distributed import free_port
from safetensors.torch import load_file

from shardtrain.cli.launch import failed_rank_line, killed_first, relaunch_if_needed, root_cause
from shardtrain.cli.main import error_line, launch_outcome, main
from shardtrain.config.compose import compose_config
from shardtrain.data.prepare import PrepareOptions, prepare
from shardtrain.diagnostics.failures import record_failure
from shardtrain.errors import ConfigError

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
    # the restart is said on the console (found by a trial: from a step to a resume without a word)
    assert ("[shardtrain launcher] local rank 1 was killed by SIGKILL; restarting the workers from the "
            "newest checkpoint (restart 1 of 2, trainer.max_restarts)") in proc.stderr, proc.stderr[-3000:]
    assert "under torchrun its own --max-restarts" not in proc.stderr  # it is the launcher's, in use
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
    # torchrun's default --signals-to-handle holds SIGTERM, a preemption signal: said once an attempt
    assert "torchrun's agent handles SIGTERM itself (its --signals-to-handle)" in proc.stderr
    # trainer.max_restarts under plain torchrun does nothing, and is said to (found by review)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--max-restarts=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=said",
         "-m", "shardtrain", "train", *QUICK, f"run.dir={tmp_path / 'said'}", "trainer.devices=auto",
         "trainer.max_steps=1", "trainer.max_restarts=3"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("trainer.max_restarts=3 is the built-in launcher's (trainer.devices=N); under torchrun its own "
            "--max-restarts (1) decides") in proc.stderr


def test_worker_failure_is_one_line_naming_the_rank(tmp_path):
    run_dir = tmp_path / "failing"
    proc = run_cli("train", *QUICK, "trainer.devices=2", f"run.dir={run_dir}",
                   env={"SHARDTRAIN_FAULT": "step:1:4:raise"})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert "signals-to-handle" not in proc.stderr  # the built-in launcher's agent leaves them alone
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("[shardtrain")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("shardtrain: error: rank 1 (host ")
    assert "failed first, after step 4: RuntimeError" in errors[0]
    logs = list((run_dir / "logs").glob("launch-*.log"))
    assert len(logs) == 1 and logs[0].name in errors[0]
    kept = logs[0].read_text()
    assert "Traceback" in kept and "ChildFailedError" in kept  # kept for whoever digs deeper
    # torchrun's report read as `generate --devices` reads it: the root cause is rank 1's RuntimeError,
    # status 1, though rank 0 is listed first among the failures
    assert root_cause(logs[0]) == (1, 1)


def test_the_line_shown_is_the_first_failing_ranks(tmp_path):
    """`generate`/`eval --devices N` show the error line of the rank torchrun's report names as the
    root cause: in the log, a peer's line may come first (a tie of whole seconds in the report's
    timestamps, or rank 0 failing later but writing sooner)."""
    log = tmp_path / "workers.log"
    log.write_text("[shardtrain] a log line\n"
                   "shardtrain: error: [rank 0] a collective failed: connection reset by peer\n"
                   "shardtrain: error: [rank 1] prompt 2: prompt (5000 tokens) exceeds the model\n")
    assert failed_rank_line(log, 1) == "shardtrain: error: prompt 2: prompt (5000 tokens) exceeds the model"
    assert failed_rank_line(log, None) == "shardtrain: error: a collective failed: connection reset by peer"
    assert failed_rank_line(log, 3) == failed_rank_line(log, None)  # that rank left no line: the first
    assert failed_rank_line(tmp_path / "missing.log", 1) is None


def torchrun_report(first: tuple[int, int], other: tuple[int, int]) -> str:
    """torchrun's final report as it prints it: the other failure listed first, then the root cause."""
    def failure(index: int, rank: int, code: int, time: str) -> str:
        return (f"[{index}]:\n  time      : 2026-11-30_01:00:{time}\n  host      : node1\n"
                f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: {100 + rank})\n"
                "  error_file: <N/A>\n")
    return ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n" + "=" * 60 + "\n"
            "shardtrain FAILED\n" + "-" * 60 + "\nFailures:\n" + failure(1, *other, "35") + "-" * 60 + "\n"
            "Root Cause (first observed failure):\n" + failure(0, *first, "01") + "=" * 60 + "\n")


def test_a_rank_torchrun_killed_after_the_first_failure_is_not_blamed(tmp_path):
    """Found by review: any worker listed with -9 was named the cause and the first failure's error
    fallout; on NCCL a peer waiting on the failed rank is SIGKILLed by torchrun 30 s after its SIGTERM
    (a preemption signal, which only asks a step's end). Only the root cause killed from outside is."""
    log = tmp_path / "workers.log"
    log.write_text("shardtrain: error: [rank 1] no space left on device\n" + torchrun_report((1, 2), (0, -9)))
    assert killed_first(log) is None and root_cause(log) == (1, 2)
    log.write_text(torchrun_report((1, -9), (0, 1)))
    assert killed_first(log) == (1, "SIGKILL")


def test_the_failure_named_is_the_last_attempts(tmp_path, monkeypatch, capsys):
    """Found by review: with trainer.max_restarts, a record of attempt 0 (recovered from by the
    restart) outlived it where its rank wrote none in the last attempt, and the launcher named it."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    record_failure(tmp_path, 0, 50, "RuntimeError", "attempt 0's", exit_status=1)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    record_failure(tmp_path, 1, 60, "ValueError", "attempt 1's", exit_status=2)
    status = launch_outcome(1, tmp_path, 0.0, tmp_path / "launch.log")
    assert status == 2 and "failed first, after step 60: ValueError: attempt 1's" in capsys.readouterr().err


def test_a_worker_crashed_by_a_signal_is_named_over_its_peers_fallout(tmp_path, monkeypatch, capsys):
    """Found by review: a rank that segfaulted (a crash in native code) left no record, and the
    launcher named its peer, whose record said "Connection reset by peer". A crash's signal names its
    rank unless that rank's own record says what came before (an abort after an error); the
    signals torchrun stops workers with, or the launcher forwards, name none."""
    log = tmp_path / "launch.log"
    log.write_text(torchrun_report((1, -11), (0, 1)))
    assert killed_first(log) == (1, "SIGSEGV")
    for code in (-15, -10, -2, -6):  # SIGTERM, SIGUSR1, SIGINT, SIGABRT (NCCL's watchdog's too)
        log.write_text(torchrun_report((1, code), (0, 1)))
        assert killed_first(log) is None, code
    log.write_text(torchrun_report((1, -11), (0, 1)))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    record_failure(tmp_path, 0, 3, "RuntimeError", "Connection reset by peer", exit_status=1)
    assert launch_outcome(1, tmp_path, 0.0, log) == 139
    assert ("rank 1 died of SIGSEGV without a Python error (a crash in native code: a C extension, the "
            "accelerator's runtime or driver); its peers' errors are fallout") in capsys.readouterr().err
    record_failure(tmp_path, 1, 3, "RuntimeError", "CUDA error: an illegal memory access", exit_status=1)
    assert launch_outcome(1, tmp_path, 0.0, log) == 1
    assert "rank 1 (host" in capsys.readouterr().err  # its own record, not the signal


def test_a_workers_error_line_names_its_rank_only_in_a_world_of_several(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert error_line("no space left") == "shardtrain: error: [rank 3] no space left"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert error_line("no space left") == "shardtrain: error: no space left"
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert error_line("no space left") == "shardtrain: error: no space left"


@pytest.mark.parametrize(
    ("make", "override", "message"),
    [
        (None, "checkpoint.resume={tmp}/missing", "does not exist"),
        ("empty_dir", "checkpoint.resume={tmp}/empty", "is empty"),
        ("truncated", "checkpoint.resume={tmp}/truncated", "is unreadable"),
        (None, "model.init_from={tmp}/nothing.safetensors", "does not exist"),
        (None, "model.init_from=hf:{tmp}/no_model", "is not a directory"),
        ("file", "run.dir={tmp}/a_file", "is a file; run.dir must be a directory"),
        # Found by review: a checkpoint (or checkpoints/) as run.dir trained afresh inside it.
        ("checkpoints", "run.dir={tmp}/r/checkpoints/step-4",
         "run.dir='{tmp}/r/checkpoints/step-4' is a checkpoint; run.dir is the run's directory"),
        ("checkpoints", "run.dir={tmp}/r/checkpoints",
         "run.dir='{tmp}/r/checkpoints' is a run's checkpoints directory; name the run's directory, "
         "'{tmp}/r', to go on"),
        # Found by review: a run inside another's checkpoint went with it at that run's next prune
        ("checkpoints", "run.dir={tmp}/r/checkpoints/step-4/inner",
         "run.dir '{tmp}/r/checkpoints/step-4/inner' is inside the checkpoint '{tmp}/r/checkpoints/step-4'"),
        ("checkpoints", "data.cache_dir={tmp}/r/checkpoints/step-4/cache",
         "data.cache_dir '{tmp}/r/checkpoints/step-4/cache' is inside the checkpoint"),
        # Found by the walkthrough: a run's files went among a dataset's (whose next preparation
        # deleted them) or a model's
        ("dataset", "run.dir={tmp}/ds", "run.dir='{tmp}/ds' is a prepared dataset (shardtrain prepare's"),
        ("model", "run.dir={tmp}/m", "run.dir='{tmp}/m' is a model directory (its config.json); a run"),
        # Found by review: every worker failed preparing the data, exit 1, naming no setting
        ("file", "data.cache_dir={tmp}/a_file/cache",
         "data.cache_dir '{tmp}/a_file/cache' cannot be written"),
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
    elif make == "dataset":
        (tmp_path / "text.txt").write_text("one two three\n" * 40)
        prepare(PrepareOptions(inputs=[str(tmp_path / "text.txt")], val_percent=0.0), tmp_path / "ds",
                progress=False)
    elif make == "model":
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text("{}")
    elif make == "checkpoints":
        (tmp_path / "r" / "checkpoints" / "step-4").mkdir(parents=True)
        (tmp_path / "r" / "checkpoints" / "step-4" / "trainer_state.json").write_text("{}")
        (tmp_path / "r" / "checkpoints" / "step-4" / ".metadata").write_bytes(b"")
    args = ["train", *QUICK, "trainer.devices=2", override.format(tmp=tmp_path)]
    if not override.startswith("run.dir"):
        args.append(f"run.dir={tmp_path / 'run'}")
    status = main(args)
    stderr = capsys.readouterr().err
    assert status == 2, stderr[-2000:]
    assert message.format(tmp=tmp_path) in stderr and stderr.startswith("shardtrain: error: "), stderr
    assert "world size" not in stderr and "Traceback" not in stderr  # no worker started
    assert not (tmp_path / "run" / "logs").exists()


def test_a_launched_run_ends_in_one_line_naming_why(tmp_path, capsys):
    """Ctrl-C reaches every worker: each says "interrupted" and records no failure, and the launcher
    says so with 130 (found by review: "rank 1 failed first: KeyboardInterrupt", exit 1). A recorded
    failure is named by its rank."""
    log = tmp_path / "launch.log"
    log.write_text("[shardtrain] step 3/100\nshardtrain: interrupted (a training run ...)\nTraceback ...\n")
    assert launch_outcome(1, tmp_path, 0.0, log) == 130
    assert capsys.readouterr().err.startswith("shardtrain: interrupted (a training run with checkpoints")
    record_failure(tmp_path, 1, 4, "RuntimeError", "boom")
    assert launch_outcome(1, tmp_path, 0.0, log) == 1
    assert capsys.readouterr().err.startswith("shardtrain: error: rank 1 (host ")
    # The framework's own error exits 2, as one process does (found by a docs review: torchrun's 1)
    (tmp_path / "failures" / "rank-1.json").unlink()
    record_failure(tmp_path, 0, 4, "DataError", "the data is short", exit_status=2)
    assert launch_outcome(1, tmp_path, 0.0, log) == 2
    assert "rank 0 (host " in capsys.readouterr().err


def test_outputs_are_checked_before_reading(tmp_path, uninterrupted):
    ckpt = uninterrupted[0] / "checkpoints" / "step-10"
    inside = run_cli("consolidate", str(ckpt), str(ckpt / "out.safetensors"))
    assert inside.returncode == 2 and "inside the checkpoint it reads" in inside.stderr
    # ... nor inside another checkpoint (found by review: written into step-3)
    other = tmp_path / "other"
    other.mkdir()
    (other / ".metadata").write_bytes(b"")
    into_other = run_cli("consolidate", str(ckpt), str(other / "x.safetensors"))
    assert into_other.returncode == 2 and f"is inside the checkpoint {str(other.resolve())!r}" in \
        into_other.stderr, into_other.stderr[-2000:]
    (tmp_path / "file").write_text("x")
    into_file = run_cli("export-hf", str(ckpt), str(tmp_path / "file"))
    assert into_file.returncode == 2 and "is a file; pass a directory" in into_file.stderr
    assert not (ckpt / "out.safetensors").exists()


# The built-in launcher with a stand-in for torchrun's agent module: argv[1] is the module's code
# (written to the working directory), argv[2] the launch log, the rest the agent's arguments. Prints
# the agent's exit status.
LAUNCHER = """
import signal
import sys
from pathlib import Path
import shardtrain.cli.launch as launch
Path("standin_agent.py").write_text(sys.argv[1])
launch.AGENT_MODULE = "standin_agent"
launch.torchrun_args = lambda *args, **kwargs: sys.argv[3:]
handled = (signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1)
before = [signal.getsignal(sig) for sig in handled]
status = launch.run_under_torchrun(2, ["train"], ("SIGUSR1", "SIGTERM"), 0, Path(sys.argv[2]))
# the forwarding handlers are put back: a late signal must not go to a reused process id
assert [signal.getsignal(sig) for sig in handled] == before
print("agent exited", status, flush=True)
"""
# An agent whose workers write 200 KB to stderr (tracebacks, warnings), more than a pipe holds,
# with a log line every 1000 lines.
NOISY_AGENT = """
import sys
for i in range(4000):
    sys.stderr.write(f"[shardtrain] line {i}\\n" if i % 1000 == 0 else "x" * 50 + "\\n")
"""
# An agent that handles SIGHUP and SIGQUIT, as torchrun's does (--signals-to-handle), whatever it
# inherited (nohup and a background shell ignore them), and SIGTERM unless the launcher started it
# ignoring SIGTERM (a preemption signal, which torchrun's --signals-to-handle then leaves out),
# exiting 100 + the signal; argv[1]: a file it writes its pid to once it handles them, and the
# signal it got to argv[1].got.
HANDLING_AGENT = """
import os, signal, sys, time
def stop(signum, frame):
    open(sys.argv[1] + ".got", "w").write(str(signum))
    sys.exit(100 + signum)
handled = [signal.SIGHUP, signal.SIGQUIT]
if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
    handled.append(signal.SIGTERM)
for sig in handled:
    signal.signal(sig, stop)
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(120)  # a guard: the test signals it long before
"""


# An agent whose worker (in a session of its own, as torchrun starts it) ignores the preemption
# signals for a second (start-up: the agent's ignoring inherited), then stops on SIGUSR1; argv[1]: a
# file the agent writes its pid and the worker's to.
ORPHANED_WORKER = """
import signal, sys, time
time.sleep(1)
def stop(signum, frame):
    sys.stderr.write("[shardtrain] worker stopping on " + signal.Signals(signum).name + "\\n")
    sys.exit(0)
signal.signal(signal.SIGUSR1, stop)
time.sleep(120)  # a guard: the launcher signals it long before
"""
ORPHANING_AGENT = f"""
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", {ORPHANED_WORKER!r}], start_new_session=True)
open(sys.argv[1], "w").write(f"{{os.getpid()}} {{worker.pid}}")
time.sleep(120)
"""


def test_workers_left_by_a_killed_agent_are_stopped(tmp_path):
    """torchrun's agent SIGKILLed (by hand, the out-of-memory killer): its workers, orphaned, were left
    training to the end while the launcher waited for their pipe (found by review, measured: 400
    steps trained after the kill). They are sent the first preemption signal once they catch it."""
    ready = tmp_path / "pids"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, ORPHANING_AGENT, str(tmp_path / "launch.log"), str(ready)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
        stdin=subprocess.DEVNULL)
    try:
        guard = time.monotonic() + 60
        while time.monotonic() < guard and not (ready.exists() and len(ready.read_text().split()) == 2):
            time.sleep(0.05)
        agent, worker = map(int, ready.read_text().split())
        os.kill(agent, signal.SIGKILL)
        out, err = launcher.communicate(timeout=60)
        assert out == "agent exited 137\n", err[-3000:]
        assert ("torchrun's agent was killed by SIGKILL, leaving its workers running: sending them SIGUSR1 "
                "(with checkpoints on they save one and stop, as at a preemption)") in err
        assert "[shardtrain] worker stopping on SIGUSR1" in err
        try:  # gone, or a zombie where nothing reaps orphans
            state = Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            state = "gone"
        assert state in ("gone", "Z"), state
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in map(int, ready.read_text().split() if ready.exists() else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_launch_log_that_cannot_be_written_does_not_hang_the_workers(tmp_path):
    """run.dir's disk full: the log is dropped, the console says so once, the pipe is still read."""
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, NOISY_AGENT, "/dev/full"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=clean_env(),
                          stdin=subprocess.DEVNULL)
    assert proc.stdout == "agent exited 0\n", proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert [line for line in lines if line.startswith("[shardtrain] line")] == [
        f"[shardtrain] line {i}" for i in range(0, 4000, 1000)]
    (note,) = [line for line in lines if line.startswith("[shardtrain launcher]")]
    assert "cannot write the launch log /dev/full (No space left on device)" in note
    assert "Traceback" not in proc.stderr


def test_a_failure_the_full_launch_log_lost_is_still_named_with_its_status(tmp_path, capsys):
    """Found by a trial: run.dir's disk full under the launcher, the console said "the training
    processes exited with status 1 without an error record" (the records and the log could not be
    written) and the workers' "free space on run.dir's filesystem" line was lost. The pipe's reader
    keeps what the log could not take of the workers' last lines and torchrun's report."""
    import errno
    import io

    from shardtrain.cli.launch import UNWRITTEN, split_stderr

    class FullDisk(io.StringIO):
        name = str(tmp_path / "launch.log")

        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    # what the log took before the disk filled: half a line (found by review: the kept lines were
    # joined onto it, "shardtrain: error: [rashardtrain: error: ...")
    (tmp_path / "launch.log").write_text("[shardtrain] step 4/12\nshardtrain: error: [ra")
    worker = ("shardtrain: error: [rank 0] saving step 6 to /run/checkpoints/.step-6.tmp failed: [Errno 28] "
              "No space left on device; free space on run.dir's filesystem (or raise its quota) (step-4 is "
              "intact)\n")
    stream = io.StringIO("[shardtrain] step 5/12\nTraceback (most recent call last):\n" + worker
                         + worker.replace("[rank 0]", "[rank 1]") + torchrun_report((0, 2), (1, 2)))
    console = io.StringIO()
    try:
        split_stderr(stream, FullDisk(), console)
        assert "cannot write the launch log" in console.getvalue()
        assert launch_outcome(1, tmp_path, 0.0, tmp_path / "launch.log") == 2
    finally:
        UNWRITTEN.pop(str(tmp_path / "launch.log"), None)
    line = capsys.readouterr().err
    assert line.startswith("shardtrain: error: saving step 6 to /run/checkpoints/.step-6.tmp failed: "
                           "[Errno 28] No space left on device; free space on run.dir's filesystem"), line


def test_a_launch_log_that_cannot_be_created_is_one_line(tmp_path):
    """The log's directory cannot be made (here a file is in the way; a full disk or a quota alike):
    one line before torchrun starts, not a traceback."""
    (tmp_path / "run").write_text("")
    with pytest.raises(ConfigError, match=r"cannot write the launch log .*; free space in run.dir") as caught:
        log = tmp_path / "run" / "logs" / "x.log"
        relaunch_if_needed(compose_config(["trainer.devices=2"]), ["train"], log)
    assert "\n" not in str(caught.value)


def test_signals_that_are_no_preemption_stop_the_run(tmp_path, monkeypatch):
    """Found by review: without checkpoints the built-in launcher still took SIGTERM for a preemption,
    so a SIGTERM to it ended with status 1, "without an error record", not 143; and a worker whose
    agent ignored SIGTERM (train.sbatch's) kept ignoring it where only SIGUSR1 preempts: torchrun's
    stop at a restart and scancel's waited for the SIGKILL."""
    import shardtrain.cli.launch as launch
    from shardtrain.cli.main import restore_stopping_signals

    asked = []
    monkeypatch.setattr(launch, "run_under_torchrun", lambda per_node, command, signals, *rest: asked.append(
        signals) or 0)
    for enabled in ("false", "true"):
        cfg = compose_config(["trainer.devices=2", f"checkpoint.enabled={enabled}", f"run.dir={tmp_path}"])
        assert relaunch_if_needed(cfg, ["train"], tmp_path / "logs" / "x.log") == 0
    assert asked == [[], ["SIGTERM", "SIGUSR1"]]
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        restore_stopping_signals(compose_config(["checkpoint.preemption_signals=[SIGUSR1]"]))
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # stops the worker again
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN  # the trainer's handler comes next
        restore_stopping_signals(compose_config(["checkpoint.enabled=false"]))
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_closed_console_does_not_hang_the_workers(tmp_path):
    """The console's pipe closed: the log keeps every line and says once that the console is gone."""
    read, write = os.pipe()
    os.close(read)  # nobody will read the launcher's stderr
    log = tmp_path / "launch.log"
    try:
        proc = subprocess.run([sys.executable, "-c", LAUNCHER, NOISY_AGENT, str(log)], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=write, text=True, timeout=120,
                              env=clean_env(), stdin=subprocess.DEVNULL)
    finally:
        os.close(write)
    assert proc.stdout == "agent exited 0\n"
    lines = log.read_text().splitlines()
    (note,) = [line for line in lines if line.startswith("[shardtrain launcher]")]
    assert "cannot write the console (Broken pipe)" in note
    assert len([line for line in lines if not line.startswith("[shardtrain launcher]")]) == 4000


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2], ids=lambda sig: sig.name)
def test_signals_the_agent_handles_are_forwarded_to_it(tmp_path, sig):
    """A hang-up or quit stops the agent (which stops its workers) instead of killing the launcher
    and leaving the agent, in a session of its own, and its workers running; so does any other
    signal that ends a process (found by review: SIGUSR2, SIGXCPU... killed the launcher alone), as
    SIGTERM to the agent. The launch's status says which signal stopped it, as a shell's would
    (found by review: torchrun's 1, "exited without an error record")."""
    ready = tmp_path / "agent.pid"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, HANDLING_AGENT, str(tmp_path / "launch.log"), str(ready)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))  # no core from SIGQUIT
    try:
        # Once the agent handles the signal and the launcher catches it; the deadline is a guard
        # only: past it the signal is sent anyway, and the assertions below say what went wrong.
        guard = time.monotonic() + 60
        while time.monotonic() < guard and launcher.poll() is None and not (
                ready.exists() and ready.read_text() and catches(launcher.pid, sig)):
            time.sleep(0.05)
        launcher.send_signal(sig)
        # Not communicate() first: an orphaned agent holds the launcher's stdout open.
        assert launcher.wait(timeout=60) == 0, f"the launcher died of {sig.name}, its agent left running"
        out, err = launcher.communicate(timeout=60)
        assert out == f"agent exited {128 + sig}\n", err[-3000:]
        # SIGTERM is a preemption signal here (LAUNCHER), which the agent ignores: a stop is SIGHUP
        # (found by the diff review: SIGTERM to the agent was ignored, and training went on)
        asked = signal.SIGHUP if sig == signal.SIGUSR2 else sig
        assert (tmp_path / "agent.pid.got").read_text() == str(int(asked))  # what the agent got
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if ready.exists() and ready.read_text():
            try:
                os.kill(int(ready.read_text()), signal.SIGKILL)  # an orphaned agent
            except ProcessLookupError:
                pass


def test_an_agent_whose_launcher_was_killed_stops(tmp_path):
    """Found by review: the launcher killed by SIGKILL (by hand, a CI cancel) left its agent, in a
    session of its own, and the workers training with no parent. The agent now gets the signal it
    stops its workers on: SIGHUP here, where SIGTERM is a preemption signal it ignores."""
    ready = tmp_path / "agent.pid"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, HANDLING_AGENT, str(tmp_path / "launch.log"), str(ready)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env(),
        stdin=subprocess.DEVNULL)
    try:
        guard = time.monotonic() + 60
        while time.monotonic() < guard and not (ready.exists() and ready.read_text()):
            time.sleep(0.05)
        launcher.kill()
        launcher.wait(timeout=60)
        got = tmp_path / "agent.pid.got"
        guard = time.monotonic() + 60
        while time.monotonic() < guard and not (got.exists() and got.read_text()):
            time.sleep(0.05)
        assert got.exists() and got.read_text() == str(int(signal.SIGHUP)), "the agent was left running"
    finally:
        if ready.exists() and ready.read_text():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(ready.read_text()), signal.SIGKILL)


def test_more_threads_than_cores_is_said(caplog):
    """Found by review: trainer.threads_per_process=1000 on 2 cores ran 27x slower without a word."""
    import torch

    from shardtrain.distributed.env import DistEnv, set_cpu_threads

    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                  backend="gloo")
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        assert set_cpu_threads(env, cores) == cores and "take turns" not in caplog.text
        assert set_cpu_threads(env, cores + 1) == cores + 1
    finally:
        torch.set_num_threads(before)
    said = f"trainer.threads_per_process={cores + 1} x 1 process(es) on this node's {cores} core(s)"
    assert said in caplog.text


def test_restart_lines_name_the_failure_and_never_stop_the_reader():
    """A worker killed by a realtime signal (no name in signal.Signals) is said by its number: the
    ValueError killed the pipe's reader, and the workers then blocked on a full pipe (found by
    review). Only the failures the agent restarts from are said; the last is the launch's own line."""
    import io

    from shardtrain.cli.launch import split_stderr

    agent = "E1201 api.py:1002] failed (exitcode: {code}) local_rank: 1 (pid: 7) of binary: python\n"
    stream = io.StringIO(agent.format(code=-35) + "[shardtrain] resumed\n" + agent.format(code=-9)
                         + agent.format(code=3) + "[shardtrain] after\n")
    log, console = io.StringIO(), io.StringIO()
    split_stderr(stream, log, console, restarts=2)
    assert console.getvalue().splitlines() == [
        "[shardtrain launcher] local rank 1 was killed by signal 35; restarting the workers from the newest "
        "checkpoint (restart 1 of 2, trainer.max_restarts)", "[shardtrain] resumed",
        "[shardtrain launcher] local rank 1 was killed by SIGKILL; restarting the workers from the newest "
        "checkpoint (restart 2 of 2, trainer.max_restarts)", "[shardtrain] after"]
    assert log.getvalue() == stream.getvalue()


def test_signals_caught_early_are_handed_over_and_their_defaults_come_back():
    """The train command catches the default preemption signals from its first moment; the trainer's
    flag takes what was caught, and puts back the handlers from before the catcher when it is done
    (found by review: the catcher itself came back, swallowing a SIGTERM after training)."""
    from shardtrain.checkpoint.preemption import PreemptionFlag
    from shardtrain.cli.early_signals import EarlySignals

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        for sig in saved:
            signal.signal(sig, signal.SIG_DFL)
        early = EarlySignals(("SIGTERM", "SIGUSR1"))
        assert signal.getsignal(signal.SIGTERM) == early.catch
        early.catch(signal.SIGUSR1, None)  # as the signal would, before the config is read
        flag = PreemptionFlag(["SIGUSR1", "SIGTERM"])
        flag.take(early.caught, early.hand_over(set(flag.signals)))
        assert flag.requested and flag.signal_name == "SIGUSR1"
        flag.restore()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


# The launcher's fork of its agent, a signal sent at once (as the launcher forwards one caught early),
# the child's start widened by half a second before its dispositions are in.
FORK_THEN_SIGNAL = """
import os, signal, sys, time
from pathlib import Path
import shardtrain.cli.launch as launch
Path("sleeper.py").write_text("import time; time.sleep(2)")
sys.path.insert(0, os.getcwd())
signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the early catcher, swallowing
setsid = os.setsid
os.setsid = lambda: (time.sleep(0.5), setsid())[1]
pid = launch.fork_agent("sleeper", [], {}, [], None, defaults=[signal.SIGTERM])
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
print("killed by", signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status)
      else f"exit {os.waitstatus_to_exitcode(status)}")
"""


def test_a_signal_sent_to_the_agent_as_it_starts_reaches_its_own_disposition(tmp_path):
    """Found by review: the launcher forwarded an early-caught SIGTERM to its agent at once, and the
    agent's inherited copy of the early catcher swallowed it until its own dispositions were in: the
    run trained to its end and exited 0."""
    proc = subprocess.run([sys.executable, "-c", FORK_THEN_SIGNAL], cwd=tmp_path, capture_output=True,
                          text=True, env=clean_env(), timeout=60)
    assert proc.stdout.strip() == "killed by SIGTERM", (proc.stdout, proc.stderr[-2000:])


def test_a_failed_fork_of_the_agent_leaves_no_signal_blocked():
    """Found by the diff's review: the signals blocked across the fork stayed blocked when the fork
    failed (Ctrl-C and SIGTERM then did nothing while the launcher reported)."""
    import shardtrain.cli.launch as launch

    def no_fork():
        raise OSError(11, "Resource temporarily unavailable")

    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    fork, os.fork = os.fork, no_fork
    try:
        with pytest.raises(OSError, match="Resource temporarily unavailable"):
            launch.fork_agent("sleeper", [], {}, [], None)
    finally:
        os.fork = fork
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before
