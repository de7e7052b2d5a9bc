"""What the experiment trackers cost: start, the training thread's share per record, and close.

``python benchmarks/tracker_cost.py [TRACKERS ...]`` (default: each alone, then all three) starts the
trackers as a run does (offline, in a temporary run.dir), hands them 1,000 records the size of a
``train`` record, and closes them. The per-record time is what the training thread pays (building
the tracker record and enqueueing it); the trackers' own work happens on their threads and shows
in the close, which waits for them to drain.
"""

from __future__ import annotations

import sys
import tempfile
import time

from shardtrain.config.loader import load_config
from shardtrain.train.trackers import close_trackers, start_trackers, tracker_record

RECORDS = 1000
TRAIN_RECORD = {"loss": 4.2, "grad_norm": 1.5, "lr": 3e-3, "peak_memory_mib": 500.0, "tokens_seen": 12345,
                "tokens_per_s": 3000.0, "samples_per_s": 40.0, "model_tflops": 0.001, "mfu": None,
                "data_wait_ms": 0.1, "data_wait_pct": 0.0, "val_loss": 4.0}


def measure(trackers: str) -> str:
    run_dir = tempfile.mkdtemp(prefix="tracker-cost-")
    cfg = load_config(["experiment=quick", f"run.trackers={trackers}", "run.offline=true",
                       f"run.dir={run_dir}"])
    start = time.perf_counter()
    started = start_trackers(cfg, resuming=False)
    logging = time.perf_counter()
    for step in range(1, RECORDS + 1):
        entry = tracker_record(step, "train", time.time(), TRAIN_RECORD)
        for tracker in started:
            tracker.log(entry)
    closing = time.perf_counter()
    close_trackers(started, "finished", timeout_s=600)
    end = time.perf_counter()
    return (f"{trackers}: start {logging - start:.2f} s; training thread "
            f"{1e6 * (closing - logging) / RECORDS:.0f} us per record; close (drain {RECORDS} records "
            f"and finish) {end - closing:.2f} s")


if __name__ == "__main__":
    for choice in sys.argv[1:] or ["[tensorboard]", "[wandb]", "[mlflow]", "[tensorboard,wandb,mlflow]"]:
        print(measure(choice), flush=True)
