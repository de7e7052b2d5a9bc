"""One program of the ablation benchmark (benchmarks/run.py --only ablation), one rank of it under torchrun.

``python -m torch.distributed.run --nproc-per-node N benchmarks/ablation.py MODEL PROGRAM [key=value ...]``

MODEL: ``default`` (shardtrain's default Llama, sequence 256, global batch 16) or ``vocab`` (dim 512, 8
layers, vocabulary 32,000, sequence 512, global batch 4: the output head is half the parameters and the
logits the largest activation). PROGRAM: ``shardtrain`` (its training loop's iteration, ``Trainer.
iteration``, with its defaults and the ``key=value`` overrides: one feature on or off),
``handwritten`` (the FSDP2 tutorial's loop: shard blocks then root, ``torch.optim.AdamW`` as
constructed by default, the full-logits loss, ``clip_grad_norm_``), ``paired`` (the first two with
shardtrain's defaults in the same processes, alternating: tokens/s only) or ``lightning`` (Lightning's
``ModelParallelStrategy``, FSDP2, with ``configure_model``). All three train the same Llama class (the
latter two with plain autograd's norms and SwiGLU, ``lean_layers=False``) on windows of the same corpus
at fp32 (the CPU's default precision; ``PRECISION=bf16-mixed`` in the environment for bf16-mixed,
applied to all three alike).

Each program runs ``WARMUP`` iterations, then resets the kernel's peak resident size (``clear_refs``)
and times ``STEPS`` more. Rank 0 prints one JSON line: the median seconds of an iteration, and the
largest rank's peak resident memory during the timed iterations (weights, optimizer state and
everything a step allocates; run under ``MALLOC_MMAP_THRESHOLD_`` so that freed tensors leave the
resident set at once), and the largest rank's step memory: that peak less the resident size just
before the timed iterations (the interpreter, torch, the weights and the optimizer state, which
every program holds alike), what a step allocates.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from e2e_programs import Windows, shard
from step_time import benchmark_config
from torch.distributed.device_mesh import init_device_mesh

from shardtrain.checkpoint.preemption import PreemptionFlag
from shardtrain.config.schema import DataConfig, ModelConfig
from shardtrain.data.corpus import load_corpus
from shardtrain.models.llama import Llama
from shardtrain.train.loop import Trainer

# name -> (model config overrides, sequence length, global batch in sequences)
MODELS = {
    "default": ({}, 256, 16),
    "vocab": ({"vocab_size": 32000, "dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4,
               "max_seq_len": 512}, 512, 4),
}
WARMUP, STEPS = int(os.environ.get("WARMUP", 2)), int(os.environ.get("STEPS", 4))
PRECISION = os.environ.get("PRECISION", "fp32")
LR = 3e-3


def status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


class Clock:
    """Iteration times after the warm-up, the peak resident size over them, and how far above the
    resident size before them (the process, weights and optimizer state) that peak is."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.resident_mib = 0.0

    def start_peak(self) -> None:
        self.resident_mib = status_mib("VmRSS")
        reset_peak()

    def measure(self, iteration) -> None:
        for _ in range(WARMUP):
            iteration()
        self.start_peak()
        for _ in range(STEPS):
            start = time.perf_counter()
            iteration()
            self.seconds.append(time.perf_counter() - start)

    def result(self) -> dict:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, (status_mib("VmHWM"), self.resident_mib))
        return {"step_s": statistics.median(self.seconds), "peak_mib": max(peak for peak, _ in ranks),
                "step_mib": max(peak - resident for peak, resident in ranks)}


def model_config(model: str) -> ModelConfig:
    """The hand-written loop's and Lightning's model: plain autograd's norms and SwiGLU, as a model
    of one's own has them (shardtrain's lean layers are one of its features)."""
    return ModelConfig(**MODELS[model][0], lean_layers=False)


def shardtrain_iteration(model: str, overrides: list[str]) -> Callable[[], None]:
    """shardtrain's training-loop iteration (``Trainer.iteration``) with its defaults and ``overrides``."""
    shape, seq_len, global_batch = MODELS[model]
    # A tensor-parallel group is one data-parallel rank (benchmarks/run.py --only tp).
    tp = next((int(o.split("=")[1]) for o in overrides if o.startswith("strategy.tensor_parallel=")), 1)
    world = int(os.environ["WORLD_SIZE"]) // tp
    cfg = benchmark_config([*(f"model.{k}={v}" for k, v in shape.items()), f"trainer.seq_len={seq_len}",
                            f"trainer.micro_batch_size={global_batch // world}",
                            f"strategy.mixed_precision={PRECISION}", f"trainer.lr={LR}", *overrides])
    trainer = Trainer.create(cfg)
    trainer.preemption = PreemptionFlag(cfg.checkpoint.preemption_signals)
    return trainer.iteration


