"""Experiment trackers: TensorBoard, Weights & Biases and MLflow receive every metrics record (rank 0).

``run.trackers`` names them. Each gets the records ``metrics.jsonl`` gets, and the resolved config,
flattened to dotted keys, as the run's parameters. Values map the same way for every tracker
(``split_values``): numbers (booleans as 0/1) are scalars named ``<kind>/<key>`` at the record's
step; ``null`` (an unknown value, such as MFU on a CPU) is left out; text (a ``sample``) and lists
(the per-rank memory table of ``memory_ranks``, as JSON) go as text: TensorBoard's text tab, a
string in the W&B history, an MLflow artifact ``<kind>/<key>/step-<step>.txt``.
MLflow refuses some names that the others take (``acc@1``), so its metric names are mapped to ones it
accepts (``mlflow_name``; docs/metrics.md says how).

Start-up is strict, training is not. A tracker that is not installed, cannot reach its server or
cannot create its run stops the run before training with one ``TrackerError`` line naming the fix;
once training runs, each tracker lives on its own thread behind a bounded queue (``GuardedTracker``):
the training thread only enqueues, a tracker that raises is reported in one warning line and
dropped, and one that blocks (a hung server, a flush that never returns) is left behind at the end
after ``run.tracker_timeout_s``. Nothing a tracker does can stop or stall training.

A resumed training continues its tracker runs: the W&B and MLflow run ids are kept in
``run.dir/trackers.json`` and reopened when the trainer resumes from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import queue
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torch.utils.tensorboard import SummaryWriter

from shardtrain.config.schema import Config, RunConfig
from shardtrain.errors import TrackerError

log = logging.getLogger("shardtrain")

# The module each optional tracker needs, from the extra ``shardtrain[trackers]``.
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}
INSTALL = "pip install 'shardtrain[trackers]'"
# Where the tracker run ids of a run directory are kept, to continue those runs on resume.
STATE_FILE = "trackers.json"
# Records a tracker may fall behind the training thread before it is dropped (memory stays bounded
# when a server is slower than training).
MAX_PENDING = 10_000
# How a run ended, for the trackers that record it (W&B exit code, MLflow run status).
OUTCOMES = ("finished", "failed", "preempted", "interrupted")
# A character MLflow refuses in a metric name. Its rule is letters, digits, _ - . space / (and ':'
# except on Windows); ASCII only and without ':' so that a server on any platform takes the name.
MLFLOW_REFUSED = re.compile(r"[^A-Za-z0-9_\-. /]")


@dataclass(frozen=True)
class TrackerRecord:
    """One metrics record as trackers take it: numbers apart from text."""

    step: int
    kind: str
    time: float
    scalars: dict[str, float | int]
    texts: dict[str, str]


class Tracker(Protocol):
    name: str
    # What reopens this tracker's run when training resumes (None: nothing to reopen).
    run_id: str | None

    def log(self, record: TrackerRecord) -> None: ...

    def close(self, outcome: str) -> None: ...


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def split_values(values: Mapping[str, Any]) -> tuple[dict[str, float | int], dict[str, str]]:
    """A record's values as (scalars, texts); ``None`` (unknown) is left out, lists become JSON."""
    scalars: dict[str, float | int] = {}
    texts: dict[str, str] = {}
    for key, value in flatten(values).items():
        if value is None:
            continue
        if isinstance(value, bool):
            scalars[key] = int(value)
        elif isinstance(value, (int, float)):
            scalars[key] = value
        elif isinstance(value, str):
            texts[key] = value
        else:
            texts[key] = json.dumps(value)
    return scalars, texts


def tracker_record(step: int, kind: str, time_s: float, values: Mapping[str, Any]) -> TrackerRecord:
    scalars, texts = split_values(values)
    return TrackerRecord(step, kind, time_s, scalars, texts)


def config_params(cfg: Config) -> dict[str, Any]:
    """The resolved config as a tracker run's parameters: one dotted key per setting."""
    return flatten(dataclasses.asdict(cfg))


