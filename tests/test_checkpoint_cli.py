"""Checkpoints through the command line: crashes mid-save, preemption, and bad inputs."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from cli_utils import (
    clean_env,
    launch,
    preempt,
    preempt_at_start,
    preempt_before_torch,
    read_metrics,
    run_cli,
)

QUICK = ["experiment=quick", "trainer.log_every=1", "trainer.eval_every=0", "trainer.sample_tokens=0",
         "trainer.micro_batch_size=2", "run.trackers=[]"]
TEN_STEPS = ["trainer.devices=2", "trainer.max_steps=10", "checkpoint.interval=2", "checkpoint.keep_last=5"]


def test_kill_during_save_resume_picks_previous_complete(tmp_path):
    run_dir = tmp_path / "crash"
    args = ["train", *QUICK, "trainer.devices=2", "trainer.max_steps=8", "checkpoint.interval=3",
            f"run.dir={run_dir}"]
    crashed = run_cli(*args, env={"SHARDTRAIN_FAULT": "save:1:6:kill"})  # rank 1 SIGKILLs itself
    assert crashed.returncode != 0
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "step-3").is_dir() and (ckpts / ".step-6.tmp").is_dir()
    assert not (ckpts / "step-6").exists()
    inspect = run_cli("inspect", str(ckpts / ".step-6.tmp"))
    assert inspect.returncode == 1 and "did not finish" in inspect.stdout
    # What a preemption save killed at a step never saved again, and a deletion killed half-way,
    # leave: removed at the resume (they stayed forever, full size); a look-alike name is not.
    for name in (".step-7.tmp", ".step-1.deleting", ".step-7.tmp-notes"):
        (ckpts / name).mkdir()
        (ckpts / name / "__0_0.distcp").write_bytes(b"shard")

    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"skipping {ckpts / '.step-6.tmp'}: incomplete: the save did not finish" in resumed.stderr
    assert f"newest complete checkpoint is {ckpts / 'step-3'} (step 3)" in resumed.stderr
    assert f"deleting .step-1.deleting, .step-6.tmp, .step-7.tmp in {ckpts} (left by" in resumed.stderr
    # keep_last=2, no tmp
    assert sorted(p.name for p in ckpts.iterdir()) == [".step-7.tmp-notes", "step-6", "step-8"]
    assert read_metrics(run_dir)[-1]["step"] == 8


def test_a_save_whose_files_vanish_under_it_is_not_committed(tmp_path):
    """Found by review: a save whose RNG file something else deleted while it ran (another start in
    the run.dir) was committed without it, and its resume then skipped the RNG states."""
    run_dir = tmp_path / "run"
    proc = launch(["train", *QUICK, "trainer.max_steps=2", "checkpoint.interval=2", f"run.dir={run_dir}"],
                  env={"SHARDTRAIN_FAULT": "save:0:2:sleep=6"})  # after the RNG file, before DCP
    try:
        rng = run_dir / "checkpoints" / ".step-2.tmp" / "rng-rank0.pt"
        deadline = time.monotonic() + 120
        while not rng.is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)
        rng.unlink()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, out[-3000:]
    assert "save of step 2: rank 0's rng-rank0.pt is gone from" in out and "Traceback" not in out
    assert not (run_dir / "checkpoints" / "step-2").exists()


def test_a_second_training_in_a_run_directory_is_refused_while_the_first_runs(tmp_path):
    """Found by review: two trainings in one run.dir deleted each other's saves in progress and
    pruned each other's checkpoints. The second is refused in one line naming the first; a dry run
    beside it is not, and changes nothing; once the first is gone (killed: no release ran), the
    next start goes on."""
    args = ["train", *QUICK, "trainer.max_steps=3", f"run.dir={tmp_path}"]
    first = launch(args, env={"SHARDTRAIN_FAULT": "step:0:1:sleep=60"})
    try:
        lock = tmp_path / ".shardtrain-run.lock"
        deadline = time.monotonic() + 120
        while not (lock.is_file() and lock.read_text()):  # written once held, at start-up
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.05)
        second = run_cli(*args)
        assert second.returncode == 2, second.stderr[-3000:]
        assert (f"another training holds {tmp_path} (process {first.pid} on "
                in error_line(second)), second.stderr[-3000:]
        dry = run_cli(*args, "diagnostics.dry_run=true")
        assert dry.returncode == 0 and "dry run complete" in dry.stderr, dry.stderr[-3000:]
        # without checkpoints too (found by review: it rewrote the live run's config.yaml and joined
        # its metrics.jsonl)
        checkpointless = run_cli(*args, "checkpoint.enabled=false")
        assert checkpointless.returncode == 2, checkpointless.stderr[-3000:]
        assert f"another training holds {tmp_path} (process {first.pid} on " in error_line(checkpointless)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_metrics(tmp_path)[-1]["step"] == 3
    # ... nor another run without checkpoints beside this run's, as resume=none is refused
    config = (tmp_path / "config.yaml").read_bytes()
    beside = run_cli(*args, "checkpoint.enabled=false")
    assert beside.returncode == 2 and "checkpoint.enabled=false would start another run in its directory" in \
        error_line(beside), beside.stderr[-3000:]
    assert (tmp_path / "config.yaml").read_bytes() == config
    # a dry run of the finished run says that its step runs past the end (it read "step 4/3" alone)
    past = run_cli(*args, "diagnostics.dry_run=true")
    assert past.returncode == 0, past.stderr[-3000:]
    assert "dry run of a finished run (step 3 >= trainer.max_steps=3)" in past.stderr, past.stderr[-3000:]


def test_sigterm_saves_exits_cleanly_and_resumes_exactly(tmp_path):
    common = [*QUICK, "trainer.devices=2", "trainer.max_steps=30", "checkpoint.interval=0"]
    reference = run_cli("train", *common, f"run.dir={tmp_path / 'reference'}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = [r["loss"] for r in read_metrics(tmp_path / "reference")]

    run_dir = tmp_path / "preempted"
    status, out = preempt(["train", *common, f"run.dir={run_dir}"], run_dir, 5)
    assert status == 0, out[-3000:]
    assert "preemption (SIGTERM): saving at step" in out
    stopped_at = read_metrics(run_dir)[-1]["step"]
    assert 5 <= stopped_at < 30 and (run_dir / "checkpoints" / f"step-{stopped_at}").is_dir()

    resumed = run_cli("train", *common, f"run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(run_dir)]
    assert losses == expected  # bit for bit across the preemption

    # A failure after a save between two records (a record every 4 steps, a save at step 6, rank 0
    # failing in step 7): the resumed run's record at step 8 covers steps 5 to 8, as the
    # uninterrupted run's does (found by review: steps 5 and 6 were in no record)
    crashed = tmp_path / "crashed"
    args = [*common, "trainer.log_every=4", "checkpoint.interval=6", f"run.dir={crashed}"]
    failed = run_cli("train", *args, env={"SHARDTRAIN_FAULT": "step:0:7:raise"})
    assert failed.returncode == 1 and (crashed / "checkpoints" / "step-6").is_dir(), failed.stderr[-3000:]
    resumed = run_cli("train", *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    logged = {r["step"]: r["loss"] for r in read_metrics(crashed)}
    assert sorted(logged) == list(range(4, 31, 4)) + [30], sorted(logged)
    assert math.isclose(logged[8], sum(expected[4:8]) / 4, rel_tol=1e-9), (logged[8], expected[4:8])

    # A signal during start-up, while the workers still ignore it as their agent does (imports) or
    # build the model: the launcher delivers it once they catch it, and the first step stops (it
    # was lost, the run going on to the end, or killed the workers without a word).
    # Its step is logged though no record was due (trainer.log_every=5; found by review: the steps
    # since the last record were in none, the resume's interval starting after them).
    run_dir = tmp_path / "at_start"
    status, out = preempt_at_start(["train", *common, "trainer.log_every=5", f"run.dir={run_dir}"])
    assert status == 0 and "preemption (SIGTERM): saving at step 1 and stopping" in out, out[-3000:]
    assert (run_dir / "checkpoints" / "step-1").is_dir() and read_metrics(run_dir)[-1]["step"] == 1
    resumed = run_cli("train", *common, f"run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["loss"] for r in read_metrics(run_dir)] == expected

    # Earlier still, before the config is composed and torch loaded, to the process that trains
    # alone and to the launcher: caught, and acted on at the first step (found by a trial: the
    # signal killed the process without a word, and a Slurm job was not requeued)
    for devices in (1, 2):
        run_dir = tmp_path / f"first_moments_{devices}"
        status, out = preempt_before_torch(["train", *common, f"trainer.devices={devices}",
                                            f"run.dir={run_dir}"])
        assert status == 0 and "preemption (SIGTERM): saving at step 1 and stopping" in out, out[-3000:]
        assert (run_dir / "checkpoints" / "step-1").is_dir()


def test_a_signal_during_a_single_process_start_up_saves_after_the_first_step(tmp_path):
    """Found by review: one process (no torchrun) installed its handler only when training began, so
    a SIGTERM while it loaded a checkpoint killed it (status 143) instead of a save after a step."""
    args = ["train", *QUICK, "checkpoint.interval=0", f"run.dir={tmp_path}"]
    first = run_cli(*args, "trainer.max_steps=1")
    assert first.returncode == 0, first.stderr[-3000:]
    proc = run_cli(*args, "trainer.max_steps=3", env={"SHARDTRAIN_FAULT": "resume:0:1:signal=SIGTERM"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "preemption (SIGTERM): saving at step 2 and stopping" in proc.stderr
    assert (tmp_path / "checkpoints" / "step-2").is_dir()


def test_a_preemption_save_does_not_wait_for_evaluation(tmp_path):
    """Rank 0 is signalled after step 3; step 4 agrees to stop, and its save comes before the
    evaluation due at step 4 would (it ate the scheduler's grace period before the SIGKILL). The
    checkpoint records the evaluation as due, and the resume runs it first, judging it for
    keep_best, also when step 4 is the last (it was lost for good: found by review), and prunes the
    step it puts out of the ranking (step 2, best before: it stayed beyond keep_last and keep_best
    for good, as no save followed; found by review)."""
    run_dir = tmp_path / "run"
    args = [*QUICK, "trainer.devices=2", "trainer.eval_every=2", "checkpoint.interval=0",
            "checkpoint.keep_best=1", "checkpoint.keep_last=1", f"run.dir={run_dir}"]
    proc = run_cli("train", *args, "trainer.max_steps=8", env={"SHARDTRAIN_FAULT": "step:0:3:signal=SIGTERM"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "preemption (SIGTERM): saving at step 4" in proc.stderr, proc.stderr[-3000:]
    records = read_metrics(run_dir)
    assert records[-1]["step"] == 4 and "val_loss" not in records[-1], records[-1]
    state = json.loads((run_dir / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert state["evaluation_due"] is True
    # Resumed into another run.dir, the skipped evaluation counts for early stopping but ranks
    # nothing there: step 4 is not that run's (found by review: best linked to a missing step-4).
    other = tmp_path / "other"
    proc = run_cli("train", *args[:-1], f"run.dir={other}", "trainer.max_steps=4",
                   f"checkpoint.resume={run_dir / 'checkpoints' / 'step-4'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the evaluation the preemption skipped runs now" in proc.stderr
    assert "ranks among" not in proc.stderr
    assert not (other / "checkpoints" / "best").exists()
    assert json.loads((run_dir / "checkpoints" / "step-4" / "trainer_state.json").read_text()) == state
    resumed = run_cli("train", *args, "trainer.max_steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step 4: the evaluation the preemption skipped runs now" in resumed.stderr
    assert "nothing to do" not in resumed.stderr, resumed.stderr[-3000:]
    records = read_metrics(run_dir)
    assert records[-1]["step"] == 4 and records[-1]["val_loss"] > 0, records[-1]
    assert os.readlink(run_dir / "checkpoints" / "best") == "step-4"  # it ranked: the link moved
    assert "at step 4 ranks among the 1 best; its checkpoint, just resumed, is kept" in resumed.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["best", "step-4"]
    # The checkpoint records the evaluation as run: the same command again has nothing to do (found by
    # review: each re-run evaluated, sampled and logged step 4 again).
    logged = (run_dir / "metrics.jsonl").read_text()
    again = run_cli("train", *args, "trainer.max_steps=4")
    assert again.returncode == 0 and "nothing to do: step 4 >= trainer.max_steps=4" in again.stderr
    assert (run_dir / "metrics.jsonl").read_text() == logged
    saved = json.loads((run_dir / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert saved["evaluation_due"] is False and saved["best"]["ranking"][0][0] == 4


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("good")
    proc = run_cli("train", *QUICK, "trainer.max_steps=2", "checkpoint.save_full=true",
                   f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir / "checkpoints" / "step-2"


def test_a_resume_takes_the_optimizer_settings_built_now(tmp_path):
    """Found by review: loading the optimizer's state put the saved groups' settings in place of the
    ones built now: a checkpoint saved with foreach AdamW (every one from before fused became the
    default) made the fused optimizer take the foreach path, which failed at the first step
    ("Expected grad_scale and found_inf to be None"), and a changed weight decay was ignored."""
    first = run_cli("train", *QUICK, "trainer.max_steps=2", "trainer.optimizer_kernel=foreach",
                    f"run.dir={tmp_path}")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_cli("train", *QUICK, "trainer.max_steps=3", "trainer.weight_decay=0.05",
                      "trainer.log_every=1", f"run.dir={tmp_path}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "the optimizer's settings differ from the checkpoint's (trainer.weight_decay 0.1 -> 0.05): its " \
           "moments are the checkpoint's, the new values apply from step 3" in resumed.stderr
    assert [r["step"] for r in read_metrics(tmp_path) if r["kind"] == "train"][-1] == 3
    # A newer shardtrain's checkpoint stops resume=auto with one line: not skipped as damage for an
    # older one and later moved aside (found by review).
    state_file = tmp_path / "checkpoints" / "step-3" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "format": "shardtrain-checkpoint-v2",
                                      "versions": {**state["versions"], "shardtrain": "9.0"}}))
    newer = run_cli("train", *QUICK, "trainer.max_steps=4", f"run.dir={tmp_path}")
    assert newer.returncode == 2, newer.stderr[-3000:]
    assert "is in format 'shardtrain-checkpoint-v2', written by shardtrain 9.0" in newer.stderr
    assert "skipping" not in newer.stderr and state_file.is_file()


def test_save_full_matches_consolidation_and_inspect_describes_it(good_checkpoint, tmp_path):
    from safetensors.torch import load_file

    from shardtrain.export.consolidate import consolidate

    full = load_file(good_checkpoint / "model.safetensors")
    consolidated_file = consolidate(good_checkpoint, tmp_path / "m.safetensors")[0]
    consolidated = load_file(consolidated_file)
    # Readable as any other file written here (found by review: safetensors writes 0600 whatever the
    # umask, so a shared cluster's serving job could not read an export).
    umask = os.umask(0o077)
    os.umask(umask)
    for written in (good_checkpoint / "model.safetensors", consolidated_file):
        assert written.stat().st_mode & 0o777 == 0o666 & ~umask, (written, oct(written.stat().st_mode))
    assert full.keys() == consolidated.keys()
    assert all(__import__("torch").equal(full[k], consolidated[k]) for k in full)
    # both record the windows the run's evaluations scored, which `eval` of the file defaults to
    from shardtrain.checkpoint.weights import eval_settings_of

    run = json.loads((good_checkpoint / "trainer_state.json").read_text())["config"]["trainer"]
    for written in (good_checkpoint, good_checkpoint / "model.safetensors", consolidated_file):
        assert eval_settings_of(written) == {"seq_len": run["seq_len"], "eval_samples": run["eval_samples"]}
    # damaged (found by the diff review: a traceback, in generate too, and a seq_len of 0 divided by
    # zero): one line naming the key and what to do; generate does not read it
    from safetensors import safe_open
    from safetensors.torch import save_file

    from shardtrain.errors import CheckpointError

    with safe_open(str(consolidated_file), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    damaged = tmp_path / "damaged.safetensors"
    for value in ('{"seq_len": 6', "5", '{"seq_len": "abc", "eval_samples": 2}',
                  '{"seq_len": 0, "eval_samples": 2}'):
        save_file(tensors, str(damaged), {**metadata, "shardtrain_eval_settings": value})
        with pytest.raises(CheckpointError, match="metadata shardtrain_eval_settings is damaged"):
            eval_settings_of(damaged)
    proc = run_cli("eval", str(damaged))
    assert proc.returncode != 0 and "shardtrain_eval_settings is damaged" in error_line(proc), proc.stderr
    assert run_cli("eval", str(damaged), "--seq-len", "16", "--samples", "4").returncode == 0
    generated = run_cli("generate", str(damaged), "--prompt", "x", "--max-new-tokens", "2")
    assert generated.returncode == 0, generated.stderr[-2000:]
    # Found by review: with tied embeddings every save failed (the two names share memory, which
    # safetensors refuses), and the file lacked the model's config that generate and eval read.
    tied = run_cli("train", *QUICK, "trainer.max_steps=1", "checkpoint.save_full=true",
                   "model.tie_embeddings=true", f"run.dir={tmp_path / 'tied'}")
    assert tied.returncode == 0, tied.stderr[-3000:]
    tied_file = tmp_path / "tied" / "checkpoints" / "step-1" / "model.safetensors"
    tied_full = load_file(tied_file)
    assert tied_full["tok_embeddings.weight"].equal(tied_full["output.weight"])
    generated = run_cli("generate", str(tied_file), "--prompt", "x", "--max-new-tokens", "2", timeout=120)
    assert generated.returncode == 0, generated.stderr[-2000:]
    report = run_cli("inspect", str(good_checkpoint))
    assert report.returncode == 0
    for expected in ("shardtrain checkpoint (DCP)", "complete:   yes", "step:       2",
                     "world size: 1", "strategy:   FULL_SHARD", "problems:   none found"):
        assert expected in report.stdout, report.stdout
    # Found by review: without its trainer_state.json (written last) it read as a complete plain DCP
    # directory, though resume, generate and export refuse it; a negative count passed too.
    from shardtrain.checkpoint.inspect import inspect_path

    without_state = shutil.copytree(good_checkpoint, tmp_path / "without_state")
    (without_state / "trainer_state.json").unlink()
    report = inspect_path(without_state)
    assert (report.format, report.complete) == ("shardtrain checkpoint (DCP)", False)
    assert report.problems == [
        f"checkpoint {str(without_state)!r} has no trainer_state.json: it is not a complete shardtrain "
        "checkpoint (model.init_from accepts plain DCP directories)"]
    negative = shutil.copytree(good_checkpoint, tmp_path / "negative")
    state = json.loads((negative / "trainer_state.json").read_text())
    (negative / "trainer_state.json").write_text(json.dumps({**state, "consumed_samples": -10}))
    assert inspect_path(negative).problems == [
        f"checkpoint {str(negative)!r}: trainer_state.json field 'consumed_samples' is -10, less than 0; the "
        "file is damaged, use another checkpoint"]


def damaged_copy(good, tmp_path, damage: str):
    target = tmp_path / "bad"
    shutil.copytree(good, target)
    if damage == "truncated":
        shard = target / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:1000])
    elif damage == "no_metadata":
        (target / ".metadata").unlink()
    elif damage == "file":
        shutil.rmtree(target)
        target.write_text("not a checkpoint")
    elif damage == "empty":
        shutil.rmtree(target)
        target.mkdir()
    elif damage == "zeroed":  # the right size, so only a checksum (verify_checksums=false: none) tells
        shard = target / "__0_0.distcp"
        shard.write_bytes(bytes(shard.stat().st_size))
    return target


@pytest.mark.parametrize(
    ("damage", "extra", "message"),
    [
        ("truncated", [], "shard file __0_0.distcp is truncated"),
        ("no_metadata", [], "has no .metadata: the save did not finish"),
        ("file", [], "is a file, not a checkpoint directory"),
        ("empty", [], "is empty"),
        (None, ["model.dim=48", "model.n_heads=4"], "it was saved with other settings: model.dim 36 -> "
                                                    "48, model.n_heads 6 -> 4"),
        (None, ["model.n_layers=4"], "missing keys: model.layers.3."),
        # the same tensors grouped otherwise: torch's RuntimeError, found by review
        (None, ["model.tie_embeddings=true"], "does not fit this model's parameters (Missing optimizer "
                                              "state for parameter 'output.weight' in checkpoint); it was "
                                              "saved with other settings: model.tie_embeddings False -> "
                                              "True; use the settings it was saved with"),
        # DCP's own failure (a CheckpointException, which is no Exception): its cause, not its ranks
        ("zeroed", ["checkpoint.verify_checksums=false"], "failed on rank 0: UnpicklingError: "),
    ],
)
def test_bad_checkpoints_fail_fast_with_their_own_message(good_checkpoint, tmp_path, damage, extra, message):
    path = damaged_copy(good_checkpoint, tmp_path, damage) if damage else good_checkpoint
    proc = run_cli("train", *QUICK, *extra, f"checkpoint.resume={path}",
                   f"run.dir={tmp_path / 'run'}", timeout=120)  # a hang fails here
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    if damage == "zeroed":  # the failure record (what the launcher reports at many ranks) says it too
        assert f"reading checkpoint {path} {message}" in error_line(proc)
        record = json.loads((tmp_path / "run" / "failures" / "rank-0.json").read_text())
        assert record["type"] == "CheckpointError" and message in record["message"], record
    if damage in ("truncated", "no_metadata", "empty"):
        consolidated = run_cli("consolidate", str(path), str(tmp_path / "out"))
        assert consolidated.returncode == 2 and message in consolidated.stderr
    if damage == "no_metadata":  # save_full: its model.safetensors does not make it a consolidated file
        inspected = run_cli("inspect", str(path))
        assert inspected.returncode == 1 and "complete:   no" in inspected.stdout, inspected.stdout


def test_a_run_directory_given_for_a_checkpoint_names_its_newest(good_checkpoint, tmp_path):
    """Found by review: a run.dir (or its checkpoints directory) where a checkpoint was asked for
    said "the save did not finish"; it names the newest complete checkpoint instead."""
    run_dir = good_checkpoint.parent.parent
    for given, kind in ((run_dir, "a run directory"),
                        (run_dir / "checkpoints", "a run's checkpoints directory")):
        for command in (["consolidate", str(given), str(tmp_path / "out")], ["inspect", str(given)]):
            proc = run_cli(*command)
            assert proc.returncode == 2 and proc.stderr.strip() == (
                f"shardtrain: error: '{given}' is {kind}, not a checkpoint; its newest complete checkpoint "
                f"is {good_checkpoint}"), (command, proc.stderr)


def test_an_unfinished_save_is_not_read(good_checkpoint, tmp_path):
    """Found by review: a save killed before its commit (a .step-N.tmp holding its files) was
    consolidated as if whole, with a word on checksums only; found by the walkthrough: resume,
    generate, eval and model.init_from read one (and a .step-N.deleting), which the docs say is
    never loaded. Every reader refuses it; inspect still looks inside."""
    unfinished = tmp_path / ".step-9.tmp"
    shutil.copytree(good_checkpoint, unfinished)
    message = ("is a save that did not finish (its commit, the rename to step-9, never happened); use a "
               "complete")
    for command in (["consolidate", str(unfinished), str(tmp_path / "out.safetensors")],
                    ["generate", str(unfinished), "--prompt", "a", "--max-new-tokens", "2"],
                    ["eval", str(unfinished)],
                    ["train", *QUICK, f"checkpoint.resume={unfinished}", f"run.dir={tmp_path / 'r1'}"],
                    ["train", *QUICK, f"model.init_from={unfinished}", f"run.dir={tmp_path / 'r2'}"]):
        proc = run_cli(*command)
        assert proc.returncode == 2 and message in proc.stderr, (command, proc.stderr[-2000:])
    inspected = run_cli("inspect", str(unfinished))
    assert inspected.returncode == 1 and message in inspected.stdout, inspected.stdout
    deleting = unfinished.rename(tmp_path / ".step-9.deleting")
    proc = run_cli("generate", str(deleting), "--prompt", "a")
    assert proc.returncode == 2 and "is a checkpoint whose deletion did not finish (step-9)" in proc.stderr


def test_resume_none_refuses_to_overwrite_checkpoints(good_checkpoint, tmp_path):
    proc = run_cli("train", *QUICK, "checkpoint.resume=none", f"run.dir={good_checkpoint.parent.parent}")
    assert proc.returncode == 2 and "would overwrite them" in proc.stderr
    # ... but a Slurm requeue of the same command goes on from its own (found by review: a job
    # started with resume=none, preempted and requeued, ended with that refusal)
    same = [*QUICK, "checkpoint.resume=none", "trainer.max_steps=4", f"run.dir={tmp_path / 'requeued'}"]
    proc = run_cli("train", *same, env={"SHARDTRAIN_FAULT": "step:0:1:signal=SIGTERM"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "preemption (SIGTERM): saving at step 2" in proc.stderr
    proc = run_cli("train", *same, env={"SLURM_RESTART_COUNT": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "were saved by an earlier attempt or job of it: going on from the newest" in proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "requeued")] == [1, 2, 3, 4]
    # Another config in the same run.dir is not this job: refused as before
    proc = run_cli("train", *same, "trainer.lr=0.01", env={"SLURM_RESTART_COUNT": "1"})
    assert proc.returncode == 2 and "would overwrite them" in proc.stderr, proc.stderr[-3000:]


# ---- damage inside files: checksums (issue 12) ---------------------------------------------------


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """A 2-rank run with complete checkpoints every 2 steps to step 10, and its losses."""
    run_dir = tmp_path_factory.mktemp("checksums") / "run"
    proc = run_cli("train", *QUICK, *TEN_STEPS, f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").iterdir())
    assert saved == [2, 4, 6, 8, 10], saved
    return run_dir, [r["loss"] for r in read_metrics(run_dir)]


def test_resume_from_an_older_step_refuses_later_checkpoints_before_launch(two_rank_run):
    """resume=PATH back to step 4 where steps 6-10 of another start lie: the run would save over
    them (its keep_last pruned its own new save, then it stopped at step-6); refused in one line by
    the launching process, nothing touched."""
    run_dir = two_rank_run[0]
    ckpts = run_dir / "checkpoints"
    proc = run_cli("train", *QUICK, *TEN_STEPS, f"checkpoint.resume={ckpts / 'step-4'}", f"run.dir={run_dir}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "already holds later checkpoints (step-6, step-8, step-10)" in error_line(proc), proc.stderr[-999:]
    # found by review: the run started again with a raised max_steps goes on with resume=auto
    assert "use checkpoint.resume=auto; else move them out of" in error_line(proc)
    assert sorted(int(p.name[5:]) for p in ckpts.iterdir()) == [2, 4, 6, 8, 10]


def test_manifest_covers_every_file_and_rng_loads_weights_only(good_checkpoint, caplog):
    import torch

    from shardtrain.checkpoint.integrity import verify_files

    manifest = json.loads((good_checkpoint / "checksums.json").read_text())
    on_disk = {p.name for p in good_checkpoint.iterdir()} - {"checksums.json", "trainer_state.json"}
    assert manifest["algorithm"] == "sha256" and set(manifest["files"]) == on_disk
    assert {".metadata", "__0_0.distcp", "rng-rank0.pt", "model.safetensors"} <= on_disk
    for name, entry in manifest["files"].items():
        data = (good_checkpoint / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    verify_files(good_checkpoint)
    assert not caplog.records  # recorded and matching: silent
    rng = torch.load(good_checkpoint / "rng-rank0.pt", weights_only=True)  # no pickled code
    assert set(rng) >= {"python", "numpy", "torch"}


def test_checkpoint_without_manifest_only_warns(good_checkpoint, tmp_path, caplog):
    import shutil

    from shardtrain.checkpoint.inspect import inspect_path
    from shardtrain.checkpoint.integrity import verify_files
    from shardtrain.errors import CheckpointError

    old = tmp_path / "old"
    shutil.copytree(good_checkpoint, old)
    (old / "checksums.json").unlink()  # as a copy made without it: its save recorded one
    with pytest.raises(CheckpointError, match=r"checksums.json is missing, though its save wrote one: the "
                                              r"checkpoint is incomplete \(copied without it\?\)"):
        verify_files(old)  # found by review: read as an older checkpoint, verified by nothing
    (old / "checksums.json").write_text("{}")  # the walkthrough: "is unreadable ('files')"
    with pytest.raises(CheckpointError, match=r"checksums.json is unreadable \(no 'files' entry\); the"):
        verify_files(old)
    (old / "checksums.json").unlink()
    assert inspect_path(old).details["checksums"] == "missing (its save wrote them)"
    state = json.loads((old / "trainer_state.json").read_text())
    assert state.pop("checksums") is True
    state.pop("sha256")  # no digest either then
    (old / "trainer_state.json").write_text(json.dumps(state))  # as saved before checksums existed
    verify_files(old)
    assert "no checksums recorded" in caplog.text
    report = inspect_path(old)
    assert report.complete and report.details["checksums"].startswith("none recorded")


def damage_file(file, how: str) -> None:
    data = bytearray(file.read_bytes())
    if how == "zero_head":  # a zeroed 4 KiB block at the start, as a bad disk or copy leaves it
        data[:4096] = bytes(4096)
    elif how == "flip":
        data[len(data) // 2] ^= 0x01
    elif how == "garble":  # same length: only the checksum can tell
        data[100:612] = b"\xab" * 512
    elif how == "truncate":
        data = data[: len(data) // 2]
    file.write_bytes(bytes(data))


DAMAGE = [  # (file, how, what every command must name, the step damaged for the fall-back test)
    ("__0_0.distcp", "zero_head", "__0_0.distcp is damaged (sha256 ", 10),
    ("__1_0.distcp", "flip", "__1_0.distcp is damaged (sha256 ", 8),
    ("rng-rank0.pt", "garble", "rng-rank0.pt is damaged (sha256 ", 6),
    ("trainer_state.json", "truncate", "trainer_state.json is unreadable", 4),
]


def error_line(proc) -> str:
    """The one line the CLI prints for a user error (no traceback)."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("shardtrain: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def damage_and_describe(checkpoint, name: str, how: str, message: str) -> str:
    """Damage ``name`` in ``checkpoint``; what every report of it must say (a checksum mismatch
    shows the found and the recorded sums)."""
    damage_file(checkpoint / name, how)
    if how == "truncate":
        return message
    recorded = json.loads((checkpoint / "checksums.json").read_text())["files"][name]["sha256"]
    found = hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()
    return f"{message}{found}, recorded {recorded})"


@pytest.mark.parametrize(("name", "how", "message", "step"), DAMAGE, ids=[d[1] for d in DAMAGE])
def test_damage_inside_a_file_is_named(two_rank_run, tmp_path, name, how, message, step):
    import shutil

    damaged = tmp_path / "step-4"
    shutil.copytree(two_rank_run[0] / "checkpoints" / "step-4", damaged)
    message = damage_and_describe(damaged, name, how, message)

    inspect = run_cli("inspect", str(damaged))
    assert inspect.returncode == 1 and message in inspect.stdout, inspect.stdout
    if how != "truncate":
        assert f"checksums:  damaged: {name}\n" in inspect.stdout

    consolidated = run_cli("consolidate", str(damaged), str(tmp_path / "out"))
    if name.startswith("rng-"):  # never read to export the model: not hashed either
        assert consolidated.returncode == 0, consolidated.stderr[-3000:]
    else:
        assert message in error_line(consolidated)

    explicit = run_cli("train", *QUICK, "trainer.max_steps=6", f"checkpoint.resume={damaged}",
                       f"run.dir={tmp_path / 'explicit'}", timeout=120)
    assert message in error_line(explicit)  # a path given by hand never falls back

    # Reading the weights alone (generate, eval, model.init_from) checks the files it reads too: a
    # flipped bit generated from a wrong weight, silently (found by review).
    generated = run_cli("generate", str(damaged), "--prompt", "x", "--max-new-tokens", "2", timeout=120)
    if name.startswith("rng-"):
        assert generated.returncode == 0, generated.stderr[-3000:]
    else:
        assert message in error_line(generated)
    if how == "flip":  # one bit of a weight or a moment: read anyway when asked to
        anyway = run_cli("generate", str(damaged), "--prompt", "x", "--max-new-tokens", "2",
                         "--skip-checksums", timeout=120)
        assert anyway.returncode == 0, anyway.stderr[-3000:]
        exported = run_cli("export-hf", str(damaged), str(tmp_path / "hf"), "--skip-checksums", "--no-verify")
        assert exported.returncode == 0, exported.stderr[-3000:]


# Runs commands through shardtrain's main() in one process and reports, after each, its exit status
# and the gloo threads still alive (Linux names them gloo_tcp_loop, pt_gloo_runloop).
GLOO_THREADS_AFTER = """
import json, os, sys, time
from shardtrain.cli.main import main

def gloo_threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{task}/comm").read().strip()
        except OSError:  # a thread that ended while listed
            continue
        names += [name] if "gloo" in name else []
    return names

def left_after(argv):
    status = main(argv)
    # A group being torn down may end its threads a moment after the command returns (once in
    # CI under load, one thread); a group still held never ends them. Waited for, not sampled.
    deadline = time.monotonic() + 10
    while gloo_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    return status, gloo_threads()

print(json.dumps([left_after(argv) for argv in json.loads(sys.argv[1])]))
"""


def test_no_process_group_thread_outlives_a_command(two_rank_run, tmp_path):
    """DTensor's caches held the meshes, and so gloo's process groups, past destroy_process_group:
    their threads were torn down at interpreter exit, which now and then aborted a command that had
    finished ("terminate called without an active exception", exit -6 where 0 or 2 was due)."""
    import subprocess
    import sys

    from cli_utils import clean_env

    healthy = two_rank_run[0] / "checkpoints" / "step-4"
    damaged = tmp_path / "step-4"
    shutil.copytree(healthy, damaged)
    damage_file(damaged / "__0_0.distcp", "zero_head")
    commands = [["generate", str(healthy), "--prompt", "x", "--max-new-tokens", "2"],  # gathered copy
                ["generate", str(damaged), "--prompt", "x", "--max-new-tokens", "2"],  # checksum error
                ["eval", str(healthy), "--samples", "4", "--seq-len", "32"]]
    script = [sys.executable, "-c", GLOO_THREADS_AFTER, json.dumps(commands)]
    proc = subprocess.run(script, capture_output=True, text=True, timeout=180, env=clean_env(),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [[0, []], [2, []], [0, []]], proc.stderr[-3000:]


def test_resume_falls_back_past_every_damaged_checkpoint(two_rank_run, tmp_path):
    """Steps 4 to 10 each damaged one way: the resume names each, moves it aside when its step is
    saved again, and goes on from step 2 to the uninterrupted run's losses, bit for bit."""
    import shutil

    from shardtrain.checkpoint.inspect import inspect_path

    source, losses = two_rank_run
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    ckpts = run_dir / "checkpoints"
    messages = {step: damage_and_describe(ckpts / f"step-{step}", name, how, message)
                for name, how, message, step in DAMAGE}

    resumed = run_cli("train", *QUICK, *TEN_STEPS, f"run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for step, message in messages.items():
        skipped = [line for line in resumed.stderr.splitlines()
                   if f"resume: skipping {ckpts / f'step-{step}'}:" in line]
        assert len(skipped) == 1 and message in skipped[0], (step, skipped)
    assert f"newest complete checkpoint is {ckpts / 'step-2'} (step 2)" in resumed.stderr
    assert [r["loss"] for r in read_metrics(run_dir)][-8:] == losses[2:10]  # exact, bit for bit
    # each damaged checkpoint was moved aside, not overwritten or deleted; its step saved anew
    aside = {int(p.name.split(".")[0][5:]): p for p in ckpts.iterdir() if ".damaged-" in p.name}
    assert sorted(aside) == sorted(messages)
    for name, _, _, step in DAMAGE:
        original = source / "checkpoints" / f"step-{step}" / name
        assert (aside[step] / name).read_bytes() != original.read_bytes()
        assert inspect_path(ckpts / f"step-{step}").complete  # the new step-N is whole


def test_a_checkpoint_renamed_by_hand_is_named_skipped_and_moved_aside(two_rank_run, tmp_path):
    """Found by a trial: step-10 replaced by a copy of step-8 was trusted by its name: inspect found
    no problem, resume=auto resumed "step-10" at step 8 and then refused at every restart to save
    step 10 over it (a crash loop). It is named, skipped, and moved aside when step 10 is saved."""
    import shutil

    source, losses = two_rank_run
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(ckpts / "step-10")
    shutil.copytree(ckpts / "step-8", ckpts / "step-10")
    message = (f"checkpoint {str(ckpts / 'step-10')!r} holds step 8 (its trainer_state.json), not step 10 "
               "as its name says: copied or renamed by hand; name it step-8, or use another checkpoint")
    inspect = run_cli("inspect", str(ckpts / "step-10"))
    assert inspect.returncode != 0 and f"problem:    {message}" in inspect.stdout, inspect.stdout[-2000:]
    resumed = run_cli("train", *QUICK, *TEN_STEPS, f"run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume: skipping {ckpts / 'step-10'}: {message}" in resumed.stderr, resumed.stderr[-3000:]
    assert f"newest complete checkpoint is {ckpts / 'step-8'} (step 8)" in resumed.stderr
    assert [r["loss"] for r in read_metrics(run_dir)][-2:] == losses[8:10]
    assert [p.name.split(".")[0] for p in ckpts.iterdir() if ".damaged-" in p.name] == ["step-10"]


def test_resume_auto_refuses_when_every_checkpoint_is_damaged(two_rank_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(two_rank_run[0], run_dir)
    for checkpoint in (run_dir / "checkpoints").iterdir():
        damage_file(checkpoint / "__1_0.distcp", "flip")
    proc = run_cli("train", *QUICK, "trainer.max_steps=12", f"run.dir={run_dir}", timeout=120)
    assert "fails its checks" in error_line(proc)
    assert proc.stderr.count("resume: skipping") == 5


def test_consolidate_can_skip_checksums(two_rank_run, tmp_path):
    import shutil

    from shardtrain.errors import CheckpointError
    from shardtrain.export.consolidate import consolidate

    ckpt = tmp_path / "step-4"
    shutil.copytree(two_rank_run[0] / "checkpoints" / "step-4", ckpt)
    damage_file(ckpt / "__1_0.distcp", "flip")  # one bit of a weight or a moment: still loads
    with pytest.raises(CheckpointError, match="__1_0.distcp is damaged"):
        consolidate(ckpt, tmp_path / "a.safetensors")
    assert consolidate(ckpt, tmp_path / "b.safetensors", verify=False)[0].is_file()


def test_the_weights_average_resumes_at_another_world_size_and_consolidates(tmp_path):
    """trainer.ema_decay: saved beside the weights at 2 processes, resumed at 1, the average at step 6
    equals the uninterrupted 1-process run's (within fp32 sums in another order); `consolidate --key
    ema` writes it as a model `generate` reads; a resume from a checkpoint without one starts it from
    the resumed weights, and says so. The split run is started from the whole run's step 2 with
    checkpoint.resume=PATH and requeued at another world size with the same command: the requeue goes
    on from the split run's own step 4 (it was refused: the accumulation steps the global batch gives
    at each world size entered the config's identity)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    # a global batch and a learning rate that stay the same whatever max_steps and the processes
    ema = [*QUICK, "trainer.ema_decay=0.9", "checkpoint.interval=2", "trainer.global_batch_size=4",
           "trainer.min_lr_ratio=1.0", "checkpoint.keep_last=3"]
    split, whole = tmp_path / "split", tmp_path / "whole"
    proc = run_cli("train", *ema, "trainer.devices=1", "trainer.max_steps=6", f"run.dir={whole}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The same command but the processes (Slurm's script passes trainer.num_nodes=$SLURM_NNODES),
    # preempted at step 4 and requeued
    started = [*ema, "trainer.max_steps=6", f"run.dir={split}",
               f"checkpoint.resume={whole / 'checkpoints' / 'step-2'}"]
    proc = run_cli("train", *started, "trainer.devices=2",
                   env={"SHARDTRAIN_FAULT": "step:0:3:signal=SIGTERM"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "preemption (SIGTERM): saving at step 4" in proc.stderr
    proc = run_cli("train", *started, "trainer.devices=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "were saved by an earlier attempt or job of it: going on from the newest" in proc.stderr
    assert [r["step"] for r in read_metrics(split)] == [3, 4, 5, 6]
    read = {}
    for name, run in (("split", split), ("whole", whole)):
        for key in ("ema", "model"):
            out = tmp_path / f"{name}-{key}.safetensors"
            proc = run_cli("consolidate", str(run / "checkpoints" / "step-6"), str(out), "--key", key)
            assert proc.returncode == 0, proc.stderr[-3000:]
            read[name, key] = load_file(str(out))
    assert set(read["split", "ema"]) == set(read["whole", "model"]) and "norm.weight" in read["split", "ema"]
    for key, value in read["whole", "ema"].items():
        gap = float((read["split", "ema"][key] - value).abs().max() / value.abs().max())
        assert gap < 1e-5, (key, gap)  # measured: below 3e-7
        assert not read["whole", "model"][key].equal(value), key  # an average, not the weights
    proc = run_cli("generate", str(tmp_path / "split-ema.safetensors"), "--prompt", "def ",
                   "--max-new-tokens", "4")
    assert proc.returncode == 0 and proc.stdout.startswith("def "), proc.stderr[-3000:]
    # The last step evaluated the weights and their average (swapped in); `eval --ema` reads the
    # average from the checkpoint directory itself: each the loss the run logged, on the same
    # windows, which eval takes from the run by default (QUICK: 16 of 64 tokens; found by review:
    # 256 of 128 were scored unless given)
    logged = read_metrics(whole)[-1]
    assert logged["step"] == 6 and logged["ema_val_loss"] != logged["val_loss"], logged
    for flags, field in (([], "val_loss"), (["--ema"], "ema_val_loss")):
        proc = run_cli("eval", str(whole / "checkpoints" / "step-6"), "--batch-size", "2", *flags)
        assert proc.returncode == 0, proc.stderr[-3000:]
        loss = float(proc.stdout.split("loss ")[1].split()[0])
        assert abs(loss - logged[field]) <= 6e-5, (field, loss, logged[field])  # printed to 4 places
    # The consolidated average scores the same: the file records the run's data as well as its model
    # (found by review: a file was scored on the default data, whatever the run trained on), and the
    # windows its evaluations scored (found by review: 256 of 128 unless given)
    proc = run_cli("eval", str(tmp_path / "whole-ema.safetensors"), "--batch-size", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "in windows of 64" in proc.stdout, proc.stdout
    assert abs(float(proc.stdout.split("loss ")[1].split()[0]) - logged["ema_val_loss"]) <= 6e-5
    proc = run_cli("generate", str(whole / "checkpoints" / "step-6"), "--ema", "--prompt", "def ",
                   "--max-new-tokens", "4")
    assert proc.returncode == 0 and proc.stdout.startswith("def "), proc.stderr[-3000:]
    proc = run_cli("export-hf", str(whole / "checkpoints" / "step-6"), str(tmp_path / "hf-ema"), "--ema")
    assert proc.returncode == 0 and "verified: transformers' logits match" in proc.stdout, proc.stderr[-3000:]
    exported = load_file(str(tmp_path / "hf-ema" / "model.safetensors"))
    assert exported["model.norm.weight"].equal(read["whole", "ema"]["norm.weight"])
    # Weights holding NaN: eval and generate say so in one line (found by review: eval printed "loss
    # nan" and exited 0, greedy generation printed token 0 at every step, sampling a traceback)
    with safe_open(str(tmp_path / "whole-ema.safetensors"), "pt") as opened:
        metadata = opened.metadata()
    broken = load_file(str(tmp_path / "whole-ema.safetensors"))
    broken["norm.weight"] = torch.full_like(broken["norm.weight"], float("nan"))
    save_file(broken, str(tmp_path / "nan.safetensors"), metadata=metadata)
    proc = run_cli("eval", str(tmp_path / "nan.safetensors"), "--batch-size", "2")
    assert proc.returncode == 2 and "the loss is nan (its weights hold NaN or inf" in error_line(proc), \
        proc.stderr[-3000:]
    for flags in ([], ["--temperature", "1"]):
        proc = run_cli("generate", str(tmp_path / "nan.safetensors"), "--prompt", "def ", *flags)
        assert proc.returncode == 2 and "the model's logits are not finite after 0 new token(s)" in \
            error_line(proc), proc.stderr[-3000:]
    # a standard output that is not UTF-8 takes "?" for what it cannot hold (found by review: a
    # UnicodeEncodeError traceback)
    (tmp_path / "données.txt").write_text("def données():\n    return 1\n" * 20)
    proc = subprocess.run([sys.executable, "-m", "shardtrain", "eval",
                           str(tmp_path / "whole-ema.safetensors"), "--file", str(tmp_path / "données.txt"),
                           "--seq-len", "16", "--samples", "4"],
                          capture_output=True, env=clean_env(PYTHONIOENCODING="ascii"), timeout=300)
    assert proc.returncode == 0 and b"donn?es.txt" in proc.stdout, proc.stderr[-3000:]
    # a loss past exp's range is an infinite perplexity (found by review: an OverflowError traceback)
    broken["norm.weight"] = load_file(str(tmp_path / "whole-ema.safetensors"))["norm.weight"] * 1e4
    save_file(broken, str(tmp_path / "scaled.safetensors"), metadata=metadata)
    proc = run_cli("eval", str(tmp_path / "scaled.safetensors"), "--batch-size", "2")
    assert proc.returncode == 0 and "| perplexity inf per byte" in proc.stdout, proc.stderr[-3000:]
    # a file holds one set of weights; a run without an average has none to read
    proc = run_cli("eval", str(tmp_path / "split-ema.safetensors"), "--ema")
    assert "the weights' average (--ema) is read from a checkpoint directory" in error_line(proc)
    plain = tmp_path / "plain"
    proc = run_cli("train", *QUICK, "trainer.max_steps=2", f"run.dir={plain}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("generate", str(plain / "checkpoints" / "step-2"), "--ema", "--prompt", "x")
    assert "holds no weight average (ema.*): its run trained without trainer.ema_decay" in error_line(proc)
    proc = run_cli("train", *ema, "trainer.max_steps=3", f"run.dir={plain}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "holds no weight average; it starts from the resumed weights" in proc.stderr
    # its average kept with another decay, or dropped: each said
    proc = run_cli("train", *ema, "trainer.max_steps=4", "trainer.ema_decay=0.95", "trainer.ema_warmup=true",
                   f"run.dir={plain}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainer.ema_decay 0.9 -> 0.95: the resumed average goes on" in proc.stderr
    assert "trainer.ema_warmup False -> True: the resumed average's decay follows" in proc.stderr
    proc = run_cli("train", *QUICK, "trainer.max_steps=5", f"run.dir={plain}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "holds a weight average (trainer.ema_decay=0.95), which this run does not keep" in proc.stderr


def test_the_best_checkpoints_are_kept_beside_the_newest_across_a_resume(tmp_path):
    """checkpoint.keep_best=2 with keep_last=1: an evaluation that ranks saves its step (no interval
    saves here), and the prune keeps the newest and the two best by the logged value; the ranking
    rides in the trainer state, so a resume at another world size goes on with it. Judged by the
    most val_loss (trainer.monitor_mode=max), which falls at every evaluation here: the first two stay the
    best, kept for their values alone."""
    every_2 = [arg for arg in QUICK if not arg.startswith("trainer.eval_every")] + [
        "trainer.eval_every=2", "checkpoint.interval=0", "checkpoint.keep_last=1", "checkpoint.keep_best=2",
        "trainer.monitor_mode=max"]
    run = tmp_path / "run"
    for devices, steps in ((2, 8), (1, 12)):
        proc = run_cli("train", *every_2, f"trainer.devices={devices}", f"trainer.max_steps={steps}",
                       f"run.dir={run}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        # the first run saves steps 2 and 4 for their rank; the resumed run's evaluations rank none
        assert ("at step 2 ranks among the 2 best; saving it" in proc.stderr) == (steps == 8)
        assert ("ranks among" in proc.stderr) == (steps == 8), proc.stderr[-3000:]
        logged = [(r["step"], r["val_loss"]) for r in read_metrics(run) if "val_loss" in r]
        assert [step for step, _ in logged] == list(range(2, steps + 1, 2))
        assert all(earlier[1] > later[1] for earlier, later in zip(logged, logged[1:])), logged
        saved = run / "checkpoints"
        assert {int(p.name[5:]) for p in saved.glob("step-*")} == {2, 4, steps}, proc.stderr[-3000:]
        assert (saved / "best").resolve() == saved / "step-2"  # the link every command takes as a path
        state = json.loads((saved / f"step-{steps}" / "trainer_state.json").read_text())
        validation = state["best"].pop("validation")  # what makes the windows the same (the resume below)
        assert (validation["seq_len"], validation["document_mask"]) == (64, False)
        assert validation["windows"] > 16
        assert state["best"] == {"monitor": "val_loss", "mode": "max",
                                 "ranking": [list(entry) for entry in logged[:2]],
                                 "best": list(logged[0]), "stale": len(logged) - 1, "stopped_at": None,
                                 "evaluated": 16}  # trainer.eval_samples of experiment=quick
    inspect = run_cli("inspect", str(run / "checkpoints" / "step-12"))
    assert (f"best:       by val_loss (max); kept step-2 {logged[0][1]:.6g}, step-4 {logged[1][1]:.6g}; "
            f"best step 2 ({logged[0][1]:.6g}), 5 evaluation(s) since\n") in inspect.stdout
    # By the least val_loss, one kept, saved asynchronously: each evaluation ranks, saves, and the
    # best before it drops out of the ranking and is pruned when the new one commits. Step 4's commit
    # is held back 6 s: step 6's save waits for it, and its blocked_s counts the wait (found by
    # review: it was left out, near zero where async saves overlap)
    falling = tmp_path / "falling"
    proc = run_cli("train", *every_2[:-2], "checkpoint.keep_best=1", "checkpoint.async=true",
                   "trainer.max_steps=6", f"run.dir={falling}",
                   env={"SHARDTRAIN_FAULT": "commit:0:4:sleep=6"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    blocked = {r["step"]: r["blocked_s"] for r in read_metrics(falling, "checkpoint")}
    assert blocked[6] > 2.0 > blocked[2], blocked
    for step in (2, 4):
        assert (f"deleting step-{step} in the background (checkpoint.keep_last=1, not among the 1 best "
                "by val_loss)") in proc.stderr
    assert sorted(p.name for p in (falling / "checkpoints").iterdir()) == ["best", "step-6"]
    assert os.readlink(falling / "checkpoints" / "best") == "step-6"
    # A failure while an async save is in flight (step 1's, its commit held back 3 s, and every rank
    # failing after step 2): the save commits before the run stops, as a blocking one would have,
    # rather than being abandoned.
    failing = run_cli("train", *QUICK, "checkpoint.interval=1", "checkpoint.async=true",
                      "trainer.max_steps=3", f"run.dir={tmp_path / 'failing'}",
                      env={"SHARDTRAIN_FAULT": "commit:0:1:sleep=3,step:0:2:raise,step:1:2:raise"})
    assert failing.returncode == 1 and "injected fault: rank 0 failed at step of step 2" in failing.stderr
    assert "training stopped with the async save of step 1 in flight: letting it commit" in failing.stderr
    assert sorted(p.name for p in (tmp_path / "failing" / "checkpoints").iterdir()) == ["step-1"]
    # Ctrl-C the same way (found by review: it left only .step-1.tmp, where a blocking save kept step-1)
    stopped = run_cli("train", *QUICK, "checkpoint.interval=1", "checkpoint.async=true",
                      "trainer.max_steps=3", f"run.dir={tmp_path / 'stopped'}",
                      env={"SHARDTRAIN_FAULT": "commit:0:1:sleep=3,step:0:2:interrupt"})
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "training stopped with the async save of step 1 in flight: letting it commit" in stopped.stderr
    assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()) == ["step-1"]
    # A task's metric misspelt as trainer.monitor stops the run before its first step (it stopped it
    # at the first evaluation, which may be hours in).
    wrong = run_cli("train", *QUICK, "trainer.eval_every=2", "checkpoint.keep_best=1", "trainer.max_steps=2",
                    "trainer.monitor=val_accuracy", f"run.dir={tmp_path / 'wrong'}")
    assert ("trainer.monitor=val_accuracy is not among the values the evaluation logs (val_loss); "
            "choose one of them") in error_line(wrong)
    assert "step 1" not in wrong.stderr and not (tmp_path / "wrong" / "checkpoints").exists()


def test_early_stopping_ends_the_run_and_a_resume_knows_it(tmp_path):
    """trainer.early_stop_patience judged by the most val_loss (which falls at every evaluation here,
    so none after step 2's improves). Patience running out at max_steps is a finished run, which a
    larger max_steps goes on from; before it, the run stops after that evaluation, saved; the same
    command again has nothing to do, and a larger patience goes on to its next stop."""
    every_2 = [arg for arg in QUICK if not arg.startswith(("trainer.eval_every", "trainer.log_every"))] + [
        "trainer.eval_every=2", "trainer.log_every=5", "checkpoint.interval=0", "trainer.monitor_mode=max",
        f"run.dir={tmp_path}"]
    finished = run_cli("train", *every_2, "trainer.max_steps=6", "trainer.early_stop_patience=2")
    assert finished.returncode == 0 and "early stop" not in finished.stderr, finished.stderr[-3000:]
    inspect = run_cli("inspect", str(tmp_path / "checkpoints" / "step-6"))
    assert "; best step 2 (" in inspect.stdout and "), 2 evaluation(s) since\n" in inspect.stdout
    proc = run_cli("train", *every_2, "trainer.max_steps=20", "trainer.early_stop_patience=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "early stop at step 8: val_loss has not improved on " in proc.stderr
    assert "(step 2) by more than 0 in 3 evaluations (trainer.early_stop_patience=2)" in proc.stderr
    # The stop's step is logged with the training since step 5's record (found by review: in none)
    last = read_metrics(tmp_path)[-1]
    assert last["step"] == 8 and "loss" in last and "val_loss" in last, last
    inspect = run_cli("inspect", str(tmp_path / "checkpoints" / "step-8"))
    assert "3 evaluation(s) since; stopped early at step 8\n" in inspect.stdout, inspect.stdout
    records, config = (tmp_path / "metrics.jsonl").read_bytes(), (tmp_path / "config.yaml").read_bytes()
    again = run_cli("train", *every_2, "trainer.max_steps=20", "trainer.early_stop_patience=2",
                    "trainer.sample_tokens=8")
    assert again.returncode == 0 and "nothing to do: the run stopped early at step 8" in again.stderr
    # The run's files as its training left them: no attempt recorded, no sample, its own config.
    assert (tmp_path / "metrics.jsonl").read_bytes() == records and "sample at step" not in again.stderr
    assert (tmp_path / "config.yaml").read_bytes() == config
    longer = run_cli("train", *every_2, "trainer.max_steps=20", "trainer.early_stop_patience=4")
    assert longer.returncode == 0 and "early stop at step 10:" in longer.stderr, longer.stderr[-3000:]
