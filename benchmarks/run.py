"""Benchmarks, one command: ``.venv/bin/python benchmarks/run.py`` (``--only training|checkpoint``).

training: benchmarks/step_time.py under torchrun at each process count (``--processes 1 2``).
checkpoint: benchmarks/checkpoint_worker.py under torchrun (2 processes) for the default model and
the 200M-parameter preset, then ``shardtrain consolidate`` peak memory, and the disk's write speed.
generation: benchmarks/generation.py, shardtrain's generate vs transformers' on one exported model.
generation-modes: ``shardtrain generate --mode gathered`` vs ``--mode sharded`` at 2 processes.
init: benchmarks/init_worker.py at 1, 2 and 4 processes, per-shard (chunked) initialisation of a
~300M-parameter model against full tensors on every rank: seconds and peak resident growth per rank.
scaling: ``shardtrain plan --simulate`` for Llama-3 8B, 70B and 405B shapes at the world sizes they
are trained at, every strategy with and without activation checkpointing: the table in
docs/scaling.md, and how long one simulation of 405B at 1,024 ranks takes (probed and full depth).
e2e (only with ``--only e2e``, about 10 minutes; needs ``pip install -e '.[bench]'`` for Lightning):
``shardtrain train`` as users run it, against benchmarks/e2e_programs.py's hand-written FSDP2 loop
and Lightning's ModelParallelStrategy, alternating in rounds, whole iterations by wall clock.
profile (only with ``--only profile``): benchmarks/profile_step.py, both loops under torch.profiler.
qlora (only with ``--only qlora``, needs one CUDA GPU): benchmarks/qlora_bench.py, the 1.1B Llama
under finetune=lora and finetune=qlora: bytes of the base, peak memory, tokens/s.
gpu (only with ``--only gpu``, needs one CUDA GPU, about 6 minutes on an H100):
benchmarks/gpu_worker.py, a 1.1B Llama at sequence 2,048, bf16-mixed, shardtrain vs a hand-written
FSDP2 loop with and without compile and activation checkpointing (each variant then profiles a few
steps of each loop, device and host time per operator), then functional checks (CPU
offload, async checkpoint resume, generation); ``--json-out`` keeps the raw results and
``--from-json`` renders them on a machine without a GPU.
data (about 6 minutes): benchmarks/data_bench.py; ``shardtrain prepare`` against ``datasets``' ``map``
with the same fast tokenizer on the same JSON Lines file at 1 and 2 processes, and the default run's
data wait; one long document encoded whole and in pieces.
hf (about 8 minutes): benchmarks/hf_bench.py; a 0.5B Hugging Face model (Qwen2.5-0.5B's shape, random
bf16 weights saved here) built and loaded by ``model=hf`` at 1, 2 and 4 processes: seconds and peak
resident growth per rank; then training tokens/s of an HF Llama against the built-in Llama of the
same shape, in the same processes, alternating.
checksum: benchmarks/checksum_worker.py at 4, 2 and 1 processes (llama_200m): each rank's checksum
work at a commit and at a resume's verification of the same checkpoint, bytes and seconds.
task: benchmarks/task_step_time.py under torchrun at each process count (``--processes 1 2``), a
task (examples/tasks/vit.py's vision transformer) against a hand-written FSDP2 loop for the same
model and loss.
lora (about 2 minutes): ``shardtrain train`` at 2 processes with full fine-tuning and with
``finetune=lora`` of the same model: per-rank state and peak resident memory against the planner's.
cli (about 1 minute): how long the ``shardtrain`` command takes to answer ``--help``, a config typo and
bad arguments (each a one-line error), median of several runs, against ``python -c "import torch"``.
report (only with ``--only report``, about 3 minutes; needs Chromium, /usr/bin/chromium): three runs
(one restarted by torchrun after a killed rank, one with another learning rate, one of 1,000 steps),
``shardtrain report`` timed on them, the page screenshotted by headless Chromium, the screenshot
checked not blank and kept as docs/images/report.png.
soak (only with ``--only soak``, about 5 minutes): benchmarks/soak_worker.py, 2,000 steps with an
async checkpoint every 10 steps; resident memory, threads, open files and disk use over the run.
loss (about 10 minutes): benchmarks/loss_bench.py; the chunked linear + cross-entropy against the
plain full-logits loss and against per-chunk recomputation: a step's peak memory at 32k and 128k
vocabularies (a fresh process each), and tokens/s alternating in one process for the default model
and a vocabulary-heavy one.
ablation (only with ``--only ablation``, about 35 minutes at 3 rounds): benchmarks/ablation.py;
shardtrain with its defaults and with each of issue 26's features turned the other way (the chunked
loss, fused AdamW, selective activation checkpointing, the lean layers), against the hand-written FSDP2 loop and
Lightning, each a fresh torchrun program, alternating in rounds: tokens/s and peak resident memory
at 1 and 2 processes for the default model and a vocabulary-heavy one.
paired (only with ``--only paired``, about 5 minutes): benchmarks/ablation.py's paired program,
shardtrain's defaults and the hand-written loop built side by side in one program per case (model,
processes), alternating: tokens/s.
tp (only with ``--only tp``, about 8 minutes at 2 rounds): benchmarks/ablation.py's shardtrain program
at 2 processes as FSDP 2 and as FSDP 1 x TP 2 (with and without sequence parallelism), alternating
in rounds: tokens/s and peak resident memory, the default model and the vocabulary-heavy one.
Each rewrites its own section of docs/benchmarks.md (scaling: also docs/scaling.md) with the
command, the machine and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image  # matplotlib's own dependency

from shardtrain.config.compose import compose_config
from shardtrain.config.loader import load_config
from shardtrain.diagnostics.planner import estimate, planned_model
from shardtrain.report.figures import RUN_COLOURS
from shardtrain.tasks.losses import DEFAULT_CHUNK_TOKENS
from shardtrain.train.simulate import simulate, simulation_rows, simulation_table

ROOT = Path(__file__).parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- training:begin -->", "<!-- training:end -->"
CKPT_BEGIN, CKPT_END = "<!-- checkpoint:begin -->", "<!-- checkpoint:end -->"
GEN_BEGIN, GEN_END = "<!-- generation:begin -->", "<!-- generation:end -->"
SOAK_BEGIN, SOAK_END = "<!-- soak:begin -->", "<!-- soak:end -->"
INIT_BEGIN, INIT_END = "<!-- init:begin -->", "<!-- init:end -->"
MODES_BEGIN, MODES_END = "<!-- generation-modes:begin -->", "<!-- generation-modes:end -->"
SCALING_DOC = ROOT / "docs" / "scaling.md"
SCALING_BEGIN, SCALING_END = "<!-- scaling:begin -->", "<!-- scaling:end -->"
SIM_BEGIN, SIM_END = "<!-- simulation:begin -->", "<!-- simulation:end -->"
GPU_BEGIN, GPU_END = "<!-- gpu:begin -->", "<!-- gpu:end -->"
E2E_BEGIN, E2E_END = "<!-- e2e:begin -->", "<!-- e2e:end -->"
PROFILE_BEGIN, PROFILE_END = "<!-- profile:begin -->", "<!-- profile:end -->"
HF_BEGIN, HF_END = "<!-- hf:begin -->", "<!-- hf:end -->"
DATA_BEGIN, DATA_END = "<!-- data:begin -->", "<!-- data:end -->"
TASK_BEGIN, TASK_END = "<!-- task:begin -->", "<!-- task:end -->"
SUM_BEGIN, SUM_END = "<!-- checksum:begin -->", "<!-- checksum:end -->"
CLI_BEGIN, CLI_END = "<!-- cli:begin -->", "<!-- cli:end -->"
LOSS_BEGIN, LOSS_END = "<!-- loss:begin -->", "<!-- loss:end -->"
ABLATION_BEGIN, ABLATION_END = "<!-- ablation:begin -->", "<!-- ablation:end -->"
PAIRED_BEGIN, PAIRED_END = "<!-- paired:begin -->", "<!-- paired:end -->"
TP_BEGIN, TP_END = "<!-- tp:begin -->", "<!-- tp:end -->"
# (label, processes, overrides): FSDP over both ranks against tensor parallelism over them.
TP_PROGRAMS = [("FSDP 2", 2, []), ("FSDP 1 x TP 2, sequence parallel", 2, ["strategy.tensor_parallel=2"]),
               ("FSDP 1 x TP 2, no sequence parallelism", 2,
                ["strategy.tensor_parallel=2", "strategy.sequence_parallel=false"])]
# (row label, program, shardtrain overrides per model: a feature turned the other way from its default).
ABLATION_PROGRAMS = [
    ("hand-written FSDP2 loop", "handwritten", {}),
    ("Lightning (ModelParallelStrategy)", "lightning", {}),
    ("shardtrain, defaults", "shardtrain", {}),
    ("shardtrain, chunked loss turned the other way", "shardtrain",
     {"default": [f"trainer.loss_chunk_tokens={DEFAULT_CHUNK_TOKENS}"], "vocab": ["trainer.loss_chunk_tokens=0"]}),
    ("shardtrain, foreach AdamW (not fused)", "shardtrain",
     {m: ["trainer.optimizer_kernel=foreach"] for m in ("default", "vocab")}),
    ("shardtrain, selective activation checkpointing", "shardtrain",
     {m: ["strategy.activation_checkpointing=selective"] for m in ("default", "vocab")}),
    ("shardtrain, plain autograd layers (not lean)", "shardtrain",
     {m: ["model.lean_layers=false"] for m in ("default", "vocab")}),
    ("shardtrain, embedding table gathered (rows not exchanged)", "shardtrain",
     {m: ["strategy.embedding_lookup=gather"] for m in ("default", "vocab")}),
]
# Iterations per program: not timed, then timed. The warm-up covers shardtrain's diagnostics steps
# (diagnostics.steps=3 measure each phase's memory; runs to 2026-11-27 warmed up 1 and timed two
# of them, against shardtrain).
ABLATION_WARMUP, ABLATION_STEPS = 3, 3
# The paired program (shardtrain's defaults and the hand-written loop alternating in one program):
# rounds, and timed iterations of each per round.
PAIRED_ROUNDS, PAIRED_STEPS = 4, 2
ABLATION_MODELS = {"default": "default model (dim 256, 4 layers, vocabulary 256, sequence 256, 16 sequences a step)",
                   "vocab": "vocabulary-heavy (dim 512, 8 layers, vocabulary 32,000, sequence 512, 4 sequences a step)"}
# (name, vocab, dim, layers, seq, micro-batch): the default model's shape, and a vocabulary-heavy one.
LOSS_SPEED_MODELS = [("default model", 256, 256, 4, 128, 16), ("vocabulary-heavy", 32000, 512, 8, 512, 4)]
LOSS_MEMORY_VOCABS = [32000, 128000]
LOSS_KINDS = ["plain", "chunked", "recompute"]
AC_BEGIN, AC_END = "<!-- ac:begin -->", "<!-- ac:end -->"
LORA_BEGIN, LORA_END = "<!-- lora-memory:begin -->", "<!-- lora-memory:end -->"
AC_SHAPE = (384, 6, 512, 4)  # dim, layers, sequence, sequences: activations well above the weights
# (what a user types after `shardtrain`, the exit status it must give). The paths do not exist.
CLI_CASES = [
    (["--help"], 0),
    (["train", "trainer.max_stepz=5"], 2),
    (["train", "strategy=ful_shard"], 2),
    (["train", "strategy.sharding_strategy=ZERO3"], 2),
    (["plan", "--device-memory", "80XB"], 2),
    (["generate", "no/such/checkpoint", "--prompt", "hi"], 2),
    (["consolidate", "no/such/checkpoint", "out.safetensors"], 2),
    (["inspect", "no/such/checkpoint"], 2),
]
REPORT_BEGIN, REPORT_END = "<!-- report:begin -->", "<!-- report:end -->"
REPORT_SCREENSHOT = ROOT / "docs" / "images" / "report.png"
CHROMIUM = "/usr/bin/chromium"
HF_SPEED_CASES = [(1, "fp32"), (2, "fp32"), (1, "bf16-mixed")]
E2E_CASES = [(1, "fp32"), (1, "bf16-mixed"), (2, "fp32"), (2, "bf16-mixed")]
E2E_PROGRAMS = ["handwritten", "lightning", "shardtrain"]
# Iterations 11-30 of 40 are timed: the first 10 hold start-up (and shardtrain's diagnostics step);
# the last 10 hold shardtrain's final evaluation, which its record at step 40 includes.
E2E_STEPS, E2E_FIRST, E2E_LAST = 40, 10, 30
SCALING_MODELS = [("llama3_8b", "Llama-3 8B", [8, 64]), ("llama3_70b", "Llama-3 70B", [64, 512]),
                  ("llama3_405b", "Llama-3 405B", [1024])]
SCALING_OVERRIDES = ["trainer.micro_batch_size=1", "trainer.seq_len=8192",
                     "strategy.mixed_precision=bf16-mixed"]
# FSDP x TP 8 rows beside the FSDP-only ones, at the sizes torchtitan's recipes name: 70B as FSDP 32 x
# TP 8 on 256 GPUs, 405B as FSDP 128 x TP 8 on 1,024.
SCALING_TENSOR_PARALLEL = {"llama3_70b": 256, "llama3_405b": 1024}
HEADER = (
    "| processes | tokens/step | shardtrain tokens/s | hand-written tokens/s | shardtrain step ms "
    "| hand-written step ms | ratio (shardtrain / hand-written) |\n"
    "| --- | --- | --- | --- | --- | --- | --- |"
)
INTRO = "# Benchmarks\n\nEvery number here comes from the command written beside it.\n\n"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run_torchrun(processes: int, script: str, args: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={processes}", str(ROOT / "benchmarks" / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{script} at {processes} processes failed:\n{proc.stderr[-4000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


PEAK_RSS = (
    "import resource, subprocess, sys; "
    "r = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)"
)


def peak_rss_mib(cmd: list[str]) -> float:
    """Peak resident memory of ``cmd`` (measured in a fresh wrapper process, Linux KiB units)."""
    proc = subprocess.run([sys.executable, "-c", PEAK_RSS, *cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{proc.stderr[-3000:]}")
    return int(proc.stdout.strip().splitlines()[-1]) / 1024


def disk_write_mib_s(directory: Path, total_mib: int = 1024) -> float:
    chunk = os.urandom(16 * 2**20)
    target = directory / "disk-speed.bin"
    start = time.perf_counter()
    with open(target, "wb") as f:
        for _ in range(total_mib // 16):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    target.unlink()
    return total_mib / seconds


def checkpoint_results(workdir: Path) -> dict:
    shardtrain = [sys.executable, "-m", "shardtrain"]
    results = {"disk_mib_s": disk_write_mib_s(workdir), "models": []}
    baseline = peak_rss_mib([sys.executable, "-c",
                             "import torch, safetensors.torch, torch.distributed.checkpoint"])
    results["import_baseline_mib"] = baseline
    for preset, shard in (("llama_default", "4MB"), ("llama_200m", "100MB")):
        run = run_torchrun(2, "checkpoint_worker.py", [str(workdir / preset), f"model={preset}",
                                                       "trainer.micro_batch_size=1", "trainer.seq_len=64"])
        out = workdir / f"{preset}-out"
        run["consolidate_single_peak_mib"] = peak_rss_mib(
            [*shardtrain, "consolidate", run["path"], str(out / "single")])
        run["consolidate_sharded_peak_mib"] = peak_rss_mib(
            [*shardtrain, "consolidate", run["path"], str(out / "sharded"), "--max-shard-size", shard])
        run["shard_size"] = shard
        run["model_mib"] = sum(f.stat().st_size for f in (out / "single").iterdir()) / 2**20
        results["models"].append({"preset": preset, **run})
        print(json.dumps(results["models"][-1]))
    return results


def render_checkpoint(results: dict, command: str) -> str:
    rows = "\n".join(
        f"| {m['preset']} | {m['params'] / 1e6:.1f}M | {m['bytes'] / 2**20:,.0f} MiB | "
        f"{m['sync_s']:.2f} s ({m['bytes'] / 2**20 / m['sync_s']:,.0f} MiB/s) | "
        f"{m['async_blocked_s']:.2f} s | {m['async_again_blocked_s']:.2f} s | {m['async_total_s']:.2f} s | "
        f"{m['load_s']:.2f} s | "
        f"{m['model_mib']:,.0f} MiB | {m['consolidate_single_peak_mib']:,.0f} MiB | "
        f"{m['consolidate_sharded_peak_mib']:,.0f} MiB ({m['shard_size']} shards) |"
        for m in results["models"]
    )
    return f"""{CKPT_BEGIN}
