"""Prepared datasets written directly (for sizes too large to tokenize in a test), and the spawned
processes that train on them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

from shardtrain.config.schema import Config, DataConfig
from shardtrain.data import corpus
from shardtrain.data.corpus import load_corpus
from shardtrain.data.prepare import FORMAT, MANIFEST, VERSION
from shardtrain.errors import DataError

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
    cfg.run = dataclasses.replace(cfg.run, dir=str(Path(out) / "run"), trackers=[])
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, enabled=False)
    cfg.diagnostics = dataclasses.replace(cfg.diagnostics, enabled=False)
    trainer = Trainer.create(cfg)
    trainer.fit()
    Path(out, f"rss-{os.path.basename(dataset)}.txt").write_text(str(anonymous_resident_bytes()))


def anonymous_resident_bytes() -> int:
    """Resident memory that is this process's own (heap, arrays), not page-cache pages of mapped
    files: the kernel may map a file's cached pages in large folios (up to 2 MiB per touched page),
    so mapped-file residency varies with the page cache's history, not with what the process holds.
    Storing the sample order or copying tokens would show here."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^RssAnon:\s+(\d+) kB$", status, re.M).group(1)) * 1024


# This process's directory reads under ``root``: each walk of an input tree reads every directory.
walks = {"root": "", "reads": 0}


def count_walks(event: str, args: tuple) -> None:
    if event == "os.scandir" and walks["root"] and str(args[0]).startswith(walks["root"]):
        walks["reads"] += 1


def check_one_rank_walks(inputs: str, out: str) -> None:
    """Every rank asks for the same cached corpus at once (issue 23, finding 14). On a cache all
    ranks share, only rank 0 reads the inputs' directories; with a cache per node (simulated: ranks
    0-1 and 2-3 given different cache directories) one rank per cache does, and so with a cache per
    rank (each preparing its own inside the same polling as the others' waits). Every rank reads the
    same tokens, and an input error found by the preparing rank is every rank's error."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sys.addaudithook(count_walks)
    checked = []  # the shard files' check of a cached copy: the first rank of a host's (review)
    check_files = corpus.damaged_files
    corpus.damaged_files = lambda *args: checked.append(1) or check_files(*args)
    walks["root"] = str(Path(inputs).resolve())
    for case, caches in (("shared", ["cache-shared"] * world),
                         ("per node", [f"cache-node{r * 2 // world}" for r in range(world)]),
                         ("per rank", [f"cache-rank{r}" for r in range(world)])):
        walks["reads"] = 0
        cfg = DataConfig(source="files", paths=[inputs], file_glob="*.txt", val_percent=0.0,
                         cache_dir=str(Path(out) / caches[rank]))
        tokens = np.asarray(load_corpus(cfg, need=("train",)).train)
        seen: list = [None] * world
        dist.all_gather_object(seen, (walks["reads"], hashlib.sha256(tokens.tobytes()).hexdigest()))
        reads = [count for count, _ in seen]
        first_of_cache = [caches.index(cache) == r for r, cache in enumerate(caches)]
        assert [count > 0 for count in reads] == first_of_cache, (case, reads)
        assert len({digest for _, digest in seen}) == 1, case
        if case == "shared":  # one host's ranks (LOCAL_RANK their rank): rank 0 prepared, none checks
            assert not checked, (rank, checked)
    corpus.damaged_files = check_files
    walks["root"] = ""
    # Bad inputs found by the preparing rank stop every rank with its line (none waits forever).
    message = "no error"
    try:
        load_corpus(DataConfig(source="files", paths=[inputs], file_glob="*.none",
                               cache_dir=str(Path(out) / "cache-shared")))
    except DataError as exc:
        message = str(exc)
    lines: list = [None] * world
    dist.all_gather_object(lines, message)
    assert len(set(lines)) == 1 and "has no files matching '*.none'" in lines[0], lines


def consume(dataset: str, run_dir: str, max_steps: int, accum: int, out: str) -> None:
    """Train (resuming from ``run_dir`` if it has a checkpoint) to ``max_steps`` and record, per
    step, the sample ids this rank's micro-batches hold and the rows they return. At 4 processes,
    first check that one rank prepares a cached corpus for all (``check_one_rank_walks``, on text
    files of its own)."""
    from shardtrain.train.loop import Trainer

    world = int(os.environ["WORLD_SIZE"])
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                    max_seq_len=64)
    cfg.data = dataclasses.replace(cfg.data, source="prepared", paths=[dataset])
    cfg.trainer = dataclasses.replace(cfg.trainer, max_steps=max_steps, grad_accum_steps=accum,
                                      micro_batch_size=8 // (world * accum), seq_len=32, eval_every=0,
                                      eval_samples=8, sample_tokens=0, progress_bar=False)
    cfg.run = dataclasses.replace(cfg.run, dir=run_dir, trackers=[])
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, interval=0)
    cfg.diagnostics = dataclasses.replace(cfg.diagnostics, enabled=False)
    trainer = Trainer.create(cfg)
    if world == 4:
        # Text files of their own (the dataset's shards, binary, are refused as text inputs).
        texts = Path(out) / "walk-inputs"
        if int(os.environ["RANK"]) == 0:
            texts.mkdir(exist_ok=True)
            for i in range(6):
                (texts / f"{i}.txt").write_text(f"document {i}: some words to tokenize\n" * 40)
        dist.barrier()
        check_one_rank_walks(str(texts), out)
    data, seen = trainer.train_data, []
    take = data.next_step

    def recording_next_step():
        micro = data.layout.rank_slices(data.step_ids(), data.rank)
        batches = take()
        # What the batches hold too, not only the ids the position says they should.
        seen.append([trainer.step + 1, [ids.tolist() for ids in micro],
                     [[batch.inputs.tolist(), batch.targets.tolist()] for batch in batches]])
        return batches

    data.next_step = recording_next_step
    trainer.fit()
    Path(out, f"seen-{world}-{trainer.env.rank}.json").write_text(json.dumps(seen))
