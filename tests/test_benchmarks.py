"""The GPU benchmark's worker on this CPU with a tiny model: a lent GPU session has minutes of device
time (benchmarks/gpu_session.sh), too few to find a Python error there. Timings and memory are not
checked (a CPU's say nothing about a GPU's), only that the worker builds and times both loops and
writes its result, with the profile a GPU session renders. Its float8 mode cannot run here (refused
on a CPU, as users are)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_utils import clean_env

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def test_gpu_worker_speed_mode_runs_both_loops_on_cpu(tmp_path):
    # Run from benchmarks/ (its scripts import each other): shardtrain from this checkout.
    path = os.pathsep.join(filter(None, [str(BENCHMARKS.parent), os.environ.get("PYTHONPATH")]))
    env = clean_env(TMPDIR=str(tmp_path), PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
         "gpu_worker.py", "speed", "--model", "llama_tiny", "--seq-len", "32", "--micro-batch", "2",
         "--warmup", "1", "--rounds", "1", "--steps", "1", "--profile-steps", "1"],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["variant"] == {"compile": False, "ac": False} and result["tokens_per_step"] == 64
    assert result["handwritten_layers"] == "plain autograd"
    assert set(result["step_s"]) == {"shardtrain", "handwritten"} and result["ratio"] > 0
    assert 5.0 < result["first_loss"] < 6.0  # ln(256) = 5.55 for a fresh byte-level model
    # The profile: both loops, each operator's self device and host ms per step; rendered as the
    # GPU section renders it (ranked by host time here, where no device time exists).
    profile = result["profile"]
    for loop in ("shardtrain", "handwritten"):
        assert profile[loop]["steps"] == 1 and profile[loop]["wall_ms"] > 0
        assert profile[loop]["ops"]["aten::mm"][1] > 0  # [device ms, host ms, calls]
    spec = importlib.util.spec_from_file_location("benchmarks_run", BENCHMARKS / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    lines = run.gpu_profile_lines([result], top=3)
    assert any("largest differences in self host ms" in line for line in lines)
    assert sum(line.startswith("| `") for line in lines) == 3


def test_the_gpu_profile_counts_each_kernel_once(monkeypatch):
    """Found by review: the device's busy time summed every averaged row, so a kernel counted under
    the operator that launched it and again as its own row, and the user annotations' spans
    (FSDP::pre_forward, the optimizer's step) as device rows: the H200 profile's busy time came to
    three times the profiler's own total."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("benchmarks_gpu_worker", BENCHMARKS / "gpu_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)

    def event(key, device_us, cpu_us, device_type=DeviceType.CPU, annotation=False):
        return SimpleNamespace(key=key, self_device_time_total=device_us, self_cpu_time_total=cpu_us,
                               count=2, device_type=device_type, is_user_annotation=annotation)

    rows = worker.profile_rows([
        event("aten::_fused_adamw_", 26_946, 300),
        event("multi_tensor_apply_kernel", 26_946, 0, DeviceType.CUDA),
        event("FSDP::pre_forward (layers.0)", 0, 120, annotation=True),
        event("FSDP::pre_forward (layers.0)", 700_000, 0, DeviceType.CUDA, annotation=True),
        event("CompiledFxGraph fabc123", 10_000, 50),
        event("triton_poi_fused_0", 10_000, 0, DeviceType.CUDA),
    ], steps=2)
    assert rows["device_busy_ms"] == pytest.approx((26_946 + 10_000) / 1e3 / 2)
    assert set(rows["ops"]) == {"aten::_fused_adamw_", "FSDP::pre_forward (layers.0)", "CompiledFxGraph"}
    assert rows["ops"]["aten::_fused_adamw_"] == pytest.approx([13.473, 0.15, 1.0])


def test_a_section_written_twice_is_one_section(tmp_path):
    """Found by review: the QLoRA section came without its markers, so a second run added a second
    copy; a section without them is now refused before the page is touched."""
    spec = importlib.util.spec_from_file_location("benchmarks_run", BENCHMARKS / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    result = {"variant": "qlora", "model": "llama_1b", "device": "NVIDIA H200", "torch": "2.11.0",
              "micro_batch": 4, "seq_len": 2048, "base_linear_mib": 1.0, "params_mib": 2.0, "grads_mib": 3.0,
              "optimizer_mib": 4.0,
              "peak_mib": 5.0, "tokens_per_s": 6.0, "losses": [7.0]}
    doc = tmp_path / "benchmarks.md"
    for _ in range(2):
        run.write_section(run.QLORA_BEGIN, run.QLORA_END,
                          run.qlora_section("python benchmarks/run.py --only qlora", [result]), doc)
    assert doc.read_text().count("## QLoRA against LoRA (GPU)") == 1
    with pytest.raises(ValueError, match="must start and end with them"):
        run.write_section(run.QLORA_BEGIN, run.QLORA_END, "## QLoRA", doc)


def test_gpu_results_rendered_together_keep_each_files_command_date_and_device(monkeypatch, tmp_path):
    """Found by review: gpu_session.sh's eager, compiled and checks calls (perhaps days or GPUs apart)
    rendered together took one file's command and date for all and called the checks "on the same
    GPU"; a GPU without a known peak crashed the render; a call cut off by its time limit kept no
    float8 or checks result (the worker's one JSON line came at its end)."""
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("benchmarks_run", BENCHMARKS / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    predicted = SimpleNamespace(peak=2**30)  # the simulator's 1.1B step is not this test's subject
    monkeypatch.setattr(run, "simulation_rows", lambda *args: [(predicted, predicted)] * 2)
    archived = json.loads((BENCHMARKS / "results" / "gpu-h200-2026-11-27.json").read_text())
    runs = [dict(r, mfu={"shardtrain": None, "handwritten": None}, peak_flops=None)  # an unlisted GPU
            for r in archived["runs"]]
    command = "python benchmarks/run.py --only gpu --gpu-variants {} --no-checks"
    checks = json.loads((BENCHMARKS / "results" / "gpu-h100-2026-11-22.json").read_text())["checks"]
    results = {"runs": runs, "dates": ["2026-12-01", "2026-12-03"],
               "commands": [command.format("plain ac"), command.format("compile compile+ac")],
               "checks": {**checks, "device": "NVIDIA A100"}, "checks_date": "2026-12-04"}
    del results["checks"]["generation"]  # its call cut off before the last check
    section = run.gpu_section(results)
    assert ("Command: `python benchmarks/run.py --only gpu --gpu-variants plain ac --no-checks`; "
            "`python benchmarks/run.py --only gpu --gpu-variants compile compile+ac --no-checks`") in section
    assert "Date: 2026-12-01, 2026-12-03; device: NVIDIA H200" in section
    assert "MFU against no known peak (MFU n/a)" in section and "| n/a | n/a |" in section
    assert "Functional checks on NVIDIA A100, 2026-12-04 (" in section
    assert "same\n  text: not run." in section and "table logged None: not run." in section
    # the worker's partial result: written whole after each chunk or check, dated
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("benchmarks_gpu_worker", BENCHMARKS / "gpu_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    partial = tmp_path / "checks.json"
    worker.keep_partial(SimpleNamespace(partial=partial), {"runs": [], "checks": {"offload": {"ok": True}}})
    kept = json.loads(partial.read_text())
    assert kept["checks"] == {"offload": {"ok": True}} and run.measured_on(kept) == kept["date"]
    assert [p.name for p in tmp_path.iterdir()] == ["checks.json"]
