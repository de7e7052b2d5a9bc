"""QLoRA against LoRA on one GPU (started by ``benchmarks/run.py --only qlora`` under torchrun).

One process builds shardtrain's ``Trainer`` exactly as ``shardtrain train`` does, for the 1.1B Llama
(``model=llama_1b``) with ``finetune=<variant>`` (lora | qlora), bf16-mixed (fp32 storage: the
base's weights in fp32 under LoRA, quantised from fp32 to NF4 under QLoRA), and reports: the bytes
this rank holds of the base's linear weights and of every parameter, the allocator's peak over
steady-state steps (``torch.cuda.max_memory_allocated``), tokens/s, and the losses. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from shardtrain.checkpoint.preemption import PreemptionFlag
from shardtrain.config.loader import load_config
from shardtrain.diagnostics.memory import state_bytes
from shardtrain.distributed.qlora import quantized_linears
from shardtrain.models.lora import local_bytes
from shardtrain.train.loop import Trainer

QUIET = ["trainer.max_steps=100000", "trainer.eval_every=0", "trainer.log_every=1000000",
         "trainer.sample_tokens=0", "trainer.progress_bar=false", "run.trackers=[]",
         "checkpoint.enabled=false"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("variant", choices=["lora", "qlora"])
    parser.add_argument("--model", default="llama_1b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--ac", action="store_true", help="activation checkpointing on every block")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/qlora_bench.py needs a CUDA GPU (NF4 on a CPU dequantises every "
                         "weight in each matmul: it runs, but its timings say nothing)")
    overrides = [*QUIET, f"run.dir={tempfile.mkdtemp()}", f"model={args.model}", f"finetune={args.variant}",
                 f"trainer.seq_len={args.seq_len}", f"trainer.micro_batch_size={args.micro_batch}",
                 "strategy.mixed_precision=bf16-mixed",
                 f"strategy.activation_checkpointing={'all' if args.ac else 'none'}"]
    trainer = Trainer.create(load_config(overrides))
    trainer.preemption = PreemptionFlag(trainer.cfg.checkpoint.preemption_signals)
    device = trainer.env.device
    base = sum(local_bytes(module.weight) for _, module in quantized_linears(trainer.model))
    held = state_bytes(trainer.model, trainer.built.optimizer)
    for _ in range(args.warmup):
        trainer.iteration()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        trainer.iteration()
        torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    tokens = trainer.layout.global_batch * trainer.cfg.trainer.seq_len
    held = state_bytes(trainer.model, trainer.built.optimizer)
    print(json.dumps({
        "variant": args.variant, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "model": args.model, "seq_len": args.seq_len, "micro_batch": args.micro_batch, "ac": args.ac,
        "base_linear_mib": base / 2**20, "params_mib": held.params / 2**20, "grads_mib": held.grads / 2**20,
        "optimizer_mib": held.optimizer / 2**20,
        "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20,
        "tokens_per_s": tokens / statistics.median(seconds), "losses": trainer.result.losses}), flush=True)


if __name__ == "__main__":
    main()