def run_shardtrain(model: str, overrides: list[str]) -> dict:
    clock = Clock()
    clock.measure(shardtrain_iteration(model, overrides))
    return clock.result()


def handwritten_iteration(model: str, iterations: int) -> Callable[[], None]:
    """One iteration of the hand-written loop, on the next of ``iterations`` global batches."""
    shape, seq_len, global_batch = MODELS[model]
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = shard(Llama(model_config(model)), init_device_mesh("cpu", (world,)), PRECISION)
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    data = Windows(load_corpus(DataConfig()).train, iterations * global_batch, seq_len=seq_len)
    per_rank = global_batch // world
    step = 0

    def iteration() -> None:
        nonlocal step
        first = step * global_batch + rank * per_rank
        x, y = (torch.stack(t) for t in zip(*(data[i] for i in range(first, first + per_rank))))
        loss = F.cross_entropy(net(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # like any loop that logs its loss
        step += 1

    return iteration


def run_handwritten(model: str) -> dict:
    clock = Clock()
    clock.measure(handwritten_iteration(model, WARMUP + STEPS))
    return clock.result()


def run_paired(model: str) -> dict:
    """shardtrain's defaults and the hand-written loop in the same processes, alternating ``ROUNDS``
    rounds of ``STEPS`` iterations each after ``WARMUP`` of each: a load on the machine that comes
    and goes hits both alike. Tokens/s from the median iteration of each (no memory: both models are
    resident, so the process's peak is neither's)."""
    rounds = int(os.environ.get("ROUNDS", 4))
    programs = {"shardtrain": shardtrain_iteration(model, []),
                "handwritten": handwritten_iteration(model, WARMUP + rounds * STEPS)}
    for _ in range(WARMUP):
        for iteration in programs.values():
            iteration()
    seconds: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(rounds):
        for name, iteration in programs.items():
            dist.barrier()
            for _ in range(STEPS):
                start = time.perf_counter()
                iteration()
                seconds[name].append(time.perf_counter() - start)
    _, seq_len, global_batch = MODELS[model]
    return {f"{name}_tokens_per_s": seq_len * global_batch / statistics.median(times)
            for name, times in seconds.items()} | {"iterations_timed": rounds * STEPS}


def run_lightning(model: str) -> dict:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    shape, seq_len, global_batch = MODELS[model]
    world = int(os.environ["WORLD_SIZE"])
    clock = Clock()

    class LitLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Llama(model_config(model))

        def configure_model(self) -> None:
            shard(self.model, self.device_mesh["data_parallel"], PRECISION)

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self.model(x).float().flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)

    class Timer(L.Callback):
        """Whole iterations, from one batch's start to the next's: the batch's fetch and collation
        included, as the other programs' iterations include theirs (one more batch ends the last)."""

        def on_train_batch_start(self, trainer, *args) -> None:
            now = time.perf_counter()
            if trainer.global_step == WARMUP:
                clock.start_peak()
            elif trainer.global_step > WARMUP:
                clock.seconds.append(now - self.start)
            self.start = now

    # "32-true" at every PRECISION: shard() gives FSDP2 the mixed-precision policy, as the other
    # programs' models have it; Lightning's bf16-mixed would add autocast on top.
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=WARMUP + STEPS + 1, precision="32-true",
                        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                        gradient_clip_val=1.0, callbacks=[Timer()], enable_checkpointing=False,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=os.environ.get("BENCH_DIR", "."))
    data = Windows(load_corpus(DataConfig()).train, (WARMUP + STEPS + 1) * global_batch, seq_len=seq_len)
    trainer.fit(LitLlama(), torch.utils.data.DataLoader(data, batch_size=global_batch // world))
    return clock.result()


def main() -> None:
    model, program, *overrides = sys.argv[1:]
    if program == "shardtrain":
        result = run_shardtrain(model, overrides)
    elif program == "handwritten":
        result = run_handwritten(model)
    elif program == "paired":
        result = run_paired(model)
    else:
        result = run_lightning(model)
    _, seq_len, global_batch = MODELS[model]
    if "step_s" in result:
        result["tokens_per_s"] = seq_len * global_batch / result["step_s"]
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
