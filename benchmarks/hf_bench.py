"""Hugging Face models (``model=hf``): loading a 0.5B model rank by rank, and training speed of an HF
Llama against the built-in Llama of the same shape. Run by ``benchmarks/run.py --only hf``; the
workers below run under torchrun and rank 0 prints one JSON line.

    python benchmarks/hf_bench.py load MODEL_DIR              # under torchrun: build + load, per rank
    python benchmarks/hf_bench.py throughput HF_DIR [k=v ...] # under torchrun: HF vs built-in steps
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from step_time import shared_run_dir

from shardtrain.checkpoint.preemption import PreemptionFlag
from shardtrain.checkpoint.weights import load_hf_model_into
from shardtrain.config.loader import load_config
from shardtrain.config.plan import resolve_plan
from shardtrain.diagnostics.memory import rss_bytes
from shardtrain.distributed.env import build_mesh, destroy_distributed, init_distributed
from shardtrain.distributed.sharded_model import build_sharded_model
from shardtrain.models.llama import ffn_hidden_dim
from shardtrain.models.registry import model_factory
from shardtrain.train.loop import Trainer

# Qwen2.5-0.5B's shape (494M parameters, tied embeddings, a 151,936 x 896 embedding), saved in bf16
# as it is published.
HALF_B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
              tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)
# The built-in Llama preset the throughput comparison mirrors (byte tokens).
SHAPE = ["model.vocab_size=256", "model.dim=384", "model.n_layers=6", "model.n_heads=6",
         "model.n_kv_heads=2", "model.max_seq_len=1024"]


def make_half_b(directory: Path) -> Path:
    config = transformers.Qwen2Config(**HALF_B)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def make_same_shape(directory: Path) -> Path:
    """A transformers Llama shaped like SHAPE (weights random: only speed is compared)."""
    cfg = load_config(SHAPE).model
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=ffn_hidden_dim(cfg),
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def teardown() -> None:
    """shardtrain's teardown (cached meshes first), then free what held the groups: gloo threads
    alive when the interpreter finalises abort the process."""
    destroy_distributed()
    gc.collect()


def peak_rss_since_reset() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def load(model_dir: str) -> None:
    """Build the sharded model on meta and materialise it, then read the directory's weights: the
    seconds of each, the rank's shard, and its peak resident growth over both, per rank."""
    cfg = load_config(["model=hf", f"model.path={model_dir}", "model.tokenizer=bytes"])
    env = init_distributed()
    plan = resolve_plan(cfg.strategy, env.world_size, env.local_world_size)
    before = rss_bytes()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set
    start = time.perf_counter()
    model, _ = build_sharded_model(cfg, env, plan, build_mesh(plan, env.device.type),
                                   model_factory(cfg.model))
    dist.barrier()
    built = time.perf_counter()
    load_hf_model_into(model, model_dir)
    dist.barrier()
    loaded = time.perf_counter()
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    row = torch.tensor([built - start, loaded - built, peak_rss_since_reset() - before, shard],
                       dtype=torch.float64)
    rows = [torch.empty_like(row) for _ in range(env.world_size)]
    dist.all_gather(rows, row)
    if env.rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"world_size": env.world_size, "params": params,
                          "ranks": [r.tolist() for r in rows]}))
    del model
    teardown()


def throughput(hf_dir: str, overrides: list[str]) -> None:
    """The built-in Llama and the same shape through transformers, trained in the same processes on
    the same byte data, alternating rounds of whole loop iterations."""
    common = ["trainer.max_steps=10000", "trainer.eval_every=0", "trainer.log_every=1000000",
              "trainer.sample_tokens=0", "trainer.progress_bar=false", "run.trackers=[]",
              "checkpoint.enabled=false", "diagnostics.enabled=false", *overrides]
    builtin = Trainer.create(load_config([*SHAPE, *common, f"run.dir={shared_run_dir('builtin')}"]))
    hf = Trainer.create(load_config(["model=hf", f"model.path={hf_dir}", "model.tokenizer=bytes",
                                     *common, f"run.dir={shared_run_dir('hf')}"]))
    for trainer in (builtin, hf):
        trainer.preemption = PreemptionFlag(trainer.cfg.checkpoint.preemption_signals)
    rounds, steps_per_round, warmup = 6, 5, 3
    for _ in range(warmup):
        builtin.iteration()
        hf.iteration()
    times = {"builtin": [], "hf": []}
    for _ in range(rounds):
        for name, trainer in (("builtin", builtin), ("hf", hf)):
            dist.barrier()
            for _ in range(steps_per_round):
                start = time.perf_counter()
                trainer.iteration()
                times[name].append(time.perf_counter() - start)
    medians = {k: statistics.median(v) for k, v in times.items()}
    tokens = builtin.layout.global_batch * builtin.cfg.trainer.seq_len
    if dist.get_rank() == 0:
        print(json.dumps({
            "world_size": dist.get_world_size(), "tokens_per_step": tokens,
            "params": {k: sum(p.numel() for p in t.model.parameters()) for k, t in
                       (("builtin", builtin), ("hf", hf))},
            "step_s": medians, "tokens_per_s": {k: tokens / v for k, v in medians.items()},
            "ratio": medians["builtin"] / medians["hf"], "steps_timed": len(times["hf"]),
            "precision": builtin.cfg.strategy.mixed_precision,
        }))
    del builtin, hf
    teardown()


if __name__ == "__main__":
    if sys.argv[1] == "load":
        load(sys.argv[2])
    elif sys.argv[1] == "throughput":
        throughput(sys.argv[2], sys.argv[3:])
    else:
        raise SystemExit(__doc__)