## Checkpoints: save, load, consolidate

- Command: `{command}`
- Date: {datetime.date.today().isoformat()}
- Machine: {os.cpu_count()} CPU cores ({cpu_name()}), no GPU, torch {torch.__version__}; the disk's
  measured write speed (1 GiB, fsynced): **{results['disk_mib_s']:,.0f} MiB/s**
- Each model trains one step at 2 processes (FULL_SHARD, fp32, so the checkpoint holds weights and
  Adam's two moments), then: a synchronous save; an asynchronous save (the time training is blocked,
  then the whole write); one more step and a second asynchronous save, whose staging copy goes into
  the host buffers the first allocated (`checkpoint.reuse_staging`, pinned on a GPU); a load of that checkpoint (verification + DCP read + resharding into the
  model and optimizer). Consolidation runs as `shardtrain consolidate` in its own process; its peak
  resident memory includes the Python + torch import baseline of
  {results['import_baseline_mib']:,.0f} MiB.

| model | parameters | checkpoint size | sync save | async: training blocked, first save | async: blocked, next save | async: whole write | load | model weights (fp32) | consolidate peak RSS, one file | consolidate peak RSS, sharded |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
{rows}

Consolidation streams one file and shards alike: each file's header first, then its tensors read
from the checkpoint about 256 MiB at a time (a larger tensor alone), so the peak is the import
baseline plus one to two read groups (DCP reads a tensor's bytes, then copies them into place),
whatever the model's size or the output's layout (before 2026-11-30, one output file held the whole
model: 1,184 MiB for llama_200m).
{CKPT_END}"""


def checksum_results(workdir: Path, preset: str = "llama_200m") -> list[dict]:
    """Checksum work per rank at 4, 2 and 1 ranks: each run hashes its own save's commit, and all
    verify the one checkpoint the 4-rank run saved (same files, same bytes)."""
    model = [f"model={preset}", "trainer.micro_batch_size=1", "trainer.seq_len=64"]
    results = [run_torchrun(4, "checksum_worker.py", [str(workdir / "ranks4"), "-", *model])]
    for n in (2, 1):
        results.append(run_torchrun(n, "checksum_worker.py",
                                    [str(workdir / f"ranks{n}"), results[0]["path"], *model]))
    for r in results:
        print(json.dumps(r))
    return results


def render_checksum(results: list[dict], command: str) -> str:
    def row(r: dict) -> str:
        ranks = r["ranks"]
        commit = max(x["commit_s"] for x in ranks)
        verify = max(x["verify_s"] for x in ranks)
        return (f"| {r['world_size']} | {r['saved_bytes'] / 1e9:.2f} GB | "
                f"{max(x['commit_bytes'] for x in ranks) / 1e9:.2f} GB | {commit:.2f} s | "
                f"{r['rank0_all_files_s']:.2f} s | {max(x['verify_bytes'] for x in ranks) / 1e9:.2f} GB | "
                f"{verify:.2f} s |")
    rows = "\n".join(row(r) for r in sorted(results, key=lambda r: r["world_size"]))
    verified = results[0]["verified_bytes"] / 1e9
    return f"""{SUM_BEGIN}
## Checkpoint checksums: cost per rank

What `checksums.json` ([checkpoints](checkpoints.md#checksums)) costs each rank, at 1, 2 and 4
ranks: llama_200m after one step (fp32 weights and Adam's two moments), FULL_SHARD. At a commit each
rank hashes the files it wrote (the largest rank's share and time shown; "rank 0 alone" is what the
commit cost before, when rank 0 hashed every file while the others waited). A resume's verification
is of one and the same checkpoint (the 4-rank run's, {verified:.2f} GB) at every world size: each
rank hashes its share of the files (balanced by bytes) and the verdicts meet in one all-gather (the
slowest rank's time shown; before, every rank hashed every file).

- Command: `{command}`
- Date: {datetime.date.today().isoformat()}
- Machine: {os.cpu_count()} CPU cores ({cpu_name()}), no GPU, torch {torch.__version__}; the files
  are in the page cache (right after the save), so this is hashing speed, not disk speed.

| ranks | checkpoint saved | commit: largest rank's bytes | commit: slowest rank | commit: rank 0 alone (before) | verify: largest share | verify: slowest rank |
| --- | --- | --- | --- | --- | --- | --- |
{rows}

The bytes a rank hashes fall as 1/ranks. The seconds fall with them only while there are cores to
hash in parallel: this machine has 2, so 4 ranks hash no faster than 2 here; a GPU node runs one rank
per GPU with several cores each, and a shared filesystem serves the ranks' reads in parallel.
{SUM_END}"""


def generation_results() -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generation.py")],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"generation benchmark failed:\n{proc.stderr[-4000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def render_generation(r: dict, command: str) -> str:
    tps = r["tokens_per_s"]
    return f"""{GEN_BEGIN}
## Generation: shardtrain vs transformers, same exported model

- Command: `{command}`
- Date: {datetime.date.today().isoformat()}
- Machine: {os.cpu_count()} CPU cores ({cpu_name()}), no GPU, torch {torch.__version__},
  transformers {r['transformers_version']}, {r['threads']} threads, one process
- Model: the default config (3.1M parameters, fp32), exported with `shardtrain export-hf` and loaded
  by `AutoModelForCausalLM`; the same prompt ({r['prompt_tokens']} bytes) and {r['new_tokens']} new
  tokens, greedy, KV cache on both sides; median of {r['rounds']} alternating rounds.

| | shardtrain `generate` | transformers `generate` |
| --- | --- | --- |
| tokens/s | {tps['shardtrain']:,.0f} | {tps['transformers']:,.0f} |
| seconds for {r['new_tokens']} tokens | {r['seconds']['shardtrain']:.3f} | {r['seconds']['transformers']:.3f} |
{GEN_END}"""


def write_section(begin: str, end: str, section: str, doc: Path = DOC) -> None:
    if not (section.startswith(begin) and section.rstrip().endswith(end)):
        # without its markers the next run could not find it, and added a second copy
        raise ValueError(f"the section written between {begin} and {end} must start and end with them")
    text = doc.read_text() if doc.exists() else INTRO
    if begin in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: section, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    doc.write_text(text)


def render(results: list[dict], command: str) -> str:
    rows = "\n".join(
        f"| {r['world_size']} | {r['tokens_per_step']} | {r['tokens_per_s']['shardtrain']:,.0f} | "
        f"{r['tokens_per_s']['handwritten']:,.0f} | {r['step_s']['shardtrain'] * 1e3:.1f} | "
        f"{r['step_s']['handwritten'] * 1e3:.1f} | **{r['ratio']:.3f}** |"
        for r in results
    )
    return f"""{BEGIN}
## Training throughput: default model, shardtrain vs a hand-written FSDP2 loop

- Command: `{command}`
- Date: {datetime.date.today().isoformat()}
- Machine: {os.cpu_count()} CPU cores ({cpu_name()}), no GPU, gloo backend, torch {torch.__version__},
  Python {platform.python_version()}
- Model and batch: the default config (Llama, 3.1M parameters, FULL_SHARD, fp32), global batch
  16 x 128 tokens at every process count (micro-batch 16 / processes).
- Method: both loops run in the same processes on the same initial weights and batches, in 6
  alternating rounds of 5 timed steps after 3 warm-up steps each; numbers are medians of the step
  time. shardtrain's step is `Trainer.iteration`, the body of its training loop (data, step, metrics
  bookkeeping, the all-ranks preemption check; no checkpoint is due in these steps); the hand-written
  loop is the FSDP2 tutorial's (`fully_shard` per block and root, mean loss, `clip_grad_norm_`,
  AdamW) on the same model and optimizer as shardtrain's (its lean layers, AdamW built as it builds
  it: fused, norms and biases without decay), so the ratio is the loop's own overhead; the ablation
  below compares against a loop as users write it. Goal: ratio at most 1.03.

{HEADER}
{rows}

Two processes on two cores split the same global batch; each process gets one core, so tokens/s
does not double: the CPU is the bottleneck, not the sharding.
{END}"""


def render_task(results: list[dict], command: str) -> str:
    rows = "\n".join(
        f"| {r['world_size']} | {r['samples_per_step']} | {r['samples_per_s']['shardtrain']:,.1f} | "
        f"{r['samples_per_s']['handwritten']:,.1f} | {r['step_s']['shardtrain'] * 1e3:.1f} | "
        f"{r['step_s']['handwritten'] * 1e3:.1f} | **{r['ratio']:.3f}** |"
        for r in results
    )
    params = results[0]["params"] / 1e6
    return f"""{TASK_BEGIN}
## A task's step: a vision transformer, shardtrain vs a hand-written FSDP2 loop

- Command: `{command}`
- Date: {datetime.date.today().isoformat()}
- Machine: {os.cpu_count()} CPU cores ({cpu_name()}), no GPU, gloo backend, torch {torch.__version__},
  Python {platform.python_version()}
- Task and batch: `examples/tasks/vit.py` (`ImageClassification`: a timm-shaped ViT, 32x32 images,
  patch 4, width 192, depth 6, {params:.1f}M parameters), FULL_SHARD, fp32, global batch 32 images at
  every process count (micro-batch 32 / processes).
- Method: as the training table above (the same processes, initial weights and batches,
  alternating rounds of 5 timed steps after 3 warm-up steps, medians), with 12 rounds instead of 6:
  at two processes on two cores single runs of 6 rounds gave 0.999, 1.026 and 1.041. shardtrain's step is
  `Trainer.iteration` through the task contract (the task's `loss` returning the summed loss and its
  count, the global normalisation, the metrics' all-reduce); the hand-written loop is the FSDP2
  tutorial's with the task's model and a mean cross-entropy. Goal: ratio at most 1.03.

| processes | samples/step | shardtrain samples/s | hand-written samples/s | shardtrain step ms | hand-written step ms | ratio (shardtrain / hand-written) |
| --- | --- | --- | --- | --- | --- | --- |
{rows}
{TASK_END}"""


def render_init(results: list[dict], command: str) -> str:
    rows = []
    for r in results:
        secs = [x["seconds"] for x in r["ranks"]]
        mib = [x["peak_growth_mib"] for x in r["ranks"]]
        rows.append(f"| {r['world_size']} | {r['mode']} | {max(secs):.2f} | {max(mib):,.0f} |")
    return f"""{INIT_BEGIN}
## Initialisation of a {results[0]['params'] / 1e6:.0f}M-parameter model, per rank

- Command: `{command}` (FULL_SHARD; vocab 65,536 x dim 1,024, 13 layers; build on meta, shard,
  materialise). `chunked`: each rank draws only the 2^20-element chunks its shard overlaps (the
  default for the built-in model); `full`: every full parameter drawn on every rank, then sliced (the
  path for models whose initialiser is not elementwise, and shardtrain's path before).
- Machine: {os.cpu_count()} CPU cores ({cpu_name()}), no GPU, gloo, torch {torch.__version__}; date
  {datetime.date.today().isoformat()}. With 4 processes on 2 cores each process has half a core, so
  the time per rank does not shrink by 4.

| processes | initialisation | seconds (slowest rank) | peak resident growth, MiB (largest rank) |
| --- | --- | --- | --- |
{chr(10).join(rows)}
{INIT_END}"""


def render_soak(r: dict, command: str) -> str:
    rows = []
    for rank, samples in enumerate(r["ranks"]):
        first, last = samples[0], samples[-1]
        growth = 100 * (last["rss_mib"] - first["rss_mib"]) / first["rss_mib"]
        rows.append(f"| {rank} | {first['rss_mib']:.0f} | {last['rss_mib']:.0f} | {growth:+.1f}% | "
                    f"{first['threads']} / {last['threads']} | {first['open_files']} / {last['open_files']} |")
    disk = [s for s in r["ranks"][0]]
    entries = "; ".join(f"step {s['step']}: {', '.join(s['ckpt_entries'])} ({s['ckpt_mib']:.1f} MiB)"
                        for s in disk)
    return f"""{SOAK_BEGIN}
## Soak: {r['steps']} steps with an async checkpoint every 10 steps

- Command: `{command}` ({r['steps']} steps of `experiment=quick` at 2 processes,
  `checkpoint.interval=10 checkpoint.keep_last=2 checkpoint.async=true`, driven through
  `Trainer.iteration`; each sample taken with no save in flight).
- Machine: {os.cpu_count()} CPU cores ({cpu_name()}), no GPU, gloo, torch {r['torch']}; date
  {datetime.date.today().isoformat()}.
- Goal: resident memory growth from step 200 to the end under 5%, disk use bounded, no leaked
  threads or files.

| rank | RSS MiB at step 200 | RSS MiB at the end | growth | OS threads (200 / end) | open files (200 / end) |
| --- | --- | --- | --- | --- | --- |
{chr(10).join(rows)}

Checkpoint directory (rank 0's view): {entries}.
{SOAK_END}"""


def cli_seconds(*args: str) -> float:
    """Wall time of one ``shardtrain`` command, as a user runs it."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "shardtrain", *args], capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"shardtrain {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def shardtrain_command() -> list[str]:
    """The ``shardtrain`` console script beside this interpreter, as a user runs it (else ``-m``)."""
    script = Path(sys.executable).with_name("shardtrain")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "shardtrain"]


def answer_seconds(cmd: list[str], status: int, runs: int) -> tuple[float, str]:
    """The median wall time of ``runs`` runs of ``cmd`` (after one that warms the page cache), and
    the last line it wrote to stderr (its error)."""
    times = []
    for attempt in range(runs + 1):
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir())
        if attempt:
            times.append(time.perf_counter() - start)
        if proc.returncode != status:
            raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}, not {status}:\n{proc.stderr[-3000:]}")
    lines = proc.stderr.strip().splitlines()
    return statistics.median(times), lines[-1] if lines else ""


def cli_section(command: str, runs: int = 7) -> str:
    """How long the command line takes to answer what needs no training: --help, a config typo, a bad
    argument or path. Each is one line on stderr, and must come without importing torch."""
    shardtrain = shardtrain_command()
    load = os.getloadavg()[0]  # other jobs on the machine slow every answer alike
    rows = []
    for args, status in CLI_CASES:
        seconds, answer = answer_seconds([*shardtrain, *args], status, runs)
        shown = "(the usage text)" if status == 0 else f"`{answer}`"
        rows.append(f"| `shardtrain {' '.join(args)}` | {status} | **{seconds:.2f} s** | {shown} |")
    torch_s, _ = answer_seconds([sys.executable, "-c", "import torch"], 0, runs)
    python_s, _ = answer_seconds([sys.executable, "-c", "pass"], 0, runs)
    rows.append(f"| `python -c \"import torch\"` (what every answer but `--help` paid before) | 0 | {torch_s:.2f} s | |")
    rows.append(f"| `python -c pass` (the interpreter alone) | 0 | {python_s:.2f} s | |")
    table = "\n".join(rows)
    return f"""{CLI_BEGIN}
## The command line's answers: help, typos, bad arguments

How long `{' '.join(Path(c).name for c in shardtrain)}` takes to answer what needs no training:
each the median of {runs} runs (after one that warms the page cache), in a directory where the
paths given do not exist.

- Command: `{command}`
- Date: {datetime.date.today().isoformat()}; machine: {machine()}; load average {load:.1f} at the start

| command | exit status | median wall time | what it prints (last line of stderr) |
| --- | --- | --- | --- |
{table}

Before (commit ebb92d9), every answer but `--help` waited for torch: the config loader imported it
(device counts, dtypes) and the commands imported their whole stacks (transformers, DCP) before
looking at their arguments. `time shardtrain train trainer.max_stepz=5` took 5.4 s; this section's
code run on that commit on 2026-11-25 (load average 5.3 at the start), measured 4.80 s for the key
typo, 5.48 s for the preset typo, 3.60 s for `plan --device-memory 80XB`, 9.53 s for `generate` and
8.41 s for `consolidate` of a missing checkpoint, 5.80 s for `inspect` (and 5.45 s for `import torch`
alone). Now a misspelt key or preset is checked against the schema and the preset files before even
hydra is imported; values, types, bounds, paths and the strategy's names after hydra has composed
the config (most of the `ZERO3` row's time), still without torch; each command checks its arguments and paths before it imports torch (tests assert that
none of these answers imports torch, transformers or safetensors). What needs torch (the devices, the
task's code, the sharding plan at the launch's world size) is checked next, before any process starts.
{CLI_END}"""


def generation_modes_section(command: str, short: int = 16, long: int = 1000, repeats: int = 3) -> str:
    """`generate --mode gathered` against `--mode sharded` (unit by unit) at 2 processes, FULL_SHARD,
    on a checkpoint of the default model: seconds per extra token, from two output lengths (the
    fastest of ``repeats`` runs of each, since start-up varies by more than a short output takes)."""
    with tempfile.TemporaryDirectory(dir=ROOT) as workdir:
        run_dir = Path(workdir) / "run"
        cli_seconds("train", "trainer.max_steps=4", "trainer.sample_every=0", "trainer.devices=2",
                    f"run.dir={run_dir}")
        ckpt = run_dir / "checkpoints" / "step-4"
        per_token = {}
        for mode in ("gathered", "sharded"):
            walls = [min(cli_seconds("generate", str(ckpt), "--prompt", "def ", "--max-new-tokens",
                                     str(n), "--devices", "2", "--mode", mode) for _ in range(repeats))
                     for n in (short, long)]
            per_token[mode] = (walls[1] - walls[0]) / (long - short)
    ratio = per_token["sharded"] / per_token["gathered"]
    return f"""{MODES_BEGIN}
## Generation: gathered copy vs unit by unit

- Command: `{command}`
- Date: {datetime.date.today().isoformat()}; machine: {machine()}, gloo
- What runs: `shardtrain train trainer.max_steps=4 trainer.devices=2` (default model, 3.1M
  parameters, 4 blocks, FULL_SHARD), then `shardtrain generate CKPT --prompt "def " --devices 2
  --mode gathered|sharded --max-new-tokens N` at N = {short} and {long}, the fastest of {repeats} runs
  of each; per token = the difference of the two wall times over the {long - short} extra tokens
  (start-up cancels out).

| mode | ms per new token |
| --- | --- |
| gathered (one copy, no collectives per token) | {per_token["gathered"] * 1e3:.1f} |
| sharded (one all-gather per unit per token: 4 blocks and the embeddings) | {per_token["sharded"] * 1e3:.1f} |

Unit by unit costs {ratio:.1f}x per token here; it is what `--mode auto` picks only when the gathered
copy would not fit the free memory.
{MODES_END}"""


def machine() -> str:
    return (f"{os.cpu_count()} CPU cores ({cpu_name()}), no GPU, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def scaling_sections(command: str) -> tuple[str, str]:
    """docs/scaling.md's table and docs/benchmarks.md's simulation timing."""
    tables = []
    for preset, title, worlds in SCALING_MODELS:
        cfg = load_config([f"model={preset}", *SCALING_OVERRIDES])
        rows = simulation_rows(cfg, worlds, ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"],
                               ["none", "all"], 8)
        commands = ""
        if preset in SCALING_TENSOR_PARALLEL:
            world = SCALING_TENSOR_PARALLEL[preset]
            overrides = [f"model={preset}", *SCALING_OVERRIDES, "strategy.tensor_parallel=8"]
            rows += simulation_rows(load_config([*overrides, "trainer.devices=8"]), [world], ["FULL_SHARD"],
                                    ["none", "all"], 8)
            args = ["plan", "--simulate", *overrides, "--world-sizes", str(world), "--processes-per-node",
                    "8", "--ac", "both", "--device-memory", "80GB"]
            commands = (f"\n\nThe TP rows: `shardtrain {' '.join(args)}` ({cli_seconds(*args):.0f} s "
                        "as a user runs it, imports included; its seconds column: each simulation)")
        tables.append(f"### {title} (`model={preset}`)\n\n"
                      + simulation_table(rows, 80 * 10**9, markdown=True) + commands)
    scaling = f"""{SCALING_BEGIN}
- Command: `{command}` (rewrites this section)
- Date: {datetime.date.today().isoformat()}; machine: {machine()}
- Every case: micro-batch 1 x 8,192 tokens, `bf16-mixed`, 8 processes per node (hybrid strategies
  shard over the node's 8 and replicate across nodes), AdamW; fits = the simulated peak is at most
  80 GB (74.5 GiB) per device. `FULL_SHARD x TP 8`: tensor parallelism over each node's 8 ranks
  with sequence parallelism and the loss on the vocabulary-split logits, FSDP over the nodes.
  In brackets the planner's figures for the run simulated, which gathers the embedding table (fake
  tensors hold no token ids to exchange rows by).

{(chr(10) * 2).join(tables)}
{SCALING_END}"""
    cfg = load_config(["model=llama3_405b", "strategy.activation_checkpointing=all", *SCALING_OVERRIDES])
    probed = simulate(cfg, 1024, 8)
    full = simulate(cfg, 1024, 8, probe=False)
    timing = f"""{SIM_BEGIN}
## Simulation: Llama-3 405B at 1,024 ranks in one process

- Command: `{command}`
- Date: {datetime.date.today().isoformat()}; machine: {machine()}
- Case: FULL_SHARD, activation checkpointing, micro-batch 1 x 8,192 tokens, bf16-mixed.

| mode | seconds | simulated peak GiB per rank |
| --- | --- | --- |
| probes (6 and 7 blocks, extended to 126) | {probed.seconds:.1f} | {probed.peak / 2**30:.2f} |
| full depth (all 126 blocks, `--full-depth`) | {full.seconds:.1f} | {full.peak / 2**30:.2f} |

The seconds are those of `simulate` itself (building, sharding, the step); `shardtrain plan
--simulate` adds about 3 s of imports. The two peaks are equal: the probes' phases extend exactly.
{SIM_END}"""
    return scaling, timing


GPU_VARIANT_NAMES = {"plain": (False, False), "ac": (False, True), "compile": (True, False),
                     "compile+ac": (True, True)}


# Steps of each loop profiled after the timed rounds (seconds of a lent session's minutes): where the
# ratio comes from, op by op, without a second session to look.
GPU_PROFILE_STEPS = 3


def gpu_profile_lines(runs: list[dict], top: int = 8) -> list[str]:
    """Per variant that carries a profile: each loop's wall, device-busy and event counts per step, and
    the operators whose self time per step (the device's; the host's without one) differs most
    between the two loops."""
    lines = []
    for r in runs:
        prof = r.get("profile")
        if not prof:
            continue
        ours, theirs = prof["shardtrain"], prof["handwritten"]
        variant = f"compile {'yes' if r['variant']['compile'] else 'no'}, AC {'yes' if r['variant']['ac'] else 'no'}"
        lines += ["", f"Profile, {variant} ({ours['steps']} steps of each loop under `torch.profiler`, per step):", "",
                  "| | shardtrain | hand-written |", "| --- | --- | --- |",
                  f"| wall ms (profiled) | {ours['wall_ms']:.1f} | {theirs['wall_ms']:.1f} |",
                  f"| device busy ms (kernels) | {ours['device_busy_ms']:.1f} | {theirs['device_busy_ms']:.1f} |",
                  f"| profiled events | {ours['events_per_step']:,.0f} | {theirs['events_per_step']:,.0f} |",
                  ""]
        # Ranked by the device's time; by the host's where there is no device (the CPU smoke run).
        column = 0 if ours["device_busy_ms"] or theirs["device_busy_ms"] else 1
        lines += [f"| operator (largest differences in self {('device', 'host')[column]} ms per step) | shardtrain "
                  "device | hand-written device | shardtrain host | hand-written host |",
                  "| --- | --- | --- | --- | --- |"]
        zero = [0.0, 0.0, 0.0]
        names = sorted(set(ours["ops"]) | set(theirs["ops"]),
                       key=lambda n: -abs(ours["ops"].get(n, zero)[column] - theirs["ops"].get(n, zero)[column]))
        for name in names[:top]:
            a, b = ours["ops"].get(name, zero), theirs["ops"].get(name, zero)
            lines.append(f"| `{name[:80]}` | {a[0]:.2f} | {b[0]:.2f} | {a[1]:.2f} | {b[1]:.2f} |")
    return lines


def gpu_results(variants: list[str], with_checks: bool, command: str, json_out: Path | None) -> dict:
    """Run benchmarks/gpu_worker.py under torchrun (NCCL, world size 1): one process per
    (compile, AC) variant, then the functional checks. ``json_out`` is rewritten after each: a
    session's call that runs out of time brings back what it measured."""
    results: dict = {"date": datetime.date.today().isoformat(), "command": command, "runs": []}

    def done(part: dict) -> None:
        print(json.dumps(part), flush=True)
        if json_out is not None:
            json_out.write_text(json.dumps(results, indent=1))

    for name in variants:
        compiled, ac = GPU_VARIANT_NAMES[name]
        args = ["speed", "--profile-steps", str(GPU_PROFILE_STEPS)] + (["--compile"] if compiled else []) \
            + (["--ac"] if ac else [])
        results["runs"].append(run_torchrun(1, "gpu_worker.py", args))
        done(results["runs"][-1])
    if with_checks:
        results["checks"] = run_torchrun(1, "gpu_worker.py", ["checks"])
        done(results["checks"])
    return results


def measured_on(result: dict, path: Path | None = None) -> str:
    """The date a GPU result was measured: its own ``date`` (results from 2026-11-30 on), else the
    date in its file's name (gpu-h200-2026-11-27.json); never today's, which --from-json runs on."""
    if "date" in result:
        return result["date"]
    found = re.search(r"\d{4}-\d{2}-\d{2}", path.name) if path is not None else None
    if found is None:
        raise SystemExit(f"{path}: the result has no date, nor its file name; add \"date\": \"YYYY-MM-DD\"")
    return found.group()


FLOAT8_BEGIN, FLOAT8_END = "<!-- float8:begin -->", "<!-- float8:end -->"
QLORA_BEGIN, QLORA_END = "<!-- qlora:begin -->", "<!-- qlora:end -->"


def qlora_section(command: str, results: list[dict]) -> str:
    """docs/benchmarks.md's QLoRA section from benchmarks/qlora_bench.py's lora and qlora results."""
    first = results[0]
    rows = "\n".join(
        f"| `finetune={r['variant']}` | {r['base_linear_mib']:,.0f} MiB | {r['params_mib']:,.0f} MiB | "
        f"{r['grads_mib'] + r['optimizer_mib']:,.0f} MiB | {r['peak_mib']:,.0f} MiB | {r['tokens_per_s']:,.0f} | "
        f"{r['losses'][-1]:.3f} |" for r in results)
    return f"""{QLORA_BEGIN}
## QLoRA against LoRA (GPU)

`{first['model']}` on one {first['device']} (torch {first['torch']}), bf16-mixed (fp32 storage),
{first['micro_batch']} x {first['seq_len']} tokens per step, rank 16 on the attention and MLP
projections; the peak is the allocator's over steady-state steps.

| | base linear weights | all parameters | adapters' grads + Adam | peak | tokens/s | last loss |
| --- | --- | --- | --- | --- | --- | --- |
{rows}

`{command}`
{QLORA_END}"""


def float8_section(command: str, result: dict) -> str:
    """docs/benchmarks.md's float8 section from benchmarks/gpu_worker.py float8's result."""
    rates, losses = result["tokens_per_s"], result["losses"]
    # Both trainers are resident in the worker's one process: a step's peak above what was allocated
    # before it is its own. Results before 2026-11-30 kept the allocator's peak, the other run's
    # weights and optimizer state included.
    peaks, peak_heading = ((result["step_peak_mib"], "step's peak above the resident state, MiB")
                           if "step_peak_mib" in result else
                           (result["peak_mib"], "peak allocated MiB (both runs' state resident)"))
    steps = len(losses["bf16"])
    tail = max(steps // 10, 1)
    mean = {name: statistics.fmean(values[-tail:]) for name, values in losses.items()}
    lines = [FLOAT8_BEGIN, "## Float8 against bf16 (GPU)", "",
             f"`{command}` on {result['device']}, {result['date']}, torch {result['torch']}: "
             f"model={result['model']}, {result['tokens_per_step']:,} tokens a step, both runs compiled "
             f"(`strategy.compile=true`), bf16-mixed, activation checkpointing "
             f"{'all' if result['ac'] else 'none'}, the same initial weights and batches, {steps} steps "
             f"each, alternating in chunks; float8 converted {result['float8_linears']} linear layers.", "",
             f"| run | tokens/s | vs bf16 | MFU (of the bf16 peak) | {peak_heading} | "
             f"mean loss, last {tail} steps |", "| --- | --- | --- | --- | --- | --- |"]
    for name in ("bf16", "float8"):
        mfu = result["mfu_bf16_peak"][name] if result["mfu_bf16_peak"] else None
        lines.append(f"| {name} | {rates[name]:,.0f} | {rates[name] / rates['bf16']:.2f} | "
                     + (f"{mfu:.1%}" if mfu is not None else "n/a")
                     + f" | {peaks[name]:,.0f} | {mean[name]:.4f} |")
    marks = sorted({0, *range(steps // 6, steps, max(steps // 6, 1)), steps - 1})
    lines += ["", "Loss curves (step: bf16 / float8):", "",
              "| " + " | ".join(f"step {m + 1}" for m in marks) + " |", "|" + " --- |" * len(marks),
              "| " + " | ".join(f"{losses['bf16'][m]:.3f} / {losses['float8'][m]:.3f}" for m in marks) + " |"]
    return "\n".join(lines + [FLOAT8_END])


def percent(share: float | None) -> str:
    """An MFU as a percentage; n/a on a device without a known peak (``device_peak_flops``)."""
    return "n/a" if share is None else f"{100 * share:.1f}%"


def gpu_section(results: dict) -> str:
    """The GPU benchmark's section: a ~1.1B Llama at sequence 2,048, bf16-mixed, one GPU,
    shardtrain against the hand-written FSDP2 loop per (compile, AC) variant; shardtrain's peak
    memory against the simulator's and the planner's; the functional checks."""
    runs, checks = results["runs"], results.get("checks")
    cfg = load_config(["model=llama_1b", "trainer.seq_len=2048", "trainer.micro_batch_size=4",
                       "strategy.mixed_precision=bf16-mixed"])
    predicted = {ac: (sim.peak, plan.peak) for (sim, plan), ac in
                 zip(simulation_rows(cfg, [1], ["FULL_SHARD"], ["none", "all"], 1), [False, True])}
    gib = 2**30
    rows = []
    for r in runs:
        tps, mfu, ms = r["tokens_per_s"], r["mfu"], {k: v * 1e3 for k, v in r["step_s"].items()}
        spread = {k: f"{v[0] * 1e3:.0f}-{v[1] * 1e3:.0f}" for k, v in r["spread_s"].items()}
        sim, plan = predicted[r["variant"]["ac"]]
        rows.append(
            f"| {'yes' if r['variant']['compile'] else 'no'} | {'yes' if r['variant']['ac'] else 'no'} "
            f"| {tps['shardtrain']:,.0f} | {tps['handwritten']:,.0f} | {percent(mfu['shardtrain'])} "
            f"| {percent(mfu['handwritten'])} | {ms['shardtrain']:.1f} ({spread['shardtrain']}) "
            f"| {ms['handwritten']:.1f} ({spread['handwritten']}) | **{r['ratio']:.3f}** "
            f"| {r['peak_mib']['measured_steady_state'] / 1024:.1f} / {r['peak_mib']['logged'] / 1024:.1f} "
            f"| {sim / gib:.1f} / {plan / gib:.1f} |")
    first = runs[0]
    dates = sorted(set(results["dates"]))
    # Results before 2026-11-28 do not say: their hand-written loop had shardtrain's lean layers,
    # which arrived on 2026-11-25 with fused AdamW the default; before, neither loop had them.
    before_lean = dates[0] < "2026-11-25"
    layers = {"plain autograd": "with plain autograd's norms and SwiGLU, as the CPU ablation's",
              "lean": "the lean layers included"}[first.get("handwritten_layers", "lean")]
    defaults = ("its defaults of that date: the full-logits\n  loss, foreach AdamW, plain layers" if before_lean
                else "its defaults: the chunked loss\n  (vocabulary 32,000), fused AdamW, the lean layers")
    if before_lean:
        layers = "the same plain layers"
    commands = "; ".join(f"`{command}`" for command in results["commands"])
    peak = f"{first['peak_flops'] / 1e12:,.0f} TFLOP/s dense bf16" if first.get("peak_flops") else (
        "no known peak (MFU n/a)")
    if checks is None:
        functional = ("Functional checks (`benchmarks/gpu_worker.py checks`): not run with these numbers "
                      "(the run had no time left for them); see the earlier runs below.")
    else:
        off, res, gen, prof = (checks.get(name, {"not run": True})
                               for name in ("offload", "resume", "generation", "profile"))

        def verdict(check: dict) -> str:
            if check.get("not run"):  # a call cut off before it, or a result from before it existed
                return "not run"
            return "passed" if check.get("ok") else f"FAILED ({check.get('error', 'see the JSON')})"

        where = ("on the same GPU" if checks.get("device", first["device"]) == first["device"]
                 else f"on {checks['device']}")
        when = results.get("checks_date")
        where += f", {when}" if when and [when] != dates else ""
        functional = f"""Functional checks {where} (`benchmarks/gpu_worker.py checks`, default model):
- CPU offload (`strategy.cpu_offload=true`): shards on the host {off.get('shards_on_host')}, pinned
  {off.get('shards_pinned')}; 6 steps' losses against the on-device run, largest relative difference
  {off.get('max_rel_loss_diff', float('nan')):.1e}: {verdict(off)}.
- Async checkpoint and resume (`checkpoint.async_save=true checkpoint.interval=4`, killed after step 10,
  restarted): losses of steps 9-12 against the uninterrupted run, largest relative difference
  {res.get('max_rel_loss_diff', float('nan')):.1e}: {verdict(res)}.
- `shardtrain generate --mode gathered` and `--mode sharded` on that checkpoint, 64 greedy tokens: same
  text: {verdict(gen)}.
- `diagnostics.profile_at=3 diagnostics.profile_steps=2 diagnostics.memory_snapshot=true`: CUDA kernels
  in the trace {prof.get('kernels')}, allocator snapshot {prof.get('snapshot_bytes')} bytes, operator
  table logged {prof.get('table')}: {verdict(prof)}."""

    return f"""{GPU_BEGIN}
## GPU: a 1.1B Llama on one GPU, shardtrain vs a hand-written FSDP2 loop

- Command: {commands}
- Date: {", ".join(dates)}; device: {first['device']}, torch {first['torch']}, NCCL,
  world size 1 (torchrun); MFU against {peak}
- Model: `model=llama_1b` ({first['params'] / 1e9:.2f}B parameters: dim 2,048, 22 layers, 32 heads,
  4 KV heads, FFN 5,632, vocab 32,000), sequence 2,048, micro-batch 4 ({first['tokens_per_step']:,}
  tokens a step), `bf16-mixed`, AdamW, clipping at 1.0; FLOPs per token
  {first['flops_per_token'] / 1e9:.2f} G (6 x non-embedding parameters + attention), so activation
  recomputation is not counted as useful work.
- Method: shardtrain is `Trainer.create` + `Trainer.iteration`, the code `shardtrain train` runs
  (data, step, logging bookkeeping, the preemption check); the hand-written loop is the FSDP2
  tutorial's (`fully_shard` per block and root, `MixedPrecisionPolicy(bf16, fp32)`, the mean
  full-logits loss, `clip_grad_norm_`, `torch.optim.AdamW` with the same hyperparameters and its own
  kernel choice, `loss.item()`), with torch's `checkpoint_wrapper` for AC and `block.compile()` for
  compile, on shardtrain's Llama class and config ({layers}), started from
  shardtrain's weights on shardtrain's batches. shardtrain runs {defaults}. Both
  live in one process and alternate: 5 rounds of 5 steps after 5 warm-up steps each; a step's time is
  wall clock over a round with the device synchronised at its ends; medians, (min-max) over rounds.
- Peak memory (shardtrain alone, before the hand-written model exists): torch.cuda.max_memory_allocated
  over 3 steady-state steps / the peak shardtrain logs (`peak_memory_mib`); beside it what
  `shardtrain plan --simulate` and the planner predict for the same configuration.

| compile | AC | shardtrain tokens/s | hand-written tokens/s | shardtrain MFU | hand-written MFU | shardtrain ms/step | hand-written ms/step | ratio (time) | peak GiB: measured / logged | predicted GiB: simulated / planner |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
{chr(10).join(rows + gpu_profile_lines(runs))}

{functional}
{GPU_END}"""


def e2e_seconds(program: str, processes: int, precision: str, workdir: Path) -> float:
    """Mean wall-clock seconds per iteration over iterations E2E_FIRST+1..E2E_LAST of one run."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["BENCH_DIR"] = str(workdir)
    if program == "shardtrain":
        run_dir = workdir / "shardtrain"
        subprocess.run([sys.executable, "-m", "shardtrain", "train", f"trainer.devices={processes}",
                        f"trainer.max_steps={E2E_STEPS}", "trainer.seq_len=256",
                        f"trainer.micro_batch_size={16 // processes}",
                        f"strategy.mixed_precision={precision}", f"run.dir={run_dir}"],
                       check=True, capture_output=True, env=env, timeout=1800)
        stamps = {r["step"]: r["time"] for r in map(json.loads, (run_dir / "metrics.jsonl").open())
                  if r["kind"] == "train"}
        return (stamps[E2E_LAST] - stamps[E2E_FIRST]) / (E2E_LAST - E2E_FIRST)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
           str(ROOT / "benchmarks" / "e2e_programs.py"), program, str(E2E_STEPS), precision]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{program} at {processes} processes failed:\n{proc.stderr[-4000:]}")
    times = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])["seconds"]
    return sum(times[E2E_FIRST:E2E_LAST]) / (E2E_LAST - E2E_FIRST)


def e2e_results(rounds: int) -> list[dict]:
    """Every (processes, precision) case, the three programs alternating, ``rounds`` times over."""
    seconds = {case: {p: [] for p in E2E_PROGRAMS} for case in E2E_CASES}
    for round_index in range(rounds):
        for case in E2E_CASES:
            for program in E2E_PROGRAMS:
                with tempfile.TemporaryDirectory(dir=ROOT) as workdir:
                    seconds[case][program].append(e2e_seconds(program, *case, Path(workdir)))
                print(json.dumps({"round": round_index, "case": case, "program": program,
                                  "s": seconds[case][program][-1]}), flush=True)
    return [{"processes": n, "precision": precision, "seconds": seconds[(n, precision)]}
            for n, precision in E2E_CASES]


def render_e2e(results: list[dict], rounds: int, command: str) -> str:
    tokens = 16 * 256
    rows = []
    for r in results:
        med = {p: statistics.median(v) for p, v in r["seconds"].items()}
        spread = {p: f"{tokens / max(v):,.0f}-{tokens / min(v):,.0f}" for p, v in r["seconds"].items()}
        rows.append(
            f"| {r['processes']}, {r['precision']} | "
            + " | ".join(f"{tokens / med[p]:,.0f} ({spread[p]})" for p in E2E_PROGRAMS)
            + f" | **{med['shardtrain'] / med['handwritten']:.3f}** | **{med['lightning'] / med['shardtrain']:.3f}** |")
    return f"""{E2E_BEGIN}
## End to end: `shardtrain train` against a hand-written FSDP2 loop and Lightning

- Command: `{command}`
- Date: {datetime.date.today().isoformat()}; machine: {machine()}, gloo, Lightning
  {lightning_version()}
- What runs, each as its own program under torchrun, in {rounds} rounds in which the three alternate:
  `shardtrain train trainer.devices=N trainer.max_steps={E2E_STEPS} trainer.seq_len=256
  trainer.micro_batch_size=16/N strategy.mixed_precision=P` with everything else at its default
  (logging every 10 steps with TensorBoard, progress bar, diagnostics, checkpointing, final
  evaluation and sample); `benchmarks/e2e_programs.py handwritten` (the FSDP2 tutorial loop: shard
  blocks and root, AdamW, `clip_grad_norm_`, a print every 10 steps); `benchmarks/e2e_programs.py
  lightning` (`ModelParallelStrategy` with `configure_model`, `gradient_clip_val=1.0`, the default
  logger and progress bar). The same Llama (dim 256, 4 layers, 4 heads, 2 KV heads, FFN 704),
  sequence 256, global batch 16, AdamW; bf16-mixed = `MixedPrecisionPolicy(bf16, fp32)` for all three.
- Timed: whole iterations {E2E_FIRST + 1}-{E2E_LAST} of {E2E_STEPS}, wall clock (shardtrain: the
  time stamps of its step-{E2E_FIRST} and step-{E2E_LAST} metrics records; the others: their own
  per-iteration clocks). tokens/s = 4,096 tokens per iteration over the mean iteration time of a run;
  the table gives the median over rounds and (the slowest-the fastest round).
- Goals: time ratio shardtrain / hand-written at most 1.03; Lightning / shardtrain time (= shardtrain
  tokens/s over Lightning's) at least 1.10.

| processes, precision | hand-written tokens/s | Lightning tokens/s | shardtrain tokens/s | time: shardtrain / hand-written | speed: shardtrain / Lightning |
| --- | --- | --- | --- | --- | --- |
{chr(10).join(rows)}
{E2E_END}"""


def gemm_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    """The machine's matrix-product rate in one process at its default threads (median)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def profile_section(command: str, top: int = 8) -> str:
    """benchmarks/profile_step.py at 1 and 2 processes, fp32 and bf16-mixed: per-step wall time,
    time outside any operator, and the operators whose self time differs most."""
    parts = []
    for n, precision in E2E_CASES:
        r = run_torchrun(n, "profile_step.py", [f"trainer.micro_batch_size={16 // n}", "trainer.seq_len=256",
                                                f"strategy.mixed_precision={precision}"])
        ours, theirs = r["shardtrain"], r["handwritten"]
        ops = sorted(set(ours["self_s"]) | set(theirs["self_s"]),
                     key=lambda k: -abs(ours["self_s"].get(k, 0) - theirs["self_s"].get(k, 0)))[:top]
        rows = "\n".join(f"| `{k}` | {ours['self_s'].get(k, 0) * 1e3:.2f} | {theirs['self_s'].get(k, 0) * 1e3:.2f} |"
                         for k in ops)
        parts.append(f"""### {n} process{'es' if n > 1 else ''}, {precision}

| | shardtrain | hand-written |
| --- | --- | --- |
| wall ms per step (under the profiler) | {ours['wall_s'] * 1e3:.1f} | {theirs['wall_s'] * 1e3:.1f} |
| ms outside any operator (Python, hooks, glue) | {ours['outside_ops_s'] * 1e3:.1f} | {theirs['outside_ops_s'] * 1e3:.1f} |
| profiled events per step | {ours['ops_per_step']:,.0f} | {theirs['ops_per_step']:,.0f} |

| operator (largest differences in self CPU ms per step) | shardtrain | hand-written |
| --- | --- | --- |
{rows}""")
    fp32, bf16 = gemm_gflops(torch.float32), gemm_gflops(torch.bfloat16)
    return f"""{PROFILE_BEGIN}
## Profile: shardtrain's iteration against the hand-written step, op by op

- Command: `{command}`
- Date: {datetime.date.today().isoformat()}; machine: {machine()}, gloo
- Both loops of the step-time benchmark (same process, model, weights and batches; sequence 256,
  global batch 16), {10} steps each under `torch.profiler` (CPU activities) after 3 warm-up steps.
  "Outside any operator" is the wall time minus the time of top-level operators on the step's
  thread: Python, FSDP's hooks and everything else that is not a kernel.
- This machine's 2048^3 matrix product, {torch.get_num_threads()} threads: fp32 {fp32:,.0f} GFLOP/s,
  bf16 {bf16:,.0f} GFLOP/s. Its CPU has AVX512-BF16, so bf16 runs faster than fp32 here, for every
  implementation; on a CPU without bf16 instructions it runs slower. Measure yours before choosing.

{(chr(10) * 2).join(parts)}
{PROFILE_END}"""


def hf_section(command: str) -> str:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from hf_bench import HALF_B, SHAPE, make_half_b, make_same_shape

    with tempfile.TemporaryDirectory(dir=ROOT) as workdir:
        half_b = make_half_b(Path(workdir) / "half_b")
        file_gib = sum(f.stat().st_size for f in half_b.glob("*.safetensors")) / 2**30
        loads = [run_torchrun(n, "hf_bench.py", ["load", str(half_b)]) for n in (1, 2, 4)]
        shutil.rmtree(half_b)
        same = make_same_shape(Path(workdir) / "same_shape")
        speeds = [run_torchrun(n, "hf_bench.py", ["throughput", str(same), f"trainer.micro_batch_size={8 // n}",
                                                  "trainer.seq_len=256", f"strategy.mixed_precision={p}"])
                  for n, p in HF_SPEED_CASES]
    mib = 2**20
    load_rows = "\n".join(
        f"| {r['world_size']} | {max(x[0] for x in r['ranks']):.1f} | {max(x[1] for x in r['ranks']):.1f} | "
        f"{max(x[3] for x in r['ranks']) / mib:,.0f} | {max(x[2] for x in r['ranks']) / mib:,.0f} |"
        for r in loads)
    alone = max(x[2] for x in loads[0]["ranks"])
    four = max(x[2] for x in loads[-1]["ranks"])
    speed_rows = "\n".join(
        f"| {r['world_size']} | {r['precision']} | {r['tokens_per_step']} | {r['tokens_per_s']['builtin']:,.0f} | "
        f"{r['tokens_per_s']['hf']:,.0f} | {r['ratio']:.3f} |" for r in speeds)
    shape = ", ".join(o.split(".", 1)[1] for o in SHAPE)
    return f"""{HF_BEGIN}
## Hugging Face models (`model=hf`)

`{command}` on {machine()}, {datetime.date.today()}.

Loading: a model of Qwen2.5-0.5B's shape ({loads[0]['params'] / 1e6:.0f}M parameters, tied
{HALF_B['vocab_size']:,} x {HALF_B['hidden_size']} embedding; random weights saved by transformers in
bf16, one {file_gib:.2f} GiB file) built by `model=hf` on the meta device, sharded (FULL_SHARD) and
materialised in fp32 (no random weights are drawn for weights that are read next), then read from
the file, each rank only its own rows. The largest rank's numbers; peak growth is the resident set's
high-water mark over build and read, above where it stood before the build: the rank's fp32 shard
plus the file pages of its own rows (memory-mapped, counted while resident) and one tensor's rows in
flight.

| processes | build + materialise s | read weights s | shard (fp32 params) MiB | peak growth MiB |
| --- | --- | --- | --- | --- |
{load_rows}

At 4 processes each rank's peak growth is {four / alone:.2f} of one process loading alone (2 cores:
4 processes share them, so seconds do not shrink with the shard).

Training speed: the built-in Llama against the same shape built by transformers (`LlamaForCausalLM`,
SDPA attention) through `model=hf` ({shape}; {speeds[0]['params']['builtin'] / 1e6:.1f}M parameters both),
byte data, sequence 256, global batch 8, FULL_SHARD; whole loop iterations, the median of
{speeds[0]['steps_timed']} each, alternating rounds in the same processes. Goal: HF within 5% of the
built-in model (ratio = built-in step time / HF step time, >= 0.95).

| processes | precision | tokens/step | built-in tokens/s | HF tokens/s | ratio |
| --- | --- | --- | --- | --- | --- |
{speed_rows}
{HF_END}"""


def data_section(command: str) -> str:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import datasets  # the benchmark's comparison (pip install -e '.[test]')
    from data_bench import long_document_results, prepare_results, wait_results

    prep = prepare_results([1, 2])
    wait = wait_results()
    long = long_document_results()
    cut, uncut = long["prepare"], long["prepare_uncut"]
    long_rows = "\n".join(
        f"| {label} | {long[key]['seconds']:.1f} | {long[key]['peak_resident_bytes'] / 2**30:.2f} |"
        for key, label in (("prepare", "`prepare --workers 1`"), ("prepare_2_workers", "`prepare --workers 2`"),
                           ("prepare_uncut", "`prepare --workers 1`, the cut turned off"),
                           ("library_whole", "`tokenizers.Tokenizer.encode` of the whole text")))
    rows = "\n".join(
        f"| {r['workers']} | {r['tokens']:,} | {r['tokens_per_s']['shardtrain']:,.0f} | "
        f"{r['tokens_per_s']['datasets']:,.0f} | {r['ratio']:.2f} |" for r in prep["rows"])
    steady = wait["data_wait_pct"][1:]  # the first record holds the first, unprefetched step
    return f"""{DATA_BEGIN}
## Data pipeline

`{command}` on {machine()}, {datetime.date.today()}; datasets {datasets.__version__}.

`shardtrain prepare` against the `datasets` library on the same JSON Lines file (the standard
library's `.py` files, one document each, {prep['corpus_bytes'] / 1e6:.0f} MB) with the same fast tokenizer
(a byte-level BPE of 8,192 tokens trained locally), at the same number of processes: `load_dataset("json")`
then `map` (batched, `num_proc`), against `prepare --workers` (tokens, shards and manifest written).
Whole commands from a cold output, the median of {prep['rounds']} alternating rounds; the token counts
are checked equal (end-of-text tokens not counted). Goal: at least 1.0x.

| processes | tokens | prepare tokens/s | datasets map tokens/s | ratio (datasets time / prepare time) |
| --- | --- | --- | --- | --- |
{rows}

Data wait of the default run (`shardtrain train`, {wait['steps']} steps, batches made ahead in a
background thread): {statistics.mean(steady):.2f}% of the wall time on average over the records after
the first (largest {max(steady):.2f}%; the first record, whose first step makes its own batches:
{wait['data_wait_pct'][0]:.2f}%). Goal: under 2%.

One long document (the same files as one text, {long['bytes'] / 1e6:.0f} MB, {long['tokens']:,} tokens)
through `shardtrain prepare FILE --tokenizer DIR --val-percent 0` as a user runs it, which cuts a
document longer than 256 Ki characters after lone line ends (docs/data.md); the same command with the
cut turned off (the piece size raised past the document); and the `tokenizers` library's `encode` of
the whole text. Each in a fresh process; the peak is the summed resident size of the command and its
worker processes, sampled from outside every 5 ms. The ids are checked equal in all four.

| command | seconds | peak resident (GiB) |
| --- | --- | --- |
{long_rows}

Cut in pieces, `prepare` peaks at {uncut['peak_resident_bytes'] / cut['peak_resident_bytes']:.1f}x less memory than uncut and takes
{uncut['seconds'] / cut['seconds']:.1f}x less time (pieces are encoded a few at a time in parallel).
{DATA_END}"""


REPORT_TRAIN = ["train", "experiment=quick", "trainer.sample_tokens=0", "trainer.eval_every=10",
                "trainer.log_every=2", "trainer.max_steps=60", "checkpoint.interval=20", "trainer.devices=2"]


def screenshot(page: Path, out: Path, width: int = 1400, height: int = 3000) -> None:
    """``page`` as headless Chromium draws it (no network, no GPU, a throwaway profile)."""
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"--only report needs Chromium at {CHROMIUM} (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", "--force-color-profile=srgb", f"--user-data-dir={profile}",
             f"--screenshot={out}", f"--window-size={width},{height}", page.resolve().as_uri()],
            capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or not out.is_file():
        raise SystemExit(f"chromium did not write a screenshot:\n{proc.stderr[-3000:]}")


def screenshot_check(path: Path, run_colours: list[str]) -> dict:
    """What the screenshot holds: distinct colours, and pixels drawn in each run's colour (the
    figures' lines: a page whose images did not render has none)."""
    image = Image.open(path).convert("RGB")
    counts = {colour: n for n, colour in image.getcolors(maxcolors=image.width * image.height)}
    wanted = {hex_colour: tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)) for hex_colour in run_colours}
    result = {"size": image.size, "distinct_colours": len(counts),
              "largest_share": max(counts.values()) / (image.width * image.height),
              "run_colour_pixels": {h: counts.get(rgb, 0) for h, rgb in wanted.items()}}
    if result["distinct_colours"] < 100 or min(result["run_colour_pixels"].values()) < 500:
        raise SystemExit(f"the screenshot {path} looks blank or without its figures: {result}")
    return result


def keep_small(screenshot_path: Path, out: Path, width: int = 900) -> None:
    """The screenshot for the docs: scaled to ``width`` and reduced to a 128-colour palette."""
    image = Image.open(screenshot_path).convert("RGB")
    image = image.resize((width, round(image.height * width / image.width)), Image.LANCZOS)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.quantize(colors=128).save(out, optimize=True)


def report_section(command: str, repeats: int = 3) -> str:
    """Runs made here, `shardtrain report` timed on them, its page screenshotted and checked."""
    with tempfile.TemporaryDirectory(dir=ROOT) as workdir:
        work = Path(workdir)
        restarted, lower, long = work / "restarted", work / "lower_lr", work / "long"
        # Rank 1 is killed at step 33 of the first attempt: torchrun restarts both ranks, which
        # resume from step-20 and log steps 22-32 again.
        killed = {"SHARDTRAIN_FAULT": "step:1:33:kill:0"}
        subprocess.run([sys.executable, "-m", "shardtrain", *REPORT_TRAIN, "trainer.max_restarts=1",
                        "checkpoint.async_save=true", f"run.dir={restarted}"], check=True,
                       capture_output=True, env={**os.environ, **killed}, timeout=900)
        cli_seconds(*REPORT_TRAIN, "trainer.lr=0.001", f"run.dir={lower}")
        cli_seconds("train", "experiment=quick", "trainer.sample_tokens=0", "trainer.max_steps=1000",
                    "trainer.log_every=1", "trainer.eval_every=100", "checkpoint.interval=250",
                    f"run.dir={long}")
        records = {run.name: sum(1 for _ in open(run / "metrics.jsonl")) for run in (restarted, lower, long)}
        page = work / "report.html"
        load = os.getloadavg()[0]  # the timings below are only as quiet as the machine was
        pair = min(cli_seconds("report", str(restarted), str(lower), "--out", str(page))
                   for _ in range(repeats))
        single_long = min(cli_seconds("report", str(long), "--out", str(work / "long.html"))
                          for _ in range(repeats))
        shot = work / "screenshot.png"
        start = time.perf_counter()
        screenshot(page, shot)
        shot_s = time.perf_counter() - start
        check = screenshot_check(shot, RUN_COLOURS[:2])
        keep_small(shot, REPORT_SCREENSHOT)
        page_kib = page.stat().st_size / 1024
        chromium = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True).stdout.strip()
    pixels = ", ".join(f"{colour}: {n:,}" for colour, n in check["run_colour_pixels"].items())
    return f"""{REPORT_BEGIN}
## Run report

`{command}` on {machine()}, {datetime.date.today()}; {chromium}.

Runs made for it (`experiment=quick`, 2 processes, 60 steps, a record every 2): `restarted` (rank 1
killed at step 33, torchrun restarts both ranks, they resume from step-20; async checkpoints) with
{records['restarted']} metrics lines, `lower_lr` (`trainer.lr=0.001`) with {records['lower_lr']}, and `long` (1 process,
1,000 steps, a record every step) with {records['long']:,}.

Load average when the timing started: {load:.1f} on {os.cpu_count()} cores.

| `shardtrain report` (whole command, fastest of {repeats}) | seconds |
| --- | --- |
| `restarted` + `lower_lr` overlaid (10 panels, 10 PNGs, page {page_kib:,.0f} KiB) | {pair:.2f} |
| `long` alone | {single_long:.2f} |

Headless Chromium (`--headless --screenshot --window-size=1400,3000`, network off) drew the page in
{shot_s:.1f} s: {check['distinct_colours']:,} distinct colours, the most common (the background)
{check['largest_share']:.0%} of the pixels; pixels in the two runs' line colours: {pixels}
(checked: at least 100 colours and 500 pixels of each run's colour, or the benchmark fails). The
screenshot, scaled to 900 pixels wide, is [docs/images/report.png](images/report.png), shown in
[report.md](report.md).
{REPORT_END}"""


def ablation_run(model: str, program: str, overrides: list[str], processes: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["WARMUP"], env["STEPS"] = str(ABLATION_WARMUP), str(ABLATION_STEPS)
    if program == "paired":
        env["STEPS"], env["ROUNDS"] = str(PAIRED_STEPS), str(PAIRED_ROUNDS)
    else:
        # Freed tensors leave the resident set at once, so that the peak is what a step holds. Not
        # for the paired program, which measures speed only: every large allocation then maps fresh
        # pages, and the page faults cost both loops 20-25% of their tokens/s on this CPU
        # (2026-11-27), more for the loop that allocates more, and vary with the machine's state.
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    with tempfile.TemporaryDirectory(dir=ROOT) as workdir:
        env["BENCH_DIR"] = workdir
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
               str(ROOT / "benchmarks" / "ablation.py"), model, program, *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600, cwd=workdir)
    measured = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    # Lightning's 2-process run has aborted in its teardown after printing its result ("terminate
    # called without an active exception"): what it measured stands, the crash is reported.
    if not measured:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    if proc.returncode != 0:
        print(f"{program} ({model}, {processes} processes) exited {proc.returncode} after its result",
              file=sys.stderr)
    return json.loads(measured[-1])


def ablation_results(rounds: int, processes: list[int]) -> dict:
    """(model, processes, row) -> the runs' results, every program of a (model, processes) case
    alternating within each round."""
    results: dict = {}
    for round_index in range(rounds):
        for n in processes:
            for model in ABLATION_MODELS:
                for label, program, overrides in ABLATION_PROGRAMS:
                    result = ablation_run(model, program, overrides.get(model, []), n)
                    results.setdefault((model, n, label), []).append(result)
                    print(json.dumps({"round": round_index, "model": model, "processes": n, "row": label,
                                      **result}), flush=True)
    return results


def paired_results(processes: list[int]) -> dict:
    """(model, processes) -> benchmarks/ablation.py's paired program's result."""
    results = {}
    for n in processes:
        for model in ABLATION_MODELS:
            results[model, n] = ablation_run(model, "paired", [], n)
            print(json.dumps({"model": model, "processes": n, **results[model, n]}), flush=True)
    return results


def paired_section(results: dict, processes: list[int], command: str) -> str:
    lines = [PAIRED_BEGIN, "## Ablation, paired: shardtrain's defaults and the hand-written loop in one program", "",
             f"- Command: `{command}`",
             f"- Date: {datetime.date.today().isoformat()}; machine: {machine()}, gloo, fp32; load average "
             f"{os.getloadavg()[0]:.1f} at the end",
             "- The ablation's two programs (benchmarks/ablation.py `paired`) built side by side in the same "
             f"processes, one torchrun program per case, alternating {PAIRED_ROUNDS} rounds of {PAIRED_STEPS} "
             f"timed iterations each after {ABLATION_WARMUP} of each: a load on the machine that comes and "
             "goes hits both alike, which fresh programs in turn (the ablation above) cannot promise. Median "
             "iteration, tokens/s; no memory column (both models are resident), and so glibc's default "
             "allocator settings, as users run (the ablation's `MALLOC_MMAP_THRESHOLD_` for its memory "
             "columns maps fresh pages for every large tensor, whose faults cost both loops 20-25% of "
             "their speed here).", "",
             "| model | processes | hand-written tokens/s | shardtrain, defaults | shardtrain / hand-written |",
             "| --- | --- | --- | --- | --- |"]
    for model in ABLATION_MODELS:
        for n in processes:
            paired = results[model, n]
            hand_rate, ours = paired["handwritten_tokens_per_s"], paired["shardtrain_tokens_per_s"]
            lines.append(f"| {model} | {n} | {hand_rate:,.0f} | {ours:,.0f} | {ours / hand_rate:.2f}x |")
    return "\n".join(lines + ["", PAIRED_END])


def ablation_section(results: dict, rounds: int, processes: list[int], command: str) -> str:
    def median(model: str, n: int, label: str, key: str) -> float:
        return statistics.median(r[key] for r in results[model, n, label])

    hand = ABLATION_PROGRAMS[0][0]
    lines = [ABLATION_BEGIN, "## Ablation: shardtrain's speed features against a hand-written loop and Lightning", "",
             f"- Command: `{command}`",
             f"- Date: {datetime.date.today().isoformat()}; machine: {machine()}, gloo, fp32, Lightning "
             f"{lightning_version()}; load average {os.getloadavg()[0]:.1f} at the end",
             "- Each row is its own torchrun program (benchmarks/ablation.py), started fresh; the rows of a "
             f"case alternate within each of {rounds} rounds. A program runs {ABLATION_WARMUP} warm-up "
             f"iterations, then times {ABLATION_STEPS} (whole iterations: batch, forward, backward, clipping, optimizer, the loss read); "
             "peak MiB is the largest rank's peak resident size during the timed iterations (weights, "
             "optimizer state and all a step allocates; `MALLOC_MMAP_THRESHOLD_=65536`). Medians over rounds.",
             "- The hand-written loop is the FSDP2 tutorial's (blocks then root, `torch.optim.AdamW()` as "
             "constructed by default, the full-logits loss, `clip_grad_norm_`); Lightning's "
             "`ModelParallelStrategy` runs the same sharding with `gradient_clip_val=1.0`. All train the "
             "same Llama class at the same batch, learning rate and precision; the hand-written loop and "
             "Lightning with plain autograd's norms and SwiGLU (`lean_layers=False`), as a model of one's "
             "own has them.",
             "- Goals (issue 26): shardtrain's defaults at least 1.15x the hand-written loop's tokens/s and "
             "at least 30% less peak memory on the vocabulary-heavy model; never slower on the default model.", ""]
    for model, title in ABLATION_MODELS.items():
        head = " | ".join(f"{n} proc. tokens/s (x hand-written) | {n} proc. peak MiB (x hand-written)" for n in processes)
        lines += [f"**{title}**", "", f"| program | {head} |", "| --- |" + " --- | --- |" * len(processes)]
        for label, _, _ in ABLATION_PROGRAMS:
            cells = []
            for n in processes:
                rate, peak = median(model, n, label, "tokens_per_s"), median(model, n, label, "peak_mib")
                rate_x = rate / median(model, n, hand, "tokens_per_s")
                peak_x = peak / median(model, n, hand, "peak_mib")
                cells.append(f"{rate:,.0f} ({rate_x:.2f}x) | {peak:,.0f} ({peak_x:.2f}x)")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    cases = [(model, n) for model in ABLATION_MODELS for n in processes]
    lines += ["**Step memory**: each program's peak less its resident size just before the timed iterations "
              "(the interpreter, torch, the weights and the optimizer state, alike in every program), that "
              "is what a step allocates; MiB (x hand-written).", "",
              "| program | " + " | ".join(f"{model}, {n} proc." for model, n in cases) + " |",
              "| --- |" + " --- |" * len(cases)]
    for label, _, _ in ABLATION_PROGRAMS:
        cells = [f"{median(model, n, label, 'step_mib'):,.0f} "
                 f"({median(model, n, label, 'step_mib') / median(model, n, hand, 'step_mib'):.2f}x)"
                 for model, n in cases]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", ABLATION_END])


TP_READING = (
    "Reading it: at the same global batch a TP rank computes its group's whole micro-batch (twice an "
    "FSDP rank's) for half of each matmul, so the FLOPs per rank are FSDP's, but every block adds two "
    "all-gathers and two reduce-scatters of activations (with sequence parallelism; two all-reduces "
    "without) on the critical path, where FSDP's traffic overlaps; on 2 CPU cores over gloo that costs "
    "{low:.0%}-{high:.0%} of the tokens/s. Memory is not saved at this size either: the activations "
    "between the matmuls and the vocabulary-split loss's extra tensors (docs/memory-planner.md) "
    "outweigh the halved weights of a model this small. TP is for where FSDP alone stops fitting "
    "(docs/scaling.md).")


def tp_section(command: str, rounds: int) -> str:
    """Tensor parallelism's cost on this CPU: benchmarks/ablation.py's shardtrain program (fresh
    torchrun programs, alternating in rounds) under FSDP and under TP, tokens/s and peak memory."""
    results: dict = {}
    for round_index in range(rounds):
        for model in ABLATION_MODELS:
            for label, processes, overrides in TP_PROGRAMS:
                result = ablation_run(model, "shardtrain", overrides, processes)
                results.setdefault((model, label), []).append(result)
                print(json.dumps({"round": round_index, "model": model, "row": label, **result}), flush=True)

    def median(model: str, label: str, key: str) -> float:
        return statistics.median(r[key] for r in results[model, label])

    base = TP_PROGRAMS[0][0]
    lines = [TP_BEGIN, "## Tensor parallelism on CPU (for the record)", "",
             f"- Command: `{command}`",
             f"- Date: {datetime.date.today().isoformat()}; machine: {machine()}, gloo, fp32; load average "
             f"{os.getloadavg()[0]:.1f} at the end. The machine was shared with other work while it ran.",
             "- Each row is shardtrain's training iteration (benchmarks/ablation.py's `shardtrain` program, "
             f"defaults plus the row's settings), a fresh torchrun program of 2 processes; rows alternate "
             f"within each of {rounds} rounds; {ABLATION_WARMUP} warm-up then {ABLATION_STEPS} timed "
             "iterations; the same global batch (a TP group is one data-parallel rank, so its micro-batch "
             "is twice FSDP's). Peak MiB: the largest rank's peak resident size over the timed iterations. "
             "Medians over rounds.",
             "- 4 processes (FSDP 4 against FSDP 2 x TP 2) are not measured: on 2 cores they would time "
             "the oversubscription.", ""]
    for model, title in ABLATION_MODELS.items():
        lines += [f"**{title}**", "", "| layout | tokens/s (x FSDP 2) | peak MiB (x FSDP 2) |", "| --- | --- | --- |"]
        for label, _, _ in TP_PROGRAMS:
            rate, peak = median(model, label, "tokens_per_s"), median(model, label, "peak_mib")
            lines.append(f"| {label} | {rate:,.0f} ({rate / median(model, base, 'tokens_per_s'):.2f}x) | "
                         f"{peak:,.0f} ({peak / median(model, base, 'peak_mib'):.2f}x) |")
        lines.append("")
    costs = [1 - median(model, label, "tokens_per_s") / median(model, base, "tokens_per_s")
             for model in ABLATION_MODELS for label, _, _ in TP_PROGRAMS[1:]]
    lines += [TP_READING.format(low=min(costs), high=max(costs)), ""]
    return "\n".join(lines + [TP_END])


def lightning_version() -> str:
    try:
        from importlib.metadata import version
        return version("lightning")
    except Exception:
        return "not installed"


def loss_bench(*args: object, env: dict | None = None) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "loss_bench.py"), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def loss_section(command: str, rounds: int) -> str:
    """docs/benchmarks.md's chunked-loss section: peak memory per vocabulary, tokens/s per model."""
    memory = {(vocab, kind): loss_bench("memory", vocab, 512, 8, 512, 4, kind,
                                        env={"MALLOC_MMAP_THRESHOLD_": "65536"})
              for vocab in LOSS_MEMORY_VOCABS for kind in LOSS_KINDS}
    load = os.getloadavg()[0]
    speed = [(name, loss_bench("speed", *shape, rounds)) for name, *shape in LOSS_SPEED_MODELS]
    lines = [LOSS_BEGIN, "## Chunked loss", "",
             "The fused, chunked linear + cross-entropy (`trainer.loss_chunk_tokens`, tasks/losses.py) "
             "against the plain loss that upcasts the whole `[tokens, vocab]` logits to fp32.", "",
             f"`{command}` on {cpu_name()}, {datetime.date.today()}, torch {torch.__version__}, "
             f"load average {load:.1f} on {os.cpu_count()} cores when it ran (other work shared the "
             "machine).", "",
             "A step's peak resident memory above what stays between steps (weights and AdamW's state), "
             "dim 512, 8 layers, 4 sequences of 512 tokens (2,048 tokens), fp32, one process, a fresh "
             f"process per case; `chunked` is `trainer.loss_chunk_tokens={DEFAULT_CHUNK_TOKENS}` (auto's "
             "chunk), `recompute` "
             "the same chunks under `torch.utils.checkpoint` (the design not chosen):", "",
             "| vocabulary | full fp32 logits MiB | plain MiB | chunked MiB | recompute MiB | chunked / plain |",
             "| --- | --- | --- | --- | --- | --- |"]
    for vocab in LOSS_MEMORY_VOCABS:
        peaks = [memory[vocab, kind]["step_peak_mib"] for kind in LOSS_KINDS]
        lines.append(f"| {vocab:,} | {memory[vocab, 'plain']['logits_fp32_mib']:,.0f} | "
                     + " | ".join(f"{p:,.0f}" for p in peaks) + f" | {peaks[1] / peaks[0]:.2f} |")
    lines += ["", f"Tokens/s of a whole step (forward, backward, fused AdamW), the three losses "
              f"alternating step by step in one process, median of {rounds} rounds:", "",
              "| model | vocabulary | tokens/step | plain | chunked | recompute | chunked / plain |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, result in speed:
        rates = [result["tokens_per_s"][kind] for kind in LOSS_KINDS]
        lines.append(f"| {name} (dim {result['dim']}, {result['layers']} layers) | {result['vocab']:,} | "
                     f"{result['batch'] * result['seq']:,} | " + " | ".join(f"{r:,.0f}" for r in rates)
                     + f" | {rates[1] / rates[0]:.2f} |")
    return "\n".join(lines + [LOSS_END])


def ac_section(command: str, rounds: int) -> str:
    """docs/benchmarks.md's activation-checkpointing section: a step's peak memory and tokens/s of
    every ``strategy.activation_checkpointing`` mode."""
    bench = [sys.executable, str(ROOT / "benchmarks" / "ac_bench.py")]

    def run(*args: object, env: dict | None = None) -> dict:
        proc = subprocess.run([*bench, *map(str, args)], capture_output=True, text=True, timeout=3600,
                              env={**os.environ, **(env or {})}, cwd=ROOT / "benchmarks")
        if proc.returncode != 0:
            raise SystemExit(f"ac_bench {args} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    kinds = (("lean (default)", "1"), ("plain autograd", "0"))  # model.lean_layers
    speed = {kind: run("speed", *AC_SHAPE, rounds, env={"LEAN_LAYERS": lean}) for kind, lean in kinds}
    modes = list(speed[kinds[0][0]]["losses"])  # ac_bench.MODES, in its order
    memory = {(kind, mode): run("memory", *AC_SHAPE, mode.replace(" ", "_"),
                                env={"MALLOC_MMAP_THRESHOLD_": "65536", "LEAN_LAYERS": lean})
              for kind, lean in kinds for mode in modes}
    load = os.getloadavg()[0]
    dim, layers, seq, batch = AC_SHAPE
    same = all(losses == result["losses"]["none"] for result in speed.values()
               for losses in result["losses"].values())
    lines = [AC_BEGIN, "## Selective activation checkpointing", "",
             "`strategy.activation_checkpointing` modes against each other: the built-in Llama, dim "
             f"{dim}, {layers} layers, vocabulary 256, {batch} sequences of {seq} tokens, fp32, one "
             "process (blocks checkpointed as `parallelize` does it; `every_k` with k = 2; `selective`: "
             "attention's and every second matmul's outputs kept, counted back from the block's last (wk, "
             "wo, w3); `odd matmuls kept (torchtitan)`: torchtitan's per-operation policy, attention's and "
             "the 1st, 3rd, ... matmul's outputs kept (wq, wv, w1, w2), shardtrain's selective on "
             "2026-11-27, and still for blocks with a LoRA adapter on the last projection or float8 linears; "
             "`every matmul kept`: "
             "every matmul's and attention's outputs kept, shardtrain's selective until 2026-11-27; the "
             "last two for this comparison, benchmarks/ac_bench.py), with its lean layers "
             "(the default) and with plain autograd's norms and SwiGLU (`model.lean_layers=false`, as "
             "Hugging Face models have them).", "",
             f"`{command}` on {cpu_name()}, {datetime.date.today()}, torch {torch.__version__}, load "
             f"average {load:.1f} on {os.cpu_count()} cores when it ran (other work shared the machine).", "",
             "| layers | mode | step peak MiB above weights + state | vs none | CPU s a step | vs none | "
             "tokens/s (wall) | vs none |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind, _ in kinds:
        rates, cpu = speed[kind]["tokens_per_s"], speed[kind]["cpu_s_per_step"]
        for mode in modes:
            peak, none_peak = memory[kind, mode]["step_peak_mib"], memory[kind, "none"]["step_peak_mib"]
            lines.append(f"| {kind} | {mode} | {peak:,.0f} | {peak / none_peak:.2f} | "
                         f"{cpu[mode]:.2f} | {cpu[mode] / cpu['none']:.2f} | "
                         f"{rates[mode]:,.0f} | {rates[mode] / rates['none']:.2f} |")
    lines += ["", f"Memory: Linux's peak resident size over one step, a fresh process per mode. Time: "
              f"median of {rounds} rounds, the modes alternating step by step in one process; the "
              "process runs one thread, whose CPU seconds count only the mode's own work; the wall clock "
              "also counts other processes' on a shared machine. The "
              f"modes' losses over the {rounds + 1} steps (each kind of layers among its modes) were "
              + ("identical bit for bit." if same else f"not identical: {speed}")]
    return "\n".join(lines + [AC_END])


# The model of docs/finetuning.md's memory table, larger: full fine-tuning's state (16 bytes a
# parameter) must stand out of a CPU process's ~500 MiB runtime.
LORA_SHAPE = ["model.dim=1024", "model.n_layers=8", "model.n_heads=16", "model.n_kv_heads=8", "model.ffn_hidden_dim=0",
              "trainer.micro_batch_size=2", "trainer.seq_len=128", "strategy.mixed_precision=fp32"]


def lora_section(command: str, processes: int = 2, steps: int = 3) -> str:
    """docs/benchmarks.md's LoRA memory section: per-rank state and peak resident memory of full
    fine-tuning and ``finetune=lora`` (rank 16, default targets) of the same model at ``processes``
    ranks, measured by ``shardtrain train`` itself (the first step's table, metrics.jsonl), with the
    planner's figures for the same configuration beside them."""
    mib = 2**20
    rows = []
    load = os.getloadavg()[0]
    for method in ("none", "lora"):
        overrides = ["experiment=quick", f"finetune={method}", *LORA_SHAPE, f"trainer.devices={processes}",
                     f"trainer.max_steps={steps}", "trainer.eval_every=0", "trainer.sample_tokens=0",
                     "checkpoint.enabled=false"]
        with tempfile.TemporaryDirectory() as run_dir:
            proc = subprocess.run([*shardtrain_command(), "train", *overrides, f"run.dir={run_dir}"],
                                  capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                raise SystemExit(f"finetune={method} failed:\n{proc.stderr[-3000:]}")
            records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        ranks = next(r for r in records if r["kind"] == "memory_ranks")["ranks"]
        peaks = [max(phase["rss_mib"] for phase in rank["phases"].values()) for rank in ranks]
        cfg = compose_config(overrides)
        model = planned_model(cfg)
        planned = estimate(cfg, model, cfg.strategy.sharding_strategy, processes, processes, accelerated=False)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        rows.append((method, sum(p.numel() for p in model.parameters()), trainable, ranks[0], max(peaks),
                     planned))
    lines = [LORA_BEGIN, "## LoRA against full fine-tuning: memory per rank", "",
             f"`{command}` on {cpu_name()}, {datetime.date.today()}, torch {torch.__version__}, load average "
             f"{load:.1f} on {os.cpu_count()} cores when it ran. The built-in Llama ({', '.join(LORA_SHAPE)}), "
             f"{processes} processes, FULL_SHARD, {steps} steps of `shardtrain train`; `finetune=lora` with "
             "rank 16 on the default targets (the 7 projections of every block). Measured: rank 0's "
             "parameters, gradients and optimizer state after the first step (the start-up table, "
             "metrics.jsonl) and the largest resident set of any rank over the step's phases; planner: "
             "`shardtrain plan`'s formulas for the same configuration (fp32, rank 0).", "",
             "| | parameters (trainable) | params MiB | grads MiB | optimizer MiB | state MiB (planner) | "
             "peak RSS MiB (planner's peak above the runtime) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for method, total, trainable, rank0, peak, planned in rows:
        state = rank0["params_mib"] + rank0["grads_mib"] + rank0["optimizer_mib"]
        planned_state = (planned.params + planned.grads + planned.optimizer) / mib
        lines.append(f"| {'full fine-tuning' if method == 'none' else 'finetune=lora'} | {total / 1e6:.1f}M "
                     f"({trainable / 1e6:.2f}M) | {rank0['params_mib']:.1f} | {rank0['grads_mib']:.1f} | "
                     f"{rank0['optimizer_mib']:.1f} | {state:.1f} ({planned_state:.1f}) | {peak:,.0f} "
                     f"({planned.peak / mib:,.0f}) |")
    (_, _, _, full0, full_peak, full_plan), (_, _, _, lora0, lora_peak, lora_plan) = rows
    saved = sum(full0[k] - lora0[k] for k in ("params_mib", "grads_mib", "optimizer_mib"))
    planned_saved = sum(getattr(full_plan, k) - getattr(lora_plan, k) for k in ("params", "grads", "optimizer"))
    lines += ["", f"LoRA held {saved:,.0f} MiB less state per rank (the planner: {planned_saved / mib:,.0f}), "
              f"and its peak resident set was {full_peak - lora_peak:,.0f} MiB lower (the planner's peak: "
              f"{(full_plan.peak - lora_plan.peak) / mib:,.0f} MiB lower). On a CPU "
              "the resident set also holds the runtime (the interpreter, torch, gloo: about 500 MiB a "
              "process), which the planner, made for accelerators, does not count; its state columns "
              "are exact for FSDP2's layout.", LORA_END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--only", choices=["training", "checkpoint", "generation", "generation-modes",
                                           "init", "scaling", "soak", "gpu", "e2e", "profile", "hf",
                                           "data", "task", "checksum", "cli", "report", "loss", "ac", "lora",
                                           "float8", "ablation", "paired", "tp", "qlora"],
                        default=None)
    parser.add_argument("--rounds", type=int, default=3, help="--only e2e, loss, ac, ablation, tp: alternating rounds")
    parser.add_argument("--gpu-variants", nargs="+", choices=list(GPU_VARIANT_NAMES),
                        default=list(GPU_VARIANT_NAMES), help="--only gpu: the (compile, AC) variants")
    parser.add_argument("--train-steps", type=int, default=300, help="--only float8: steps of each run")
    parser.add_argument("--no-checks", action="store_true", help="--only gpu: skip the functional checks")
    parser.add_argument("--json-out", type=Path, default=None, help="--only gpu: also the raw results")
    parser.add_argument("--from-json", type=Path, nargs="+", default=None,
                        help="--only gpu, float8: render the section from saved results (a machine without a GPU)")
    args = parser.parse_args()
    if args.only not in ("gpu", "float8", "qlora"):
        # The CPU sections compare shardtrain with programs that run on the CPU only (the hand-written
        # loop's and Lightning's meshes): on a GPU machine shardtrain would take the GPU.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.only in (None, "training"):
        results = []
        for n in args.processes:
            results.append(run_torchrun(n, "step_time.py", [f"trainer.micro_batch_size={16 // n}"]))
            print(json.dumps(results[-1]))
        command = "python benchmarks/run.py --only training --processes " + " ".join(
            map(str, args.processes))
        write_section(BEGIN, END, render(results, command))
    if args.only in (None, "task"):
        results = []
        for n in args.processes:
            results.append(run_torchrun(n, "task_step_time.py", [f"trainer.micro_batch_size={32 // n}"]))
            print(json.dumps(results[-1]))
        command = "python benchmarks/run.py --only task --processes " + " ".join(map(str, args.processes))
        write_section(TASK_BEGIN, TASK_END, render_task(results, command))
    if args.only in (None, "checkpoint"):
        with tempfile.TemporaryDirectory(dir=ROOT) as workdir:
            results = checkpoint_results(Path(workdir))
        write_section(CKPT_BEGIN, CKPT_END,
                      render_checkpoint(results, "python benchmarks/run.py --only checkpoint"))
    if args.only in (None, "checksum"):
        with tempfile.TemporaryDirectory(dir=ROOT) as workdir:
            results = checksum_results(Path(workdir))
        write_section(SUM_BEGIN, SUM_END, render_checksum(results, "python benchmarks/run.py --only checksum"))
    if args.only in (None, "cli"):
        write_section(CLI_BEGIN, CLI_END, cli_section("python benchmarks/run.py --only cli"))
    if args.only in (None, "generation"):
        write_section(GEN_BEGIN, GEN_END, render_generation(
            generation_results(), "python benchmarks/run.py --only generation"))
    if args.only in (None, "init"):
        results = [run_torchrun(n, "init_worker.py", [mode]) for n in (1, 2, 4)
                   for mode in ("chunked", "full")]
        write_section(INIT_BEGIN, INIT_END, render_init(results, "python benchmarks/run.py --only init"))
    if args.only in (None, "generation-modes"):
        write_section(MODES_BEGIN, MODES_END,
                      generation_modes_section("python benchmarks/run.py --only generation-modes"))
    if args.only in (None, "scaling"):
        scaling, timing = scaling_sections("python benchmarks/run.py --only scaling")
        write_section(SCALING_BEGIN, SCALING_END, scaling, SCALING_DOC)
        write_section(SIM_BEGIN, SIM_END, timing)
    if args.only in (None, "data"):
        write_section(DATA_BEGIN, DATA_END, data_section("python benchmarks/run.py --only data"))
    if args.only in (None, "hf"):
        write_section(HF_BEGIN, HF_END, hf_section("python benchmarks/run.py --only hf"))
    if args.only in (None, "loss"):
        write_section(LOSS_BEGIN, LOSS_END, loss_section(
            f"python benchmarks/run.py --only loss --rounds {args.rounds}", args.rounds))
    if args.only == "ablation":
        results = ablation_results(args.rounds, args.processes)
        command = f"python benchmarks/run.py --only ablation --rounds {args.rounds}"
        write_section(ABLATION_BEGIN, ABLATION_END, ablation_section(results, args.rounds, args.processes, command))
    if args.only == "paired":
        write_section(PAIRED_BEGIN, PAIRED_END,
                      paired_section(paired_results(args.processes), args.processes, "python benchmarks/run.py --only paired"))
    if args.only == "tp":
        write_section(TP_BEGIN, TP_END, tp_section(f"python benchmarks/run.py --only tp --rounds {args.rounds}",
                                                   args.rounds))
    if args.only in (None, "lora"):
        write_section(LORA_BEGIN, LORA_END, lora_section("python benchmarks/run.py --only lora"))
    if args.only in (None, "ac"):
        write_section(AC_BEGIN, AC_END, ac_section(
            f"python benchmarks/run.py --only ac --rounds {args.rounds}", args.rounds))
    if args.only == "float8":
        if args.from_json:
            result = json.loads(args.from_json[0].read_text())
            result["date"] = measured_on(result, args.from_json[0])
        else:
            if not torch.cuda.is_available():
                raise SystemExit("--only float8 needs a GPU of compute capability 8.9+ (H100, L4, ...)")
            partial = ["--partial", str(args.json_out)] if args.json_out is not None else []
            result = run_torchrun(1, "gpu_worker.py", ["float8", "--train-steps", str(args.train_steps),
                                                       "--steps", "10", *partial])
            result["date"] = datetime.date.today().isoformat()
            if args.json_out is not None:
                args.json_out.write_text(json.dumps(result, indent=1))
        train_steps = len(result["losses"]["bf16"])
        write_section(FLOAT8_BEGIN, FLOAT8_END, float8_section(
            f"python benchmarks/run.py --only float8 --train-steps {train_steps}", result))
    if args.only == "qlora":
        if not torch.cuda.is_available():
            raise SystemExit("--only qlora needs a CUDA GPU (NF4 runs on a CPU, dequantising every weight "
                             "in each matmul, but its timings there say nothing)")
        results = [run_torchrun(1, "qlora_bench.py", [variant]) for variant in ("lora", "qlora")]
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(results, indent=1))
        write_section(QLORA_BEGIN, QLORA_END, qlora_section("python benchmarks/run.py --only qlora", results))
    if args.only == "report":
        write_section(REPORT_BEGIN, REPORT_END, report_section("python benchmarks/run.py --only report"))
    if args.only == "soak":
        with tempfile.TemporaryDirectory(dir=ROOT) as workdir:
            soak = run_torchrun(2, "soak_worker.py", [str(Path(workdir) / "soak"), "2000"])
        write_section(SOAK_BEGIN, SOAK_END, render_soak(soak, "python benchmarks/run.py --only soak"))
    if args.only == "profile":
        write_section(PROFILE_BEGIN, PROFILE_END, profile_section("python benchmarks/run.py --only profile"))
    if args.only == "e2e":
        write_section(E2E_BEGIN, E2E_END, render_e2e(e2e_results(args.rounds), args.rounds,
                                                     f"python benchmarks/run.py --only e2e --rounds {args.rounds}"))
    if args.only == "gpu":
        if args.from_json:
            results = {"runs": [], "commands": [], "dates": []}
            for path in args.from_json:
                part = json.loads(path.read_text())
                if part["runs"]:  # each file's measurements' date and command (gpu_session.sh's calls)
                    results["dates"].append(measured_on(part, path))
                    results["commands"].append(part.get("command", "python benchmarks/run.py --only gpu"))
                results["runs"] += part["runs"]
                if part.get("checks") is not None:  # gpu_session.sh writes them to a file of their own
                    results["checks"] = part["checks"]
                    results["checks_date"] = measured_on(part, path)
            machines = {(run["device"], run["torch"]) for run in results["runs"]}
            if len(machines) > 1:
                raise SystemExit(f"--only gpu: runs of {len(machines)} devices or torch versions "
                                 f"({sorted(machines)}): one table compares runs on one; docs/benchmarks.md "
                                 "unchanged")
        else:
            command = " ".join(["python benchmarks/run.py --only gpu", "--gpu-variants", *args.gpu_variants]
                               + (["--no-checks"] if args.no_checks else []))
            results = gpu_results(args.gpu_variants, not args.no_checks, command, args.json_out)
            results["commands"], results["dates"] = [command], [results["date"]]
        variants = [tuple(run["variant"].values()) for run in results["runs"]]
        if not variants or len(set(variants)) != len(variants):
            raise SystemExit(f"--only gpu: {len(variants)} variant runs, {len(set(variants))} distinct: "
                             "give each (compile, AC) variant's result once; docs/benchmarks.md unchanged")
        write_section(GPU_BEGIN, GPU_END, gpu_section(results))
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
