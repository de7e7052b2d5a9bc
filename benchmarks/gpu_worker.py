"""The GPU benchmark's worker (started by ``benchmarks/run.py --only gpu`` under torchrun).

``speed``: one process (NCCL, world size 1) builds shardtrain's ``Trainer`` exactly as
``shardtrain train`` does and a hand-written FSDP2 loop on the same model shape, initial weights and
batches, then times whole iterations of each, alternating rounds so that clock and thermal drift hit
both alike. Before the hand-written model exists it also measures shardtrain's own peak memory
(``torch.cuda.max_memory_allocated`` over steady-state steps) against the peak shardtrain logs.

``float8``: shardtrain's bf16-mixed run against the same run with ``strategy.float8=true`` (both
compiled), the same initial weights and batches: tokens/s (the two alternating in chunks of steps)
and both loss curves over ``--train-steps`` steps.

With ``--profile-steps N`` speed also runs N more steps of each loop under ``torch.profiler`` and
records, per operator, its self time on the device and on the host per step (where the two loops'
time differs, op by op, for a session that cannot stay to look).

``checks``: the functional checks a CPU cannot reach: CPU offload keeps pinned host shards and
trains like the on-device run; an asynchronous checkpoint resumes exactly; ``generate`` gives the
same text gathered and unit by unit. Each prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from step_time import tutorial_step
from torch.autograd import DeviceType
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from shardtrain.accelerator import device_peak_flops, peak_memory_mib
from shardtrain.checkpoint.preemption import PreemptionFlag
from shardtrain.config.loader import load_config
from shardtrain.models.llama import Llama
from shardtrain.train.loop import Trainer
from shardtrain.train.optim import build_scheduler

QUIET = ["trainer.max_steps=100000", "trainer.eval_every=0", "trainer.log_every=1000000",
         "trainer.sample_tokens=0", "trainer.progress_bar=false", "run.trackers=[]",
         "checkpoint.interval=0"]


def synchronize() -> None:
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def allocated_mib(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


def max_allocated_mib(device: torch.device) -> float:
    """The allocator's peak since ``reset_peak`` (0 on CPU, where there is none: smoke runs only)."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


# The hand-written loop's model: shardtrain's Llama with plain autograd's norms and SwiGLU, as a
# model of one's own has them and as the CPU ablation gives it (benchmarks/ablation.py); the lean
# layers are one of shardtrain's features. Until 2026-11-27 it had them too (results record it).
HANDWRITTEN_LAYERS = "plain autograd"


def handwritten(cfg, trainer: Trainer, compiled: bool, checkpointed: bool):
    """The FSDP2 tutorial loop on one GPU: blocks then root, bf16 params with fp32 reductions,
    torch.optim.AdamW with the same hyperparameters, torch's clip_grad_norm_, loss.item() for
    logging. Starts from shardtrain's weights (copied), reads shardtrain's batches."""
    device = trainer.env.device
    mesh = trainer.built.mesh
    with torch.device("meta"):
        model = Llama(dataclasses.replace(cfg.model, lean_layers=False))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for index, block in enumerate(model.layers):
        if checkpointed:
            block = checkpoint_wrapper(block)
            model.layers[index] = block
        fully_shard(block, mesh=mesh, mp_policy=mp)
        if compiled:
            block.compile()
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    ours = dict(trainer.model.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            source = ours[name.replace("._checkpoint_wrapped_module", "")]
            param.to_local().copy_(source.to_local() if isinstance(source, DTensor) else source)
        model.init_buffers()
    # torch.optim.AdamW as users write it: its own kernel choice (foreach on a GPU), one group.
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr, eps=cfg.trainer.adam_eps,
                                  betas=(cfg.trainer.beta1, cfg.trainer.beta2),
                                  weight_decay=cfg.trainer.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.trainer)

    return tutorial_step(model, optimizer, scheduler, trainer, cfg.trainer.grad_clip_norm)