def missing_packages(trackers: list[str]) -> list[tuple[str, str]]:
    """(tracker, package) for every configured tracker whose package is not installed; found without
    importing it (the launching process checks this before any worker starts)."""
    return [(name, PACKAGES[name]) for name in trackers
            if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None]


def missing_package_error(name: str, package: str) -> TrackerError:
    return TrackerError(f"run.trackers names {name} but the {package} package is not installed; "
                        f"{INSTALL}, or remove {name} from run.trackers")


def load_optional(name: str, module: str) -> Any:
    """The deliberate optional-dependency load of a tracker's library (W&B, MLflow): imported only
    when ``run.trackers`` names it, so neither is needed otherwise. This is the one import made at
    run time outside ``shardtrain/cli``, through importlib on purpose."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise missing_package_error(name, PACKAGES[name]) from exc


# Tracking URIs that are a scheme alone (Databricks' workspace and Unity Catalog), not a path.
MLFLOW_SCHEME_ONLY_URIS = ("databricks", "databricks-uc", "uc")


def mlflow_tracking_uri(run: RunConfig) -> str:
    """run.mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else (and always with run.offline) the
    file store run.dir/mlruns."""
    uri = None if run.offline else (run.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
    # A path: mlruns, ./mlruns, ~/mlruns, /shared/exp:v2/mlruns (a ':' in a directory's name).
    if uri and "://" not in uri and (uri.startswith(("/", ".", "~"))
                                    or ":" not in uri and uri not in MLFLOW_SCHEME_ONLY_URIS):
        # A plain path is a file store to MLflow too; as a file: URI it gets the file store's opt-in
        # below (given as a path, MLflow 3 refused it as a store in maintenance mode).
        return Path(uri).expanduser().resolve().as_uri()
    return uri or (Path(run.dir).resolve() / "mlruns").as_uri()


def check_reachable(uri: str, timeout_s: float) -> None:
    """An HTTP(S) tracking server answers within ``timeout_s`` (any HTTP answer counts: credentials
    are the client's business); other URIs (a file store, databricks) are not probed. MLflow's own
    client would retry a refused connection for minutes before giving up."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
            pass
    except urllib.error.HTTPError as exc:
        if exc.code < 500:  # it answered (perhaps asking for credentials: the client's business)
            return
        raise TrackerError(f"run.trackers: the MLflow tracking server {uri} answers HTTP {exc.code} "
                           f"({exc.reason}); fix the server or run.mlflow.tracking_uri, or log to the "
                           "file store run.dir/mlruns with run.offline=true") from exc
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise TrackerError(f"run.trackers: the MLflow tracking server {uri} cannot be reached ({reason}); "
                           "start it or fix run.mlflow.tracking_uri, or log to the file store "
                           "run.dir/mlruns with run.offline=true") from exc


def mlflow_name(key: str, limit: int) -> str:
    """``key`` as a metric name MLflow accepts: each refused character becomes ``_``, and an empty,
    ``.`` or ``..`` path segment becomes underscores (MLflow refuses a name that a path normalisation
    would change: ``a//b``, ``a/./b``, a trailing ``/``). Past ``limit`` characters it is cut and a
    digest of the whole key appended, so that long keys stay apart."""
    segments = MLFLOW_REFUSED.sub("_", key).split("/")
    name = "/".join("_" * max(1, len(part)) if part in ("", ".", "..") else part for part in segments)
    if len(name) <= limit:
        return name
    # The cut may leave a trailing "/" or "." that would normalise away: strip them before the digest.
    return f"{name[:limit - 9].rstrip('/.')}-{key_digest(key)}"


def key_digest(key: str, salt: int = 0) -> str:
    return hashlib.sha1(f"{key}#{salt}".encode()).hexdigest()[:8]


def verbatim(text: str) -> str:
    """``text`` as TensorBoard's text tab shows it as written: indented four spaces, a markdown code
    block (it renders markdown: a sample's ``# comment`` became a heading, ``__init__`` bold)."""
    return "\n".join(f"    {line}" for line in text.split("\n"))


class TensorBoardTracker:
    name = "tensorboard"
    run_id = None

    def __init__(self, run: RunConfig, params: dict[str, Any], resume_id: str | None = None,
                 start_step: int = 0) -> None:
        # A resumed run appends to the same event directory: TensorBoard joins the files, and its
        # Python reader drops what earlier files logged from purge_step on (an attempt abandoned
        # after the checkpoint this run resumed from; a run started over from step 0), as the report
        # does. Its default fast reader ignores the purge (found by review): docs/metrics.md says so.
        self.writer = SummaryWriter(str(Path(run.dir) / "tensorboard"), purge_step=start_step + 1)
        config = "\n".join(f"{key}: {value}" for key, value in params.items())
        self.writer.add_text("config", verbatim(config))

    def log(self, record: TrackerRecord) -> None:
        for key, value in record.scalars.items():
            self.writer.add_scalar(f"{record.kind}/{key}", value, record.step)
        for key, text in record.texts.items():  # a sample of code: verbatim, not markdown (found by review)
            self.writer.add_text(f"{record.kind}/{key}", verbatim(text), record.step)

    def close(self, outcome: str) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run named run.name in run.wandb.project, its files in run.dir/wandb. Every record is one
    history row, plotted against its training ``step`` (a W&B step metric: a resumed run repeats the
    steps after its last checkpoint, which W&B's own monotonic step would drop)."""

    name = "wandb"

    def __init__(self, run: RunConfig, params: dict[str, Any], resume_id: str | None,
                 start_step: int = 0) -> None:
        # start_step: a run's history keeps each attempt's values of a step (W&B's step metric,
        # MLflow's metric history); only TensorBoard purges.
        wandb = load_optional(self.name, "wandb")
        # Console capture off: the launcher owns the workers' output (console and log file).
        settings = wandb.Settings(console="off", init_timeout=run.tracker_timeout_s,
                                  finish_timeout=run.tracker_timeout_s, quiet=True)
        directory = Path(run.dir).resolve()
        directory.mkdir(parents=True, exist_ok=True)
        # mode None: W&B's own choice (WANDB_MODE, `wandb offline`, else online).
        self.run = wandb.init(project=run.wandb.project, entity=run.wandb.entity, name=run.name,
                              dir=str(directory), mode="offline" if run.offline else None,
                              id=resume_id, resume="allow" if resume_id else None,
                              reinit="create_new", settings=settings)
        # A resumed run may change settings (a raised trainer.max_steps): the newest values win.
        self.run.config.update(params, allow_val_change=True)
        self.run.define_metric("*", step_metric="step")
        self.run_id = self.run.id

    def log(self, record: TrackerRecord) -> None:
        self.run.log({"step": record.step,
                      **{f"{record.kind}/{key}": value for key, value in record.scalars.items()},
                      **{f"{record.kind}/{key}": text for key, text in record.texts.items()}})

    def close(self, outcome: str) -> None:
        self.run.finish(exit_code={"failed": 1, "interrupted": 130}.get(outcome, 0))  # the process's


class MlflowTracker:
    """An MLflow run named run.name in the experiment run.mlflow.experiment. MLflow's ``log_batch``
    refuses a whole batch for one name it does not accept (a task metric ``acc@1``), so every metric
    name is mapped to one it accepts (``mlflow_name``), once per run and the same at every step;
    distinct keys stay distinct (a key whose mapped name another key has already gets a digest of
    itself appended)."""

    name = "mlflow"
    STATUS = {"finished": "FINISHED", "failed": "FAILED", "preempted": "KILLED", "interrupted": "KILLED"}

    def __init__(self, run: RunConfig, params: dict[str, Any], resume_id: str | None,
                 start_step: int = 0) -> None:
        # start_step: a run's history keeps each attempt's values of a step (W&B's step metric,
        # MLflow's metric history); only TensorBoard purges.
        uri = mlflow_tracking_uri(run)
        check_reachable(uri, run.tracker_timeout_s)
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless this is set; mlflow-skinny has no other local
            # store (SQLite needs the full package), and choosing it here is the user's opt-in.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            # A local store sends nothing away: MLflow's telemetry looked up its server (a DNS
            # query from a run told to stay offline) and wrote ~/.config/mlflow.
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        tracking = load_optional(self.name, "mlflow.tracking")
        self.entities = load_optional(self.name, "mlflow.entities")
        self.limits = load_optional(self.name, "mlflow.utils.validation")
        self.client = tracking.MlflowClient(uri)
        self.names: dict[str, str] = {}  # a record's metric key -> its MLflow name
        self.owners: dict[str, str] = {}  # an MLflow name -> the key it stands for
        experiment = self.client.get_experiment_by_name(run.mlflow.experiment)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(run.mlflow.experiment))
        existing = self.resumable(resume_id)
        if existing is None:
            self.run_id = self.client.create_run(experiment_id, run_name=run.name).info.run_id
            self.log_params(params, {})
        else:
            self.run_id = existing.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self.log_params(params, existing.data.params)

    def resumable(self, run_id: str | None) -> Any:
        """The stored run, if this tracking store still has it."""
        if run_id is None:
            return None
        try:
            found = self.client.get_run(run_id)
        except Exception as exc:  # MlflowException, whose code says whether the run is missing
            if getattr(exc, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                raise
            found = None
        if found is None or found.info.lifecycle_stage != "active":
            log.info(f"MLflow run {run_id} (run.dir/{STATE_FILE}) is not in this tracking store; "
                     "starting a new run")
            return None
        return found

    def log_params(self, params: dict[str, Any], existing: dict[str, str]) -> None:
        """MLflow keeps a parameter's first value: on resume only new keys are logged, and changed
        ones are named once (config.yaml in run.dir has this segment's values)."""
        limit = self.limits.MAX_PARAM_VAL_LENGTH
        values = {key: (value if isinstance(value, str) else json.dumps(value))[:limit]
                  for key, value in params.items()}
        changed = [key for key, value in values.items() if key in existing and existing[key] != value]
        if changed:
            log.info(f"MLflow keeps the first value of a parameter; changed since this run started: "
                     f"{', '.join(changed)}")
        fresh = [self.entities.Param(key, value) for key, value in values.items() if key not in existing]
        per_batch = self.limits.MAX_PARAMS_TAGS_PER_BATCH
        for start in range(0, len(fresh), per_batch):
            self.client.log_batch(self.run_id, params=fresh[start:start + per_batch])

    def metric_name(self, key: str) -> str:
        """The MLflow name of metric ``key``: fixed when first seen, so a series never changes name."""
        name = self.names.get(key)
        if name is not None:
            return name
        limit = self.limits.MAX_ENTITY_KEY_LENGTH
        name, salt = mlflow_name(key, limit), 0
        while name in self.owners:  # another key maps here: this one gets a suffix of its own
            salt += 1
            name = f"{mlflow_name(key, limit - 9)}-{key_digest(key, salt)}"
        if name != key:
            log.info(f"MLflow metric {key!r} is logged as {name!r} (MLflow names take only letters, "
                     "digits, _ - . / and spaces, and each key keeps a name of its own)")
        self.names[key], self.owners[name] = name, key
        return name

    def log(self, record: TrackerRecord) -> None:
        stamp = int(record.time * 1000)
        keys = [f"{record.kind}/{key}" for key in record.scalars]
        # Keys MLflow takes as they are claim their names first, so that in a record holding both
        # `acc_1` and `acc@1` the suffix goes to the renamed one, whatever the keys' order.
        limit = self.limits.MAX_ENTITY_KEY_LENGTH
        for key in sorted(keys, key=lambda key: mlflow_name(key, limit) != key):
            self.metric_name(key)
        metrics = [self.entities.Metric(self.names[key], float(value), stamp, record.step)
                   for key, value in zip(keys, record.scalars.values())]
        per_batch = self.limits.MAX_METRICS_PER_BATCH
        for start in range(0, len(metrics), per_batch):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + per_batch])
        for key, text in record.texts.items():
            self.client.log_text(self.run_id, text, f"{record.kind}/{key}/step-{record.step:08d}.txt")

    def close(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, self.STATUS[outcome])


