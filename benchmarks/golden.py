"""Bit-for-bit guard for speed work: the default run's every loss and gradient norm.

``python benchmarks/golden.py record`` runs ``shardtrain train`` with the default configuration at 1
and 2 processes (logging every step; logging changes nothing that is computed) and writes each
step's loss and gradient norm, and the final validation loss, as exact decimal strings to
benchmarks/golden_default.json. ``python benchmarks/golden.py check`` runs the same and fails on the
first value that differs in any bit. Floating-point results depend on the CPU's kernels and the
torch build, so the file records the machine it was made on and the check is meaningful only there;
it is a tool for changes that must not move a bit (speed work), not a CI test.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).parent.parent
GOLDEN = ROOT / "benchmarks" / "golden_default.json"


def default_run(processes: int) -> list[list[str]]:
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run([sys.executable, "-m", "shardtrain", "train", f"trainer.devices={processes}",
                        "trainer.log_every=1", "trainer.progress_bar=false", "run.trackers=[]",
                        f"run.dir={run_dir}"], check=True, capture_output=True)
        records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").open()]
    return [[r["step"], repr(r["loss"]), repr(r["grad_norm"]), repr(r.get("val_loss"))]
            for r in records if r["kind"] == "train"]


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, torch {torch.__version__}"


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "check"
    runs = {str(n): default_run(n) for n in (1, 2)}
    if mode == "record":
        GOLDEN.write_text(json.dumps({"machine": machine(), "runs": runs}, indent=0) + "\n")
        print(f"wrote {GOLDEN}")
        return
    golden = json.loads(GOLDEN.read_text())
    if golden["machine"] != machine():
        print(f"note: recorded on {golden['machine']}, running on {machine()}: bits may differ")
    for n, rows in golden["runs"].items():
        for want, got in zip(rows, runs[n], strict=True):
            if want != got:
                raise SystemExit(f"{n} process(es), step {want[0]}: recorded {want[1:]}, now {got[1:]}")
    print(f"identical: every loss, gradient norm and validation loss of the default run at "
          f"{' and '.join(golden['runs'])} processes")


if __name__ == "__main__":
    main()
