"""Prepared datasets written directly (for sizes too large to tokenize in a test), and the spawned
processes that train on them."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from shardtrain.config.schema import Config
from shardtrain.data.prepare import FORMAT, MANIFEST, VERSION
from shardtrain.diagnostics.memory import rss_bytes

CHUNK = 1 << 24  # tokens written at a time


def write_prepared(directory: Path, train_tokens: int, val_tokens: int = 100_000,
                   document_tokens: int = 4096) -> Path:
    """A byte-tokenizer prepared dataset of the given sizes (one shard per split; documents of
    ``document_tokens``), written chunk by chunk without holding it in memory."""
    splits = {}
    for split, count in (("train", train_tokens), ("val", val_tokens)):
        (directory / split).mkdir(parents=True, exist_ok=True)
        tokens = np.lib.format.open_memmap(directory / split / "tokens-00000.npy", mode="w+",
                                           dtype=np.uint16, shape=(count,))
        rng = np.random.default_rng(len(split))
        for start in range(0, count, CHUNK):
            end = min(count, start + CHUNK)
            tokens[start:end] = rng.integers(0, 256, end - start, dtype=np.uint16)
        tokens.flush()
        del tokens
        starts = np.arange(0, count, document_tokens, dtype=np.int64)
        np.save(directory / split / "docs-00000.npy", starts)
        splits[split] = {"documents": len(starts), "tokens": count, "shards": [
            {"tokens_file": f"{split}/tokens-00000.npy", "docs_file": f"{split}/docs-00000.npy",
             "tokens": count, "documents": len(starts)}]}
    manifest = {"format": FORMAT, "version": VERSION, "fingerprint": "synthetic",
                "tokenizer": {"name": "bytes", "vocab_size": 256, "eos_id": None}, "dtype": "uint16",
                "options": {"inputs": ["synthetic"]}, "sources": [], "splits": splits}
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return directory


def resident_after_steps(dataset: str, steps: int, out: str) -> None:
    """Train ``steps`` steps of the tiny model on ``dataset``; write the resident set size."""
    from shardtrain.train.loop import Trainer

    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                    max_seq_len=128)
    cfg.data = dataclasses.replace(cfg.data, source="prepared", paths=[dataset])
    cfg.trainer = dataclasses.replace(cfg.trainer, max_steps=steps, micro_batch_size=8, seq_len=128,
                                      eval_every=0, eval_samples=16, sample_tokens=0,
                                      progress_bar=False, log_every=1000)
    cfg.run = dataclasses.replace(cfg.run, dir=str(Path(out) / "run"), tensorboard=False)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, enabled=False)
    cfg.diagnostics = dataclasses.replace(cfg.diagnostics, enabled=False)
    trainer = Trainer.create(cfg)
    trainer.fit()
    Path(out, f"rss-{os.path.basename(dataset)}.txt").write_text(str(rss_bytes()))


def consume(dataset: str, run_dir: str, max_steps: int, accum: int, out: str) -> None:
    """Train (resuming from ``run_dir`` if it has a checkpoint) to ``max_steps`` and record, per
    step, the sample ids this rank's micro-batches hold."""
    from shardtrain.train.loop import Trainer

    world = int(os.environ["WORLD_SIZE"])
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                    max_seq_len=64)
    cfg.data = dataclasses.replace(cfg.data, source="prepared", paths=[dataset])
    cfg.trainer = dataclasses.replace(cfg.trainer, max_steps=max_steps, grad_accum_steps=accum,
                                      micro_batch_size=8 // (world * accum), seq_len=32, eval_every=0,
                                      eval_samples=8, sample_tokens=0, progress_bar=False)
    cfg.run = dataclasses.replace(cfg.run, dir=run_dir, tensorboard=False)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, interval=0)
    cfg.diagnostics = dataclasses.replace(cfg.diagnostics, enabled=False)
    trainer = Trainer.create(cfg)
    data, seen = trainer.train_data, []
    take = data.next_step

    def recording_next_step():
        micro = data.layout.rank_slices(data.step_ids(), data.rank)
        seen.append([trainer.step + 1, [ids.tolist() for ids in micro]])
        return take()

    data.next_step = recording_next_step
    trainer.fit()
    Path(out, f"seen-{world}-{trainer.env.rank}.json").write_text(json.dumps(seen))