# name -> the tracker's class, made with (run config, params, its stored run id or None).
FACTORIES = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}
FIXES = {
    "wandb": "log in (`wandb login` or WANDB_API_KEY) and check run.wandb.project and run.wandb.entity, "
             "or log offline with run.offline=true",
    "mlflow": "check run.mlflow.tracking_uri and the server, or log to the file store run.dir/mlruns "
              "with run.offline=true",
    "tensorboard": "check that run.dir is writable",
}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


class GuardedTracker:
    """One tracker on its own thread behind a bounded queue. The training thread only enqueues, so a
    tracker that blocks cannot stall a step and one that raises cannot stop training: its first
    error is one warning line, and the tracker is dropped (``metrics.jsonl`` keeps every record)."""

    def __init__(self, tracker: Tracker, max_pending: int = MAX_PENDING) -> None:
        self.tracker = tracker
        self.name = tracker.name
        self.pending: queue.Queue = queue.Queue(maxsize=max_pending)
        self.dropped = False
        self.dropping = threading.Lock()  # the training thread and the tracker's may both drop it
        self.thread = threading.Thread(target=self.work, name=f"shardtrain-tracker-{self.name}",
                                       daemon=True)
        self.thread.start()

    def log(self, record: TrackerRecord) -> None:
        if self.dropped:
            return
        try:
            self.pending.put_nowait(record)
        except queue.Full:
            self.drop(f"fell {self.pending.maxsize} records behind training at step {record.step}")

    def drop(self, reason: str) -> None:
        with self.dropping:
            if self.dropped:
                return
            self.dropped = True
            log.warning(f"tracker {self.name} {reason}; it is dropped and training goes on "
                        "(metrics.jsonl has every record)")

    def work(self) -> None:
        while True:
            item = self.pending.get()
            if self.dropped:
                return
            try:
                if isinstance(item, TrackerRecord):
                    self.tracker.log(item)
                    continue
                self.tracker.close(item)
                return
            except Exception as exc:
                where = f"at step {item.step}" if isinstance(item, TrackerRecord) else "while closing"
                self.drop(f"failed {where} ({first_line(exc)})")
                return

    def start_closing(self, outcome: str) -> None:
        if self.dropped:
            return
        try:
            self.pending.put_nowait(outcome)
        except queue.Full:
            self.drop(f"was {self.pending.maxsize} records behind training at the end")

    def wait(self, deadline: float, timeout_s: float) -> None:
        if self.dropped:
            return
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive() and not self.dropped:
            self.dropped = True
            log.warning(f"tracker {self.name} did not finish within run.tracker_timeout_s={timeout_s:g}; "
                        "left behind (records it had not sent yet may be missing from it)")


