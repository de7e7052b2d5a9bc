"""``shardtrain report`` on real runs: one that crashed and resumed, one with another learning rate.

The plotted data is read back two ways, from the matplotlib figures' artists and from the JSON in
the HTML page, and compared with metrics.jsonl as written.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from cli_utils import SHARDTRAIN, clean_env, run_cli

from shardtrain.diagnostics.failures import record_failure
from shardtrain.errors import ReportError
from shardtrain.report.figures import _draw_line, isolated_points
from shardtrain.report.html import DATA_ID, ending, torchrun_restarts, write_report
from shardtrain.report.panels import PHASES, Line, rate_key, start_markers
from shardtrain.report.runs import load_run, load_runs, read_config, run_names, timeline

STEPS = 8
# Eight steps, a record each, validation every 4 and a checkpoint every 3: the crashed attempt of
# the resumed run logs steps 1-4 and saves step-3, then is killed at step 5 (before its record).
TRAIN = ["train", "experiment=quick", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
         "trainer.eval_every=4", "trainer.sample_tokens=0", "trainer.micro_batch_size=2",
         "run.trackers=[]", "checkpoint.interval=3"]
LR = {"resumed": 0.003, "lower_lr": 0.001}
PANEL_IDS = {"loss_steps", "loss_tokens", "throughput", "mfu", "memory_phases", "peak_memory",
             "data_wait", "grad_norm", "lr", "checkpoints"}
# Panel -> (line label, metrics field) drawn against the step.
STEP_SERIES = {"loss_steps": [("loss", "loss"), ("val_loss", "val_loss")],
               "throughput": [("tokens_per_s", "tokens_per_s")],
               "mfu": [("model_tflops", "model_tflops")],  # CPU: MFU unknown, TFLOP/s drawn instead
               "peak_memory": [("peak_memory_mib", "peak_memory_mib")],
               "data_wait": [("data_wait_pct", "data_wait_pct")],
               "grad_norm": [("grad_norm", "grad_norm")],
               "lr": [("lr", "lr")]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs made concurrently: 'resumed' (killed by an injected fault at step 5, then the same
    command again resumes from step-3 and logs step 4 a second time) and 'lower_lr'."""
    base = tmp_path_factory.mktemp("report")
    resumed, lower = base / "resumed", base / "lower_lr"
    log = open(base / "lower_lr.log", "w")
    other = subprocess.Popen([*SHARDTRAIN, *TRAIN, f"trainer.lr={LR['lower_lr']}", f"run.dir={lower}"],
                             stdout=log, stderr=subprocess.STDOUT, env=clean_env(), stdin=subprocess.DEVNULL)
    try:
        crashed = run_cli(*TRAIN, f"run.dir={resumed}", env={"SHARDTRAIN_FAULT": "step:0:5:kill"})
        assert crashed.returncode != 0, crashed.stderr[-3000:]
        again = run_cli(*TRAIN, f"run.dir={resumed}")
        assert again.returncode == 0, again.stderr[-3000:]
        assert other.wait(timeout=300) == 0, (base / "lower_lr.log").read_text()[-3000:]
    finally:
        if other.poll() is None:
            other.kill()
        log.close()
    return {"resumed": resumed, "lower_lr": lower}


