"""Experiment trackers: TensorBoard, W&B (offline) and MLflow (a file store) receive exactly the
records of metrics.jsonl and the resolved config, a resumed training stays one tracker run, a tracker
that breaks during training is dropped with one line while training finishes, and one that cannot
start stops the run before training with one line.

One training run of six steps and its resume to twelve are read back every way: W&B's own
transaction log (the run-*.wandb files, LevelDB-style blocks of wandb's protobuf records), MLflow's
client, TensorBoard's event reader. Before the resume, the test breaks MLflow's store for real (the
file that holds ``train/val_loss`` is replaced by a directory), so its first validation record fails.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from pathlib import Path

import pytest
from cli_utils import run_cli

from shardtrain.config.loader import load_config
from shardtrain.errors import ConfigError, TrackerError
from shardtrain.train.metrics import MetricsWriter
from shardtrain.train.trackers import (
    FACTORIES,
    FIXES,
    GuardedTracker,
    close_trackers,
    fix_for,
    mlflow_tracking_uri,
    start_trackers,
    start_within,
    tracker_record,
)

TRACKED = ["experiment=quick", "trainer.log_every=2", "trainer.eval_every=3", "checkpoint.interval=3",
           "trainer.sample_tokens=8", "trainer.progress_bar=false",
           "run.trackers=[tensorboard,wandb,mlflow]", "run.offline=true"]


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def expected_values(record: dict) -> dict:
    """What a tracker should hold for one record (docs/metrics.md, trackers): ``kind/key`` names,
    booleans as 0/1, unknown (null) values left out, lists as JSON text."""
    out = {}
    for key, value in record.items():
        if key in ("step", "kind", "time") or value is None:
            continue
        out[f"{record['kind']}/{key}"] = (int(value) if isinstance(value, bool) else
                                          json.dumps(value) if isinstance(value, list) else value)
    return out


def wandb_records(path: Path):
    """The records of a W&B transaction log: a 7-byte header (':W&B', 0xBEE1, version), then 32 KiB
    blocks of chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle,
    4 last) and a piece of a serialized ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, block, pieces = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, chunk_type = struct.unpack("<IHB", data[pos:pos + 7])
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if chunk_type in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def read_wandb(run_dir: Path) -> tuple[set[str], list[dict], dict]:
    """(run ids, history rows without W&B's own keys, config) over every segment, oldest first."""
    ids, rows, config = set(), [], {}
    for segment in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(segment):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "config":
                config.update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                row = {item.key or ".".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return ids, rows, config


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """Six steps with all three trackers, then MLflow's store broken, then resumed to twelve."""
    run_dir = tmp_path_factory.mktemp("tracked")
    first = run_cli("train", *TRACKED, "trainer.max_steps=6", f"run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    first_records = read_records(run_dir)
    ids = json.loads((run_dir / "trackers.json").read_text())
    [mlflow_run] = (run_dir / "mlruns").glob(f"*/{ids['mlflow']}")
    val_loss = mlflow_run / "metrics" / "train" / "val_loss"
    val_loss.unlink()
    val_loss.mkdir()
    second = run_cli("train", *TRACKED, "trainer.max_steps=12", f"run.dir={run_dir}")
    assert second.returncode == 0, second.stderr[-3000:]
    return run_dir, ids, first_records, read_records(run_dir), second


def test_wandb_holds_every_record_and_the_config_in_one_resumed_run(tracked):
    run_dir, ids, first_records, records, second = tracked
    kinds = {r["kind"] for r in records}  # every kind the rows below must carry is there to carry
    assert {"checkpoint", "sample", "memory", "memory_ranks"} <= kinds, kinds
    assert "resumed from" in second.stderr
    resumed = records[len(first_records)]  # the resumed attempt's start record, then its steps
    assert (resumed["kind"], resumed["step"], resumed["resumed"]) == ("start", 6, True)
    assert records[len(first_records) + 1]["step"] > 6
    run_ids, rows, config = read_wandb(run_dir)
    assert run_ids == {ids["wandb"]}  # the resume reopened the same run
    assert rows == [{"step": r["step"], **expected_values(r)} for r in records]
    # The resolved config, flattened; a resume updates what changed.
    assert config["trainer.max_steps"] == 12 and config["run.trackers"] == ["tensorboard", "wandb", "mlflow"]
    assert config["model.n_layers"] == load_config(["experiment=quick"]).model.n_layers


def test_a_broken_tracker_is_dropped_with_one_line_while_training_finishes(tracked, monkeypatch):
    run_dir, ids, first_records, records, second = tracked
    lines = [line for line in second.stderr.splitlines() if "tracker mlflow" in line]
    assert len(lines) == 1 and "failed at step 9" in lines[0] and "Is a directory" in lines[0], lines
    assert "dropped and training goes on" in lines[0] and "Traceback" not in second.stderr
    assert records[-1]["step"] == 12 and any(r["kind"] == "checkpoint" and r["step"] == 12 for r in records)

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((run_dir / "mlruns").as_uri())
    run = client.get_run(ids["mlflow"])
    assert run.data.params["trainer.max_steps"] == "6"  # MLflow keeps a parameter's first value
    assert json.loads(run.data.params["run.trackers"]) == ["tensorboard", "wandb", "mlflow"]
    # Every record before the failing one (the resumed run's first validation), none after it.
    failing = next(i for i, r in enumerate(records) if i >= len(first_records) and "val_loss" in r)
    entries = [{(key, r["step"], int(r["time"] * 1000), float(value))
                for key, value in expected_values(r).items() if not isinstance(value, str)}
               for r in records]
    destroyed = "train/val_loss"  # its history went with the file the test replaced
    before = {entry for entry in set().union(*entries[:failing]) if entry[0] != destroyed}
    held = {(key, m.step, m.timestamp, m.value) for key in run.data.metrics
            for m in client.get_metric_history(ids["mlflow"], key)}
    assert before <= held <= before | entries[failing]
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    texts = {(f"{key}/step-{r['step']:08d}.txt", value) for r in records[:failing]
             for key, value in expected_values(r).items() if isinstance(value, str)}
    assert {"sample/text", "memory_ranks/ranks"} <= {name.rsplit("/", 1)[0] for name, _ in texts}
    assert texts == {(str(p.relative_to(artifacts)), p.read_text()) for p in artifacts.rglob("*.txt")}


def test_tensorboard_holds_every_record(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, _, records, _ = tracked
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    expected: dict[str, list] = {}
    for r in records:
        for key, value in expected_values(r).items():
            if not isinstance(value, str):
                expected.setdefault(key, []).append((r["step"], value))
    assert set(events.Tags()["scalars"]) == set(expected)
    for key, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in points], key
        assert all(v == pytest.approx(w, rel=1e-6, abs=1e-30) for (_, v), (_, w) in zip(got, points)), key
    from shardtrain.train.trackers import verbatim

    samples = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("sample/text/text_summary")]
    # as a markdown code block: TensorBoard rendered a sample's "# comment" as a heading (found by review)
    assert samples == [verbatim(r["text"]) for r in records if r["kind"] == "sample"]
    assert all(line.startswith("    ") for text in samples for line in text.split("\n"))


def test_tensorboard_drops_what_an_abandoned_attempt_logged_after_the_resume_step(tmp_path):
    """Found by review: a run resumed from step 3 after an attempt that logged to step 6 showed
    both attempts' values at steps 4-6 in TensorBoard (the report keeps the run that went on)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from shardtrain.train.trackers import TensorBoardTracker

    run = load_config([f"run.dir={tmp_path}"]).run
    for start_step, steps, loss in ((0, range(1, 7), 1.0), (3, range(4, 6), 2.0)):
        tracker = TensorBoardTracker(run, {}, None, start_step)
        for step in steps:
            tracker.log(tracker_record(step, "train", 0.0, {"loss": loss}))
        tracker.close("finished")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0)]


def test_an_unreachable_tracker_stops_the_run_at_start_up_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    args = ["experiment=quick", "run.trackers=[tensorboard,mlflow]", "run.mlflow.tracking_uri=http://127.0.0.1:1",
            f"run.dir={run_dir}"]
    proc = run_cli("train", *args)  # the launching process checks before any worker starts
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "shardtrain: error: run.trackers: the MLflow tracking server http://127.0.0.1:1 cannot be reached "
        "([Errno 111] Connection refused); start it or fix run.mlflow.tracking_uri, or log to the file "
        "store run.dir/mlruns with run.offline=true"]
    assert not (run_dir / "metrics.jsonl").exists()
    # A worker started by torchrun directly checks again when its trackers start; TensorBoard, started
    # first, is closed.
    with pytest.raises(TrackerError, match="cannot be reached"):
        start_trackers(load_config(args), resuming=False)


def test_the_old_tensorboard_switch_names_its_replacement():
    replaced = r"^run.tensorboard was replaced by run.trackers.*run.trackers=\[\]"
    with pytest.raises(ConfigError, match=replaced):
        load_config(["run.tensorboard=false"])
    with pytest.raises(ConfigError, match="did you mean 'wandb'"):
        load_config(["run.trackers=[wandbb]"])


class Hanging:
    """A tracker whose every call blocks until released: a server that never answers."""

    name, run_id = "hanging", None

    def __init__(self) -> None:
        self.release = threading.Event()

    def log(self, record) -> None:
        self.release.wait()

    def close(self, outcome: str) -> None:
        self.release.wait()


class Raising:
    name, run_id = "raising", None

    def __init__(self) -> None:
        self.calls = 0

    def log(self, record) -> None:
        self.calls += 1
        raise OSError("No space left on device")

    def close(self, outcome: str) -> None:
        self.calls += 1


def test_a_hanging_or_raising_tracker_never_holds_training(caplog):
    hanging, raising, behind = Hanging(), Raising(), Hanging()
    behind.name = "behind"
    guarded = [GuardedTracker(hanging), GuardedTracker(raising), GuardedTracker(behind, max_pending=2)]
    try:
        with caplog.at_level(logging.WARNING, logger="shardtrain"):
            for step in range(1, 6):  # returns at once: trackers only receive on their own threads
                for tracker in guarded:
                    tracker.log(tracker_record(step, "train", 0.0, {"loss": 1.0 / step}))
            close_trackers(guarded, "finished", timeout_s=0.2)
    finally:
        hanging.release.set()
        behind.release.set()
    warnings = sorted(r.getMessage() for r in caplog.records)
    assert len(warnings) == 3, warnings
    assert warnings[0].startswith("tracker behind fell 2 records behind training at step ")
    assert warnings[1].startswith("tracker hanging did not finish within run.tracker_timeout_s=0.2;")
    assert warnings[2].startswith("tracker raising failed at step 1 (OSError: No space left on device); "
                                  "it is dropped")
    assert raising.calls == 1  # dropped: never called again, not even to close


class Recording:
    name, run_id = "recording", None

    def __init__(self) -> None:
        self.outcome: str | None = None

    def log(self, record) -> None:
        pass

    def close(self, outcome: str) -> None:
        self.outcome = outcome


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_under_metrics_jsonl_still_closes_the_trackers():
    """Found by review: the line a full disk refused stayed buffered, closing the file raised it
    again, and the trackers were never closed (MLflow's run left RUNNING), the error masking the
    run's own."""
    writer = MetricsWriter(Path("/dev"), True, "full")
    recording = Recording()
    writer.trackers, writer.tracker_timeout_s = [GuardedTracker(recording)], 5.0
    with pytest.raises(OSError, match="No space left on device"):
        writer.write(1, "train", {"loss": 1.0})
    writer.close("failed", 1)
    assert recording.outcome == "failed" and writer.trackers == []


def test_a_tracker_that_starts_after_the_run_gave_up_on_it_is_closed(monkeypatch):
    """Found by review: a start abandoned at run.tracker_timeout_s went on on its thread, and the run
    it then created stayed open (MLflow's RUNNING for ever). It is closed as failed where it ends."""
    release, started = threading.Event(), Recording()

    def slow_start(*args) -> Recording:
        release.wait()  # a server that answers only after the run has given up
        return started

    monkeypatch.setitem(FACTORIES, "mlflow", slow_start)
    run = load_config(["run.tracker_timeout_s=0.1"]).run
    with pytest.raises(TrackerError, match=r"^run.trackers: mlflow did not start within run.tracker_"):
        start_within("mlflow", run, {}, None)
    [thread] = [t for t in threading.enumerate() if t.name == "shardtrain-tracker-mlflow-start"]
    release.set()
    thread.join(5)
    assert started.outcome == "failed"
    # one that starts in time is the run's, left open for its records
    on_time = Recording()
    monkeypatch.setitem(FACTORIES, "mlflow", lambda *args: on_time)
    assert start_within("mlflow", run, {}, None) is on_time and on_time.outcome is None


def test_mlflow_maps_metric_names_it_refuses_instead_of_dropping_the_run(tmp_path, caplog):
    """MLflow's log_batch refuses a whole batch for one name it does not take (a task metric
    ``acc@1``): every name is mapped once to one it takes, distinct keys stay distinct, and ``loss``
    reaches MLflow at every step."""
    from mlflow.tracking import MlflowClient

    cfg = load_config([f"run.dir={tmp_path}", "run.trackers=[mlflow]", "run.offline=true"])
    [tracker] = start_trackers(cfg, resuming=False)
    values = {"loss": 1.0, "acc@1": 0.5, "acc_1": 0.25, "top k": 2, "a//b": 3, "..": 4, "x" * 300: 5}
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        for step in (1, 2):  # the mapping holds across records, whatever the keys' order
            record = dict(reversed(values.items())) if step == 2 else values
            tracker.log(tracker_record(step, "train", 1.0 * step, record))
        close_trackers([tracker], "finished", timeout_s=30)
    assert not caplog.records  # not dropped
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    names = tracker.tracker.names
    assert names["train/loss"] == "train/loss" and names["train/acc_1"] == "train/acc_1"
    assert names["train/acc@1"].startswith("train/acc_1-") and names["train/top k"] == "train/top k"
    assert names["train/a//b"] == "train/a/_/b" and names["train/.."] == "train/__"
    assert len(names["train/" + "x" * 300]) == 250 and len(set(names.values())) == len(values)
    for key, value in values.items():
        history = client.get_metric_history(tracker.tracker.run_id, names[f"train/{key}"])
        assert [(m.step, m.value) for m in history] == [(1, value), (2, value)], key


def test_a_resume_keeps_the_ids_of_trackers_it_leaves_out_and_names_an_unreadable_file(tmp_path, caplog):
    """Found by a new-user trial: a resume without W&B rewrote trackers.json with MLflow's id alone, so
    the next resume with W&B started a new W&B run; an unreadable trackers.json started new runs of
    every tracker without a word."""
    cfg = load_config([f"run.dir={tmp_path}", "run.trackers=[mlflow]", "run.offline=true"])
    [first] = start_trackers(cfg, resuming=False)
    close_trackers([first], "finished", timeout_s=30)
    ids = json.loads((tmp_path / "trackers.json").read_text())
    (tmp_path / "trackers.json").write_text(json.dumps({**ids, "wandb": "w4nd8"}))
    [resumed] = start_trackers(cfg, resuming=True)
    close_trackers([resumed], "finished", timeout_s=30)
    assert json.loads((tmp_path / "trackers.json").read_text()) == {**ids, "wandb": "w4nd8"}
    (tmp_path / "trackers.json").write_text('{"mlflow": "4f')
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        [fresh] = start_trackers(cfg, resuming=True)
        close_trackers([fresh], "finished", timeout_s=30)
    [warning] = [r.getMessage() for r in caplog.records if "trackers.json" in r.getMessage()]
    assert warning == (f"{tmp_path / 'trackers.json'} cannot be read (JSONDecodeError; kept as "
                       f"{tmp_path / 'trackers.json.unreadable'}): the trackers start new runs instead of "
                       "continuing this run's")
    assert (tmp_path / "trackers.json.unreadable").read_text() == '{"mlflow": "4f'
    assert json.loads((tmp_path / "trackers.json").read_text())["mlflow"] != ids["mlflow"]


def test_a_plain_path_as_the_mlflow_tracking_uri_is_its_file_store(tmp_path, monkeypatch):
    """Found by a new-user trial: run.mlflow.tracking_uri=/shared/mlruns failed with MLflow's
    maintenance-mode refusal and advice to use run.offline; file:///shared/mlruns worked."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)  # undone after: set by the tracker
    for given, store in ((str(tmp_path / "shared"), tmp_path / "shared"),
                         ("./relative", tmp_path / "relative"), ("bare", tmp_path / "bare"),
                         (str(tmp_path / "exp:v2"), tmp_path / "exp:v2")):
        cfg = load_config([f"run.dir={tmp_path / 'run'}", "run.trackers=[mlflow]",
                           f"run.mlflow.tracking_uri={given}"])
        assert mlflow_tracking_uri(cfg.run) == store.as_uri()
        [tracker] = start_trackers(cfg, resuming=False)
        close_trackers([tracker], "interrupted", timeout_s=30)
        assert any(store.glob(f"*/{tracker.tracker.run_id}")), list(store.iterdir())
        # Ctrl-C is the user's stop, not a failure (a trial saw FAILED)
        assert MlflowClient(store.as_uri()).get_run(tracker.tracker.run_id).info.status == "KILLED"
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"  # a local store sends nothing away
    for kept in ("databricks", "databricks-uc", "http://127.0.0.1:5000", "sqlite:///mlflow.db", "file:///x"):
        cfg = load_config(["run.trackers=[mlflow]", f"run.mlflow.tracking_uri={kept}"])
        assert mlflow_tracking_uri(cfg.run) == kept


def test_a_file_in_the_way_of_a_trackers_directory_is_named(tmp_path):
    """Found by a new-user trial: run.dir/wandb as a file got 'log in, or log offline' (the run was
    offline already)."""
    (tmp_path / "wandb").write_text("x")
    try:
        (tmp_path / "wandb" / "offline-run-1").mkdir()
    except NotADirectoryError as exc:
        assert fix_for("wandb", exc) == f"{tmp_path / 'wandb'} is a file where wandb writes a directory: " \
                                        "move it away"
    else:
        raise AssertionError("mkdir under a file succeeded")
    assert fix_for("mlflow", ValueError("bad")) == FIXES["mlflow"]