def read_run_ids(run_dir: Path) -> dict[str, str]:
    """The tracker runs a resumed run continues. An unreadable file is set aside (its ids may still be
    read by hand) with a warning: the trackers then start new runs, which a silent {} hid."""
    file = run_dir / STATE_FILE
    try:
        ids = json.loads(file.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        ids, why = None, getattr(exc, "strerror", None) or type(exc).__name__
    else:
        why = "not a JSON object of tracker names and run ids"
    if isinstance(ids, dict) and all(isinstance(v, str) for v in ids.values()):
        return ids
    kept = file.with_name(STATE_FILE + ".unreadable")
    try:
        file.replace(kept)
        where = f"kept as {kept}"
    except OSError:
        where = "this run's ids replace it"
    log.warning(f"{file} cannot be read ({why}; {where}): the trackers start new runs instead of "
                "continuing this run's")
    return {}


def start_trackers(cfg: Config, resuming: bool, start_step: int = 0) -> list[GuardedTracker]:
    """Every tracker of ``run.trackers``, started (rank 0 only). ``resuming``: the trainer resumed
    from a checkpoint, so the tracker runs stored in run.dir continue; ``start_step``: the step
    training goes on from. A tracker that cannot start is a ``TrackerError`` (the ones already
    started are closed first)."""
    run = cfg.run
    run_dir = Path(run.dir)
    stored = read_run_ids(run_dir) if resuming else {}
    params = config_params(cfg)
    started: list[Tracker] = []
    try:
        for name in run.trackers:
            if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None:
                raise missing_package_error(name, PACKAGES[name])
            started.append(start_within(name, run, params, stored.get(name), start_step))
        # A tracker left out of this resume keeps its run for a later one: ids are merged, not replaced.
        ids = {**stored, **{t.name: t.run_id for t in started if t.run_id is not None}}
        if ids:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / STATE_FILE).write_text(json.dumps(ids, indent=1) + "\n")
    except BaseException:
        # Closed off the training thread too: a server that hangs must not hold the failure's line;
        # nor a full disk under trackers.json leave the runs open (MLflow's RUNNING for ever).
        close_trackers([GuardedTracker(tracker) for tracker in started], "failed", run.tracker_timeout_s)
        raise
    return [GuardedTracker(tracker) for tracker in started]