def raw_records(run_dir) -> list[dict]:
    """metrics.jsonl as written, every whole line (the text after the last newline is unfinished)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]]


def latest_per_step(run_dir, kind: str) -> list[dict]:
    by_step = {}
    for record in raw_records(run_dir):
        if record["kind"] == kind:
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def numbers(values) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def same(a, b) -> bool:
    return np.array_equal(np.asarray(numbers(a)), np.asarray(numbers(b)), equal_nan=True)


def artists(figure, gid: str) -> list:
    ax = figure.axes[0]
    return [a for a in [*ax.get_lines(), *ax.patches] if a.get_gid() == gid]


def json_line(data: dict, panel: str, run: str, label: str) -> dict:
    (line,) = [ln for ln in data["panels"][panel]["lines"] if ln["run"] == run and ln["label"] == label]
    return line


def test_report_plots_exactly_the_metrics_of_a_resumed_and_an_overlaid_run(runs, tmp_path):
    # A run still writing: its last line is half a record.
    with open(runs["resumed"] / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "kind": "train", "loss": 4.')
    raw_steps = [r["step"] for r in raw_records(runs["resumed"]) if r["kind"] == "train"]
    assert raw_steps.count(4) == 2 and raw_steps.count(5) == 1  # the crash made step 4 twice

    out = tmp_path / "page" / "report.html"
    proc = run_cli("report", str(runs["resumed"]), str(runs["lower_lr"]), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    pngs = sorted((tmp_path / "page" / "report_files").iterdir())
    assert {p.stem for p in pngs} == PANEL_IDS
    assert all(p.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") for p in pngs)
    page = out.read_text()
    assert "http://" not in page and "https://" not in page  # self-contained: nothing to fetch
    assert page.count("src='data:image/png;base64,") == len(PANEL_IDS)
    data = json.loads(re.search(f'<script type="application/json" id="{DATA_ID}">(.*?)</script>',
                                page, re.S).group(1))

    # How each run ended (a new-user trial found a killed run looked healthy): both finished, and
    # the resumed run's killed attempt wrote no end; killed now, the table says so
    assert page.count("<td>finished</td>") == 2
    resumed = load_run(runs["resumed"])
    assert [start.outcome for start in resumed.starts] == [None, "finished"]
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw_records(runs["resumed"])
                                                  if r["kind"] != "end"))
    assert ending(load_run(killed)) == "no end recorded: still running, or killed without a record"
    with open(killed / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 8, "kind": "end", "time": 2e9, "outcome": "preempted"}) + "\n")
    assert ending(load_run(killed)) == "preempted at step 8"
    record_failure(killed, 1, 7, "RuntimeError", "CUDA error: an illegal memory access")
    assert ending(load_run(killed)).startswith("rank 1 (host ")  # a failure record after the last start
    assert ending(load_run(killed)).endswith("failed first, after step 7: RuntimeError: CUDA error: an "
                                             "illegal memory access")

    report = write_report([runs["resumed"], runs["lower_lr"]], tmp_path / "again.html")
    figures = report.figures
    assert set(figures) == PANEL_IDS == set(data["panels"])

    for run, run_dir in runs.items():
        train = latest_per_step(run_dir, "train")
        assert [r["step"] for r in train] == list(range(1, STEPS + 1))  # one continuous curve
        for panel, series in STEP_SERIES.items():
            for label, field in series:
                held = [r for r in train if field in r]
                steps, values = [r["step"] for r in held], [r[field] for r in held]
                (line,) = artists(figures[panel], f"{run}|{label}")
                assert same(line.get_xdata(), steps) and same(line.get_ydata(), values), (panel, run)
                plotted = json_line(data, panel, run, label)
                assert plotted["x"] == steps and same(plotted["y"], values), (panel, run)
        # Against tokens: the training loss at each record's token count.
        (line,) = artists(figures["loss_tokens"], f"{run}|loss")
        assert same(line.get_xdata(), [r["tokens_seen"] for r in train])
        assert same(line.get_ydata(), [r["loss"] for r in train])
        assert json_line(data, "loss_tokens", run, "loss")["x"] == [r["tokens_seen"] for r in train]
        # Checkpoint saves: the seconds each blocked training.
        saves = latest_per_step(run_dir, "checkpoint")
        assert [r["step"] for r in saves] == [3, 6, 8]
        (line,) = artists(figures["checkpoints"], f"{run}|blocked_s")
        assert same(line.get_xdata(), [3, 6, 8]) and same(line.get_ydata(), [r["blocked_s"] for r in saves])
        assert json_line(data, "checkpoints", run, "blocked_s")["y"] == [r["blocked_s"] for r in saves]
        # Memory by phase: the latest memory record's sharded-state bytes, stacked.
        memory = latest_per_step(run_dir, "memory")[-1]
        for part in ("params", "grads", "optimizer"):
            expected = [memory[f"{phase}.{part}_mib"] for phase in PHASES]
            heights = [bar.get_height() for bar in artists(figures["memory_phases"], f"{run}|{part}")]
            assert same(heights, expected)
            assert data["panels"]["memory_phases"]["bars"]["values"][run][part] == expected
        # The clipping threshold of the config, and the logged norms above it marked.
        (clip,) = artists(figures["grad_norm"], f"{run}|clip")
        assert list(clip.get_ydata()) == [1.0, 1.0]
        clipped = [r["step"] for r in train if r["grad_norm"] > 1.0]
        assert [ln["x"] for ln in data["panels"]["grad_norm"]["lines"]
                if ln["run"] == run and ln["label"] == "clipped"] == ([clipped] if clipped else [])

    # The step logged twice: the record after the resume is the one drawn (throughput differs).
    later = latest_per_step(runs["resumed"], "train")[3]
    earlier = [r for r in raw_records(runs["resumed"]) if r["kind"] == "train" and r["step"] == 4][0]
    assert later["time"] > earlier["time"] and later["tokens_per_s"] != earlier["tokens_per_s"]
    assert json_line(data, "throughput", "resumed", "tokens_per_s")["y"][3] == later["tokens_per_s"]

    # The resume is marked where it happened, on every panel against steps; the other run has none.
    for panel in ("loss_steps", "throughput", "grad_norm", "checkpoints"):
        (marker,) = artists(figures[panel], "resumed|resume")
        assert list(marker.get_xdata()) == [3, 3]
        assert not artists(figures[panel], "lower_lr|resume")
    (marker,) = [m for m in data["panels"]["loss_steps"]["markers"] if m["run"] == "resumed"]
    assert marker["x"] == 3 and marker["kind"] == "resume" and "step-3" in marker["label"]
    attempts = {run["name"]: run["attempts"] for run in data["runs"]}
    assert [a["step"] for a in attempts["resumed"]] == [0, 3]
    assert attempts["resumed"][1]["resumed_from"] == str(runs["resumed"] / "checkpoints" / "step-3")
    assert len(attempts["lower_lr"]) == 1 and attempts["lower_lr"][0]["resumed_from"] is None

    # The configs differ in the learning rate alone (run.dir is each run's name).
    assert data["config_differences"] == {"trainer.lr": [LR["resumed"], LR["lower_lr"]]}
    assert "<td><code>trainer.lr</code></td><td>0.003</td><td>0.001</td>" in page


def test_timeline_drops_what_an_abandoned_attempt_logged_after_the_resume_step():
    """The crashed attempt logged steps 10 and 12 past its checkpoint at 8; the resumed attempt logs
    every 5 steps: step 12 never happened in the run that continues."""
    records = [{"step": 0, "kind": "start"},
               *({"step": s, "kind": "train", "loss": 1.0} for s in (5, 10, 12)),
               {"step": 8, "kind": "checkpoint"},
               {"step": 8, "kind": "start", "resumed_from": "ckpt/step-8", "restart_count": 1},
               *({"step": s, "kind": "train", "loss": 2.0} for s in (10, 15))]
    kinds, starts = timeline(records)
    assert [(r["step"], r["loss"]) for r in kinds["train"]] == [(5, 1.0), (10, 2.0), (15, 2.0)]
    assert [r["step"] for r in kinds["checkpoint"]] == [8]
    assert [(s.step, s.restart_count) for s in starts] == [(0, 0), (8, 1)]
    # A preemption at step 8 skipped its evaluation; the resume runs it and logs it at step 8: its
    # values join the step's record, which keeps the step's loss (found by review: it replaced it).
    records += [{"step": 15, "kind": "start", "resumed_from": "ckpt/step-15"},
                {"step": 15, "kind": "train", "val_loss": 1.5}]
    kinds, _ = timeline(records)
    assert kinds["train"][-1] == {"step": 15, "kind": "train", "loss": 2.0, "val_loss": 1.5}


def test_bad_run_directories_fail_with_one_line(tmp_path, monkeypatch):
    proc = run_cli("report", str(tmp_path / "missing"), "--out", str(tmp_path / "r.html"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"shardtrain: error: run directory '{tmp_path / 'missing'}' does not exist; pass the run.dir of "
        "a training run (the directory holding metrics.jsonl)"]
    with pytest.raises(ReportError, match="has no metrics.jsonl: not a training run directory"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "kind": "start"}\n{"step": 1, "kind": "tr')
    with pytest.raises(ReportError, match="has no training records yet"):
        load_run(tmp_path)
    with pytest.raises(ReportError, match="is a directory"):
        write_report([tmp_path], tmp_path)
    # Found by a new-user trial: what a directory is instead, and a run that will never log a step
    record_failure(tmp_path, 0, 0, "TrackerError", "run.trackers: wandb could not start")
    with pytest.raises(ReportError, match=r"has no training records: the run failed before its first logged "
                                          r"step \(rank 0 \(host .*\) failed first, before its first step "
                                          r"finished: TrackerError: run.trackers: wandb could not start; "):
        load_run(tmp_path)
    # a later attempt, started and not yet logging: the earlier failure is not its (found by review)
    metrics = (tmp_path / "metrics.jsonl").read_text()
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "kind": "start", "time": 4e9}\n')
    with pytest.raises(ReportError, match="has no training records yet"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(metrics)
    (tmp_path / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-2" / "trainer_state.json").write_text("{}")
    (tmp_path / "dry").mkdir()
    (tmp_path / "dry" / "dry-run.jsonl").write_text("")
    monkeypatch.chdir(tmp_path / "checkpoints")  # `report step-2` from inside checkpoints/ (not '.')
    with pytest.raises(ReportError, match=re.escape(f"not its run directory; pass '{tmp_path}'")):
        load_run(Path("step-2"))
    for given, says in ((tmp_path / "checkpoints", f"is a run's checkpoints, not its run directory; pass "
                                                   f"'{tmp_path}'"),
                        (tmp_path / "checkpoints" / "step-2", f"not its run directory; pass '{tmp_path}'"),
                        (tmp_path / "dry", "holds a dry run's records only (dry-run.jsonl)")):
        with pytest.raises(ReportError, match=re.escape(says)):
            load_run(given)
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    for out, png_dir, says in ((tmp_path / "r.png", None, "names an image; --out is the HTML page"),
                               (tmp_path / "r.html", tmp_path / "metrics.jsonl", "--png-dir '"),
                               # found by review: the run's own records were written over
                               (tmp_path / "metrics.jsonl", None, "exists and is not an HTML page")):
        with pytest.raises(ReportError, match=re.escape(says)):
            write_report([tmp_path], out, png_dir)
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics
    (tmp_path / "config.yaml").write_text("a: [\n  b: }")  # found by review: yaml's ParserError
    with pytest.raises(ReportError, match=r"config.yaml is not readable YAML \(while parsing a flow node\)"):
        read_config(tmp_path / "config.yaml")


def test_torchrun_restarts_add_up_over_requeued_jobs(tmp_path):
    """TORCHELASTIC_RESTART_COUNT counts from 0 again in each Slurm job: two requeued jobs that each
    restarted once are two restarts, not the highest count (1)."""
    run_dir = tmp_path / "requeued"
    run_dir.mkdir()
    ckpt = str(run_dir / "checkpoints")
    records = []
    # (step, resumed from, restart count): job 1 starts, torchrun restarts it; Slurm requeues, job 2
    # resumes, torchrun restarts it.
    for first, resumed, restarts in ((0, None, 0), (2, "step-2", 1), (4, "step-4", 0), (6, "step-6", 1)):
        records.append({"step": first, "kind": "start", "resumed": resumed is not None,
                        "resumed_from": f"{ckpt}/{resumed}" if resumed else None,
                        "restart_count": restarts, "world_size": 2})
        records += [{"step": s, "kind": "train", "loss": 1.0 / s, "tokens_seen": 64 * s,
                     "tokens_per_s": 10.0}
                    for s in (first + 1, first + 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "report.html"
    write_report([run_dir], out)
    # attempts, resumes, torchrun restarts
    assert "<td class=num>4</td><td class=num>3</td><td class=num>2</td>" in out.read_text()
    # A job whose restarted attempt failed before writing its start record: its next one counts it.
    assert torchrun_restarts([0, 1, 0, 2]) == 3 and torchrun_restarts([0, 0, 0]) == 0
    # The markers number restarts over the run too (torchrun's count is per job: "restart 1" twice).
    labels = [m.label for m in start_markers(load_runs([run_dir])[0])]
    assert labels[0].endswith("torchrun restart 1, resumed at step 2 (step-2)"), labels
    assert "torchrun restart 2 (1 in this job), resumed at step 6" in labels[2], labels


def test_an_attempt_is_ended_and_named_by_its_own_records(tmp_path, monkeypatch):
    """Found by review: an attempt whose trackers failed to start wrote an end record and no start,
    and the report read its "failed" as the previous attempt's (preempted) ending; the report's
    "ended" column named an earlier attempt's failure where the launcher names the last one's; a
    failure record without its message stopped the report with a KeyError."""
    from shardtrain.diagnostics.failures import first_failure
    from shardtrain.train.metrics import MetricsWriter

    unstarted = MetricsWriter(tmp_path / "unstarted", True)
    unstarted.close("failed", 3)
    assert (tmp_path / "unstarted" / "metrics.jsonl").read_text() == ""
    started = MetricsWriter(tmp_path / "started", True)
    started.write(3, "start", {"resumed": True})
    started.close("failed", 3)
    assert [json.loads(line)["kind"] for line in (tmp_path / "started" / "metrics.jsonl").open()] == [
        "start", "end"]

    run_dir = tmp_path / "restarted"
    run_dir.mkdir()
    records = [{"step": 0, "kind": "start", "time": 1.0, "resumed": False, "restart_count": 0},
               {"step": 1, "kind": "train", "loss": 1.0, "tokens_seen": 64, "tokens_per_s": 10.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    record_failure(run_dir, 3, 1, "RuntimeError", "attempt 0's")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # failed before its start record
    record_failure(run_dir, 0, 1, "CheckpointError", "attempt 1's", exit_status=2)
    assert load_run(run_dir).failure["message"] == "attempt 1's"
    (run_dir / "failures" / "rank-0.json").write_text(json.dumps({
        "rank": 0, "host": "h", "step": 1, "type": "X", "time": 2e9}))  # hand-edited: no message
    assert first_failure(run_dir, 0.0)["message"] == "attempt 0's"


def test_a_task_runs_loss_is_plotted_against_its_own_count(tmp_path):
    """A task counting other units (a DiT's elements) logs ``<unit>_seen``; runs logged before the
    rename kept every task's count as ``tokens_seen``, read the same way."""
    for name, seen in (("new", "elements_seen"), ("old", "tokens_seen")):
        run_dir = tmp_path / name
        run_dir.mkdir()
        # bits_per_s: a task's metric named like a rate, not the throughput (found by review: it took
        # the throughput panel and plotted the loss against a count of 0)
        metric = {"bits_per_s": 7.0} if name == "new" else {}
        records = [{"step": s, "kind": "train", "loss": 1.0 / s, seen: 96 * s,
                    "elements_per_s": 50.0, "samples_per_s": 2.0, **metric} for s in (1, 2, 3)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = write_report([tmp_path / "new", tmp_path / "old"], tmp_path / "report.html")
    for run in ("new", "old"):
        (line,) = artists(report.figures["loss_tokens"], f"{run}|loss")
        assert list(line.get_xdata()) == [96, 192, 288], run
    axes = report.figures["loss_tokens"].axes[0]
    assert (axes.get_xlabel(), axes.get_ylabel()) == ("elements seen", "loss (per element)")
    for run in ("new", "old"):
        assert rate_key([load_run(tmp_path / run)]) == "elements_per_s", run
    page = (tmp_path / "report.html").read_text()
    assert "<th>elements seen</th>" in page and page.count("<td class=num>288</td>") == 2
    # Neither run counted FLOPs: the MFU panel says so, not that the device's peak is unknown (found
    # by review: the reason given was the CPU's, whatever the device)
    (mfu,) = [panel for panel in report.panels if panel.id == "mfu"]
    assert "no FLOPs counted" in mfu.title and "counted no FLOPs" in mfu.note and "peak" not in mfu.note


def test_runs_counting_other_units_are_named_not_plotted_at_zero(tmp_path):
    """A language model's run beside a ViT's: the loss-against-count panel is in tokens, the ViT's
    run is left off it with a note (it was plotted at x = 0), and the table gives each run's own count."""
    for name, fields in (("lm", {"tokens_per_s": 100.0, "samples_per_s": 1.0, "mfu": 0.4}),
                         ("vit", {"samples_per_s": 4.0, "model_tflops": 1.0})):
        run_dir = tmp_path / name
        run_dir.mkdir()
        unit = "tokens" if name == "lm" else "samples"
        records = [{"step": s, "kind": "train", "loss": 1.0 / s, f"{unit}_seen": 10 * s, **fields}
                   for s in (1, 2)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = write_report([tmp_path / "lm", tmp_path / "vit"], tmp_path / "report.html")
    assert artists(report.figures["loss_tokens"], "vit|loss") == []
    (line,) = artists(report.figures["loss_tokens"], "lm|loss")
    assert list(line.get_xdata()) == [10, 20]
    page = (tmp_path / "report.html").read_text()
    assert "Not on this panel, counting another unit: vit (samples)." in page
    # and off the throughput and MFU panels, said there too (found by review: left off silently)
    assert [p.note for p in report.panels if p.id == "throughput"] == [
        "Not on this panel, counting another unit: vit (samples)."]
    assert [p.note for p in report.panels if p.id == "mfu"] == [
        "Not on this panel, MFU unknown (no peak FLOP/s for its device, or no FLOPs counted): vit."]
    assert "<td class=num>20</td>" in page and "<td class=num>20 samples</td>" in page


def test_the_weights_averages_validation_loss_is_drawn_beside_the_weights(tmp_path):
    """trainer.ema_decay's ``ema_val_loss`` is a line of its own (diamonds) on both loss panels, and
    the table's best validation loss names the average's."""
    run_dir = tmp_path / "ema"
    run_dir.mkdir()
    records = [{"step": s, "kind": "train", "loss": 3.0 / s, "tokens_seen": 64 * s, "tokens_per_s": 9.0,
                **({"val_loss": 2.5 / s, "ema_val_loss": 2.25 / s} if s % 2 == 0 else {})}
               for s in (1, 2, 3, 4)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = write_report([run_dir], tmp_path / "report.html")
    for panel, xs in (("loss_steps", [2, 4]), ("loss_tokens", [128, 256])):
        (line,) = artists(report.figures[panel], "ema|ema_val_loss")
        assert [x for x, y in zip(line.get_xdata(), line.get_ydata()) if not math.isnan(y)] == xs
        assert line.get_marker() == "D" and same(
            [y for y in line.get_ydata() if not math.isnan(y)], [1.125, 0.5625])
    page = (tmp_path / "report.html").read_text()
    assert "<td class=num>0.6250 (average 0.5625)</td>" in page


def test_a_point_between_skipped_steps_is_drawn():
    """Found by a new-user trial: a loss logged between two skipped (NaN) steps had no neighbour to
    join, so its line drew nothing; it was in the page's data only."""
    y = np.array([np.nan, 5.5, np.nan, np.nan, 5.1, 5.0, np.nan, 4.8])
    assert isolated_points(y) == [1, 7]
    assert isolated_points(np.array([3.0])) == [0] and isolated_points(np.array([1.0, 2.0])) == []
    figure, ax = plt.subplots()
    _draw_line(ax, Line(run="r", label="loss", x=list(range(8)), y=[None if math.isnan(v) else v for v in y],
                        style="line"), "#000000", "r")
    [drawn] = ax.get_lines()
    assert drawn.get_marker() == "o" and drawn.get_markevery() == [1, 7]
    plt.close(figure)


def test_runs_are_named_apart_and_one_given_twice_is_refused(tmp_path):
    """Found by a new-user trial: the same run twice was overlaid as '1: //tmp/...' and '2: //tmp/...'."""
    assert run_names([Path("/a/x/run"), Path("/b/x/run")]) == ["a/x/run", "b/x/run"]
    assert run_names([Path("/run"), Path("/x/run")]) == ["/run", "x/run"]  # one slash at the root
    (tmp_path / "sub").mkdir()
    with pytest.raises(ReportError, match=r"^'.*/sub/\.\./run' and '.*/run' are the same run directory; give "
                                          "each run once$"):
        load_runs([tmp_path / "run", f"{tmp_path / 'sub'}/../run"])


def test_hand_edited_records_and_odd_run_names_make_a_report(tmp_path):
    """Found by review: a start record's world_size went into the page unescaped (a shared report ran
    the script a string held), a string among the counts stopped the report with a traceback, a run
    directory named with $ failed matplotlib's math parser, and each skipped step was a legend entry
    of its own (100 of them hid the plot)."""
    run_dir = tmp_path / "cost$^$x"
    run_dir.mkdir()
    records = [{"step": 0, "kind": "start", "world_size": "<img src=x onerror=alert(1)>",
                "restart_count": "two", "resumed_from": 5},
               {"step": 0, "kind": "start", "world_size": 2, "restart_count": 0, "time": "noon"},
               {"step": 1, "kind": ["train"]},  # no kind of ours: an unreadable line
               {"step": 1, "kind": "memory", "forward.params_mib": "12", "forward.rss_mib": 30.0}]
    (run_dir / "failures").mkdir()
    (run_dir / "failures" / "rank-0.json").write_text('{"time": "late", "rank": 0}')
    records += [{"step": s, "kind": "train", "loss": 1.0 / s, "tokens_seen": 64 * s, "tokens_per_s": 10.0}
                for s in range(1, 121)]
    records += [{"step": s, "kind": "skip"} for s in range(5, 105)]
    # steps with nothing to learn from (count 0: prompts alone) are not called non-finite (found by review)
    records += [{"step": s, "kind": "skip", "loss": float("nan"), "count": 0} for s in (110, 111)]
    # a key no task's count_unit makes (a markup <th> heading), and an evaluation between logging
    # steps: a train record of val_* fields only (its tokens-seen cell was blank)
    records += [{"step": 121, "kind": "train", "loss": 0.1, "tokens_seen": 64 * 121, "<b>x</b>_per_s": 1.0},
                {"step": 122, "kind": "train", "val_loss": 0.5}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = write_report([run_dir], tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert "<img src=x" not in page and "<td>2</td>" in page
    assert "<b>x</b>" not in page and "<th>tokens seen</th>" in page
    assert f"<td class=num>{64 * 121}</td>" in page
    # The data block holds no markup character: '<!--<script>' in a run's name swallowed the
    # closing </script>, and a browser's JSON.parse of the block failed.
    odd = tmp_path / os.fsdecode(b"<!--<script>\xff")  # and a name that is no UTF-8 (it stopped the page)
    shutil.copytree(run_dir, odd)
    write_report([odd], tmp_path / "odd.html")
    page = (tmp_path / "odd.html").read_text()
    block = re.search(f'<script type="application/json" id="{DATA_ID}">(.*?)</script>', page, re.S).group(1)
    assert "<" not in block and json.loads(block)["runs"][0]["name"] == "<!--<script>\ufffd"
    labels = [t.get_text() for t in report.figures["loss_steps"].legends[0].get_texts()]
    skipped = [label for label in labels if "skipped" in label]
    assert skipped == [r"cost\$^\$x: 100 steps skipped (non-finite)",
                       r"cost\$^\$x: 2 steps skipped (nothing to learn from)"], labels


def test_a_run_named_with_an_underscore_keeps_its_legend_entry_and_nan_losses_draw_none(tmp_path):
    """Found by review: matplotlib leaves labels starting with _ out of the legend (a run directory
    _base had no entry), and a run whose losses were all NaN had legend entries for empty lines."""
    for name, loss in (("_base", 1.0), ("diverged", float("nan"))):
        (tmp_path / name).mkdir()
        records = [{"step": 0, "kind": "start", "world_size": 1, "restart_count": 0}]
        records += [{"step": s, "kind": "train", "loss": loss, "tokens_seen": 64 * s} for s in range(1, 4)]
        # an infinite val_loss after a finite one (a bf16 overflow)
        records += [{"step": 1, "kind": "train", "val_loss": 3.0},
                    {"step": 3, "kind": "train", "val_loss": math.inf}]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = write_report([tmp_path / "_base", tmp_path / "diverged"], tmp_path / "report.html")
    labels = [t.get_text() for t in report.figures["loss_steps"].legends[0].get_texts()]
    assert [label for label in labels if "train loss" in label] == ["\u200b_base: train loss"], labels
    # The summary shows them as logged (found by review: a blank last loss, and the earlier finite
    # val_loss as the best without a word of the infinite one)
    page = (tmp_path / "report.html").read_text()
    assert "<td class=num>nan</td><td class=num>3.000 (1 not finite)</td>" in page
    assert "<td class=num>1.000</td><td class=num>3.000 (1 not finite)</td>" in page