def time_rounds(fns: dict, rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each function, one entry per round, the functions alternating."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            synchronize()
            times[name].append((time.perf_counter() - start) / steps)
    return times


def profiled(fn, steps: int, device: torch.device) -> dict:
    """``steps`` calls of ``fn`` under the profiler: wall ms per step and ``profile_rows``."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        synchronize()
        wall = time.perf_counter() - start
    return {"steps": steps, "wall_ms": wall * 1e3 / steps, **profile_rows(prof.key_averages(), steps)}


def profile_rows(events, steps: int) -> dict:
    """The profiler's averaged events as per-step numbers: the device's busy ms (its kernels, as
    torch's own table totals them: not the user annotations' spans, FSDP::pre_forward and the
    optimizer's step, which the profiler also lists as device rows), and each host operator's self
    ms on the device (the kernels it launched; a compiled block's Triton kernels its graph's) and on
    the host, with its calls. Kernels are counted once, under their operators: listed as rows of
    their own too, they were counted two or three times over (busy ms above the wall's)."""
    ops: dict[str, list[float]] = {}
    busy_ms = 0.0
    for e in events:
        if e.device_type != DeviceType.CPU:
            if not e.is_user_annotation:
                busy_ms += e.self_device_time_total / 1e3 / steps
            continue
        # A compiled graph's name carries its hash, another in each loop: one row for all of them.
        key = re.sub(r"CompiledFxGraph \w+", "CompiledFxGraph", e.key)
        row = ops.setdefault(key, [0.0, 0.0, 0.0])
        for index, value in enumerate((e.self_device_time_total, e.self_cpu_time_total)):
            row[index] += value / 1e3 / steps
        row[2] += e.count / steps
    return {"device_busy_ms": busy_ms, "events_per_step": sum(calls for _, _, calls in ops.values()),
            "ops": ops}


def speed(args: argparse.Namespace) -> dict:
    overrides = [*QUIET, f"run.dir={tempfile.mkdtemp()}", f"model={args.model}",
                 f"trainer.seq_len={args.seq_len}", f"trainer.micro_batch_size={args.micro_batch}",
                 "strategy.mixed_precision=bf16-mixed", f"strategy.compile={args.compile}",
                 f"strategy.activation_checkpointing={'all' if args.ac else 'none'}"]
    cfg = load_config(overrides)
    start = time.perf_counter()
    trainer = Trainer.create(cfg)
    build_s = time.perf_counter() - start
    trainer.preemption = PreemptionFlag(cfg.checkpoint.preemption_signals)
    device = trainer.env.device
    # shardtrain alone: warm-up (compilation, the diagnostics' first steps), then steady state.
    start = time.perf_counter()
    for _ in range(args.warmup):
        trainer.iteration()
    synchronize()
    warmup_s = time.perf_counter() - start
    reset_peak(device)
    for _ in range(3):
        trainer.iteration()
    synchronize()
    measured_peak = max_allocated_mib(device)
    logged_peak = peak_memory_mib(device)
    first_loss = trainer.result.losses[0]

    reference = handwritten(cfg, trainer, args.compile, args.ac)
    for _ in range(args.warmup):
        reference()
    times = time_rounds({"shardtrain": trainer.iteration, "handwritten": reference}, args.rounds,
                        args.steps)
    tokens = trainer.layout.global_batch * cfg.trainer.seq_len
    flops_per_token = trainer.task.flops_per_token
    peak_flops = device_peak_flops(device)
    result = {"variant": {"compile": args.compile, "ac": args.ac}, "device": device_name(device),
              "torch": torch.__version__, "params": sum(p.numel() for p in trainer.model.parameters()),
              "tokens_per_step": tokens, "flops_per_token": flops_per_token, "peak_flops": peak_flops,
              "build_s": build_s, "warmup_s": warmup_s, "first_loss": first_loss,
              "handwritten_layers": HANDWRITTEN_LAYERS,
              "peak_mib": {"measured_steady_state": measured_peak, "logged": logged_peak},
              "step_s": {}, "spread_s": {}, "tokens_per_s": {}, "mfu": {}}
    for name, values in times.items():
        median = statistics.median(values)
        result["step_s"][name] = median
        result["spread_s"][name] = [min(values), max(values)]
        result["tokens_per_s"][name] = tokens / median
        result["mfu"][name] = tokens / median * flops_per_token / peak_flops if peak_flops else None
    result["ratio"] = result["step_s"]["shardtrain"] / result["step_s"]["handwritten"]
    if args.profile_steps:
        result["profile"] = {"shardtrain": profiled(trainer.iteration, args.profile_steps, device),
                             "handwritten": profiled(reference, args.profile_steps, device)}
    return result


def float8_against_bf16(args: argparse.Namespace) -> dict:
    """Two trainers in one process, bf16-mixed and float8, stepped in alternating chunks of
    ``--steps`` steps (clock and thermal drift hit both alike) for ``--train-steps`` steps each."""
    # Imported here, not above: it imports torchao, which speed and checks must run without.
    import shardtrain.distributed.float8  # noqa: F401 - registers strategy.float8's conversion

    trainers = {}
    for name in ("bf16", "float8"):
        overrides = [*QUIET, f"run.dir={tempfile.mkdtemp()}", f"model={args.model}",
                     f"trainer.seq_len={args.seq_len}", f"trainer.micro_batch_size={args.micro_batch}",
                     "strategy.mixed_precision=bf16-mixed",
                     "strategy.compile=true", f"strategy.float8={name == 'float8'}",
                     f"strategy.activation_checkpointing={'all' if args.ac else 'none'}"]
        trainers[name] = Trainer.create(load_config(overrides))
        trainers[name].preemption = PreemptionFlag(trainers[name].cfg.checkpoint.preemption_signals)
    device = trainers["bf16"].env.device
    seconds: dict[str, list[float]] = {name: [] for name in trainers}
    peaks: dict[str, float] = {}
    # Both trainers are resident: a step's own memory is its peak above what was allocated before
    # its chunk (the allocator's peak alone held the other run's weights and optimizer state).
    step_peaks: dict[str, float] = {}
    done = 0

    def measured() -> dict:
        first = trainers["bf16"]
        tokens = first.layout.global_batch * first.cfg.trainer.seq_len
        peak_flops = device_peak_flops(device)
        rates = {name: tokens / statistics.median(values) for name, values in seconds.items()}
        return {"device": device_name(device), "torch": torch.__version__, "model": args.model,
                "tokens_per_step": tokens, "steps": done, "ac": args.ac,
                "float8_linears": len(trainers["float8"].built.report.float8_linears),
                "tokens_per_s": rates, "peak_mib": peaks, "step_peak_mib": step_peaks,
                "mfu_bf16_peak": {name: rate * first.task.flops_per_token / peak_flops
                                  for name, rate in rates.items()} if peak_flops else None,
                "losses": {name: list(trainer.result.losses) for name, trainer in trainers.items()}}

    while done < args.train_steps:
        chunk = min(args.steps, args.train_steps - done)
        for name, trainer in trainers.items():
            synchronize()
            resident = allocated_mib(device)
            reset_peak(device)
            start = time.perf_counter()
            for _ in range(chunk):
                trainer.iteration()
            synchronize()
            if done >= args.warmup:  # compilation and the diagnostics' first steps are not timed
                seconds[name].append((time.perf_counter() - start) / chunk)
                step_peaks[name] = max(step_peaks.get(name, 0.0), max_allocated_mib(device) - resident)
            peaks[name] = max(peaks.get(name, 0.0), max_allocated_mib(device))
        done += chunk
        if all(seconds.values()):  # what a call cut off by its time limit brings back
            keep_partial(args, measured())
    return measured()


def metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


# What torchrun tells its workers. A command this worker starts is a run of its own; with them it
# ran as a worker of this job, on its store and restart count (it worked at one process: checked on
# CPU, 2026-12-02), which is not what the checks measure (found by review).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")


def cli(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    own = {key: value for key, value in os.environ.items()
           if key not in TORCHRUN_VARIABLES and not key.startswith("TORCHELASTIC_")}
    proc = subprocess.run([sys.executable, "-m", "shardtrain", *args], capture_output=True, text=True,
                          env={**own, **(env or {})}, timeout=600)
    if check and proc.returncode != 0:
        raise RuntimeError(f"shardtrain {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc


def offload_check(workdir: Path) -> dict:
    """CPU offload on a GPU: shards in pinned host memory, and the same losses as on the device."""
    base = ["model=llama_default", "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=0",
            "trainer.sample_tokens=0", "trainer.progress_bar=false", "checkpoint.enabled=false",
            "run.trackers=[]", "trainer.micro_batch_size=8"]
    offloaded = Trainer.create(load_config([*base, "strategy.cpu_offload=true",
                                            f"run.dir={workdir / 'offload'}"]))
    locals_ = [p.to_local() for p in offloaded.model.parameters()]
    on_host = all(t.device.type == "cpu" for t in locals_)
    pinned = all(t.is_pinned() for t in locals_)
    offload_losses = offloaded.fit().losses
    del offloaded
    on_device = Trainer.create(load_config([*base, f"run.dir={workdir / 'device'}"]))
    device_losses = on_device.fit().losses
    diff = max(abs(a - b) / abs(b) for a, b in zip(offload_losses, device_losses))
    return {"shards_on_host": on_host, "shards_pinned": pinned, "offload_losses": offload_losses,
            "device_losses": device_losses, "max_rel_loss_diff": diff,
            "ok": on_host and pinned and diff < 1e-4}


def resume_check(workdir: Path) -> dict:
    """Async checkpoints every 4 steps; a run killed after step 10 resumes from step 8 and must
    repeat the uninterrupted run's losses for steps 9-12."""
    # One process, as this worker is (trainer.devices=auto takes every GPU of the host).
    base = ["model=llama_default", "trainer.devices=1", "trainer.max_steps=12", "trainer.log_every=1",
            "trainer.eval_every=0", "trainer.sample_tokens=0", "trainer.progress_bar=false",
            "checkpoint.interval=4", "checkpoint.async_save=true", "run.trackers=[]"]
    straight, broken = workdir / "straight", workdir / "broken"
    cli("train", *base, f"run.dir={straight}")
    killed = cli("train", *base, f"run.dir={broken}", env={"SHARDTRAIN_FAULT": "step:0:10:kill"},
                 check=False)
    cli("train", *base, f"run.dir={broken}")
    want = {r["step"]: r["loss"] for r in metrics(straight)}
    got = {r["step"]: r["loss"] for r in metrics(broken)}  # the resumed run's records come last
    steps = list(range(9, 13))
    diff = max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)
    return {"killed_exit": killed.returncode, "losses_uninterrupted": [want[s] for s in steps],
            "losses_resumed": [got[s] for s in steps], "max_rel_loss_diff": diff,
            "ok": killed.returncode != 0 and diff < 1e-5,
            "checkpoint": str(straight / "checkpoints" / "step-12")}


def generation_check(checkpoint: str) -> dict:
    """Greedy text from the same checkpoint, gathered once and unit by unit, on the GPU."""
    texts, seconds = {}, {}
    for mode in ("gathered", "sharded"):
        start = time.perf_counter()
        proc = cli("generate", checkpoint, "--prompt", "def ", "--max-new-tokens", "64", "--mode", mode)
        seconds[mode] = time.perf_counter() - start
        texts[mode] = proc.stdout
    return {"texts": texts, "seconds": seconds, "ok": texts["gathered"] == texts["sharded"] and
            len(texts["gathered"]) > 4}


def profile_check(workdir: Path) -> dict:
    """diagnostics.profile_at with the memory snapshot on the GPU: the trace holds the device's
    kernels, the snapshot is written, and rank 0 logs the operator table (CUDA-only code paths)."""
    run_dir = workdir / "profile"
    proc = cli("train", "model=llama_default", "trainer.devices=1", "trainer.max_steps=5",
               "trainer.eval_every=0", "trainer.sample_tokens=0", "trainer.progress_bar=false",
               "checkpoint.enabled=false", "run.trackers=[]", "diagnostics.profile_at=3",
               "diagnostics.profile_steps=2", "diagnostics.memory_snapshot=true", f"run.dir={run_dir}")
    folder = run_dir / "profiles" / "steps-3-4"
    trace = json.loads((folder / "rank0.json").read_text())
    kernels = sum(1 for event in trace["traceEvents"] if event.get("cat") == "kernel")
    snapshot = folder / "rank0-memory.pickle"
    snapshot_bytes = snapshot.stat().st_size if snapshot.is_file() else 0
    table = "costliest operators" in proc.stderr
    return {"kernels": kernels, "snapshot_bytes": snapshot_bytes, "table": table,
            "ok": kernels > 0 and snapshot_bytes > 0 and table}


def checks(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp())
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    result = {"device": device_name(device), "torch": torch.__version__}
    for name, fn in (("offload", lambda: offload_check(workdir)), ("resume", lambda: resume_check(workdir)),
                     ("profile", lambda: profile_check(workdir))):
        try:
            result[name] = fn()
        except Exception as exc:  # report every check, even after one fails
            result[name] = {"ok": False, "error": repr(exc)[-3000:]}
        keep_partial(args, {"runs": [], "checks": result})  # run.py --only gpu --from-json reads this
    checkpoint = result["resume"].get("checkpoint")
    try:
        result["generation"] = generation_check(checkpoint) if checkpoint else {"ok": False,
                                                                                 "error": "no checkpoint"}
    except Exception as exc:
        result["generation"] = {"ok": False, "error": repr(exc)[-3000:]}
    keep_partial(args, {"runs": [], "checks": result})
    return result


def keep_partial(args: argparse.Namespace, result: dict) -> None:
    """``result`` (dated) in ``--partial``'s file, replaced whole: a call the device's time limit cuts
    off brings back what it measured (the worker's one JSON line came at its very end)."""
    if args.partial is None:
        return
    staged = args.partial.with_name(f".{args.partial.name}.part")
    staged.write_text(json.dumps({**result, "date": datetime.date.today().isoformat()}, indent=1))
    staged.replace(args.partial)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["speed", "checks", "float8"])
    parser.add_argument("--model", default="llama_1b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--ac", action="store_true")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="speed: then this many steps of each loop under torch.profiler")
    parser.add_argument("--train-steps", type=int, default=300, help="float8: steps of each run")
    parser.add_argument("--partial", type=Path, default=None,
                        help="float8, checks: the result so far written here after each chunk or check")
    args = parser.parse_args()
    result = {"speed": speed, "checks": checks, "float8": float8_against_bf16}[args.mode](args)
    if dist.is_initialized():
        dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