def start_within(name: str, run: RunConfig, params: dict[str, Any], resume_id: str | None,
                 start_step: int = 0) -> Tracker:
    """Tracker ``name``, started on a thread of its own within ``run.tracker_timeout_s``: a client's
    own retries (MLflow's: minutes against a server answering 503) cannot hold the run's start. One
    that starts after the run gave up on it is closed as failed on that thread (it created a W&B or
    MLflow run that stayed open, MLflow's RUNNING for ever: found by review)."""
    outcome: dict[str, Any] = {}
    settled = threading.Lock()  # the start's end and the wait's giving up: one before the other

    def start() -> None:
        try:
            tracker = FACTORIES[name](run, params, resume_id, start_step)
        except BaseException as exc:  # handed to the caller's thread
            with settled:
                outcome["error"] = exc
            return
        with settled:
            if "abandoned" not in outcome:
                outcome["tracker"] = tracker
                return
        try:
            tracker.close("failed")
        except Exception as exc:  # noqa: BLE001 (the run has already failed, and said why)
            log.warning(f"tracker {name}, started after run.tracker_timeout_s, did not close: "
                        f"{first_line(exc)}")

    thread = threading.Thread(target=start, name=f"shardtrain-tracker-{name}-start", daemon=True)
    thread.start()
    thread.join(run.tracker_timeout_s)
    with settled:
        if not outcome:
            outcome["abandoned"] = True
    if outcome.get("abandoned"):
        raise TrackerError(f"run.trackers: {name} did not start within run.tracker_timeout_s="
                           f"{run.tracker_timeout_s:g} s; {FIXES[name]}")
    error = outcome.get("error")
    if isinstance(error, TrackerError):
        raise error
    if error is not None:
        raise TrackerError(f"run.trackers: {name} could not start ({first_line(error)}); "
                           f"{fix_for(name, error)}") from error
    return outcome["tracker"]


def fix_for(name: str, error: BaseException) -> str:
    """What to do about a tracker that could not start: for a file in the way of a directory it
    writes (its own under run.dir), that file; else the tracker's usual fixes (a login, a server)."""
    if isinstance(error, (NotADirectoryError, FileExistsError)) and error.filename:
        path = Path(error.filename)
        in_the_way = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if in_the_way is not None:
            return f"{in_the_way} is a file where {name} writes a directory: move it away"
    if isinstance(error, PermissionError) and error.filename:
        return f"{error.filename} cannot be written: give run.dir where this user may write"
    return FIXES[name]


def close_trackers(trackers: list[GuardedTracker], outcome: str, timeout_s: float) -> None:
    """Close every tracker at once, each within the same ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for tracker in trackers:
        tracker.start_closing(outcome)
    for tracker in trackers:
        tracker.wait(deadline, timeout_s)
