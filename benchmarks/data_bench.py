"""Data pipeline benchmarks (run by ``benchmarks/run.py --only data``).

prepare: ``shardtrain prepare`` against the ``datasets`` library (``load_dataset("json")`` then
``map`` with the same fast tokenizer, batched, ``num_proc`` processes) on the same JSON Lines file,
at the same number of processes, alternating, each from a cold output (datasets' cache is a fresh
directory each time). Tokens/s counts the tokens both produce (checked equal).
wait: the default run's ``data_wait_pct``, the share of the wall time steps waited for batches.
long: one long document (the standard library's .py files as one text) encoded by the ``tokenizers``
library in one piece against shardtrain's pieces, each in a fresh process: peak resident growth and
seconds, the ids checked equal.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent


def write_corpus(path: Path, max_bytes: int) -> int:
    """The standard library's .py files as JSON Lines, one document per file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    written = 0
    with path.open("w") as out:
        for file in sorted(root.rglob("*.py")):
            if "site-packages" in file.parts or written >= max_bytes:
                continue
            text = file.read_text(errors="replace")
            out.write(json.dumps({"text": text}) + "\n")
            written += len(text.encode())
    return written


def time_shardtrain(corpus: Path, tokenizer: Path, workers: int, workdir: Path) -> tuple[float, int]:
    out = workdir / f"prepared-{time.monotonic_ns()}"
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shardtrain", "prepare", str(corpus), "--tokenizer",
                    str(tokenizer), "--workers", str(workers), "--val-percent", "0", "--out", str(out)],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - started
    manifest = json.loads((out / "manifest.json").read_text())
    eos = manifest["tokenizer"]["eos_id"] is not None
    documents = manifest["splits"]["train"]["documents"]
    return seconds, manifest["splits"]["train"]["tokens"] - (documents if eos else 0)


DATASETS_PROGRAM = """
import sys, datasets, transformers
corpus, tokenizer, workers, cache = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
datasets.disable_progress_bars()
fast = transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer)
data = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
ids = data.map(lambda batch: {"ids": fast(batch["text"]).input_ids}, batched=True,
               num_proc=workers if workers > 1 else None, remove_columns=["text"])
print(sum(len(x) for x in ids["ids"]))
"""


def time_datasets(corpus: Path, tokenizer: Path, workers: int, workdir: Path) -> tuple[float, int]:
    cache = workdir / f"hf-cache-{time.monotonic_ns()}"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", DATASETS_PROGRAM, str(corpus), str(tokenizer),
                           str(workers), str(cache)], check=True, capture_output=True, text=True, env=env)
    return time.perf_counter() - started, int(done.stdout.strip().splitlines()[-1])


def prepare_results(workers: list[int], rounds: int = 3, max_bytes: int = 20_000_000) -> dict:
    sys.path.insert(0, str(ROOT / "examples" / "finetune_hf"))
    from make_model import make_llama

    with tempfile.TemporaryDirectory(dir=ROOT) as workdir:
        work = Path(workdir)
        model = make_llama(work / "model", vocab_size=8192)
        corpus = work / "corpus.jsonl"
        corpus_bytes = write_corpus(corpus, max_bytes)
        rows = []
        for n in workers:
            times = {"shardtrain": [], "datasets": []}
            tokens = {}
            for _ in range(rounds):
                for name, fn in (("shardtrain", time_shardtrain), ("datasets", time_datasets)):
                    seconds, count = fn(corpus, model / "tokenizer.json", n, work)
                    times[name].append(seconds)
                    tokens[name] = count
            if tokens["shardtrain"] != tokens["datasets"]:
                raise SystemExit(f"token counts differ: {tokens}")
            median = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"workers": n, "tokens": tokens["shardtrain"], "seconds": median,
                         "tokens_per_s": {k: tokens["shardtrain"] / v for k, v in median.items()},
                         "ratio": median["datasets"] / median["shardtrain"]})
    return {"corpus_bytes": corpus_bytes, "rounds": rounds, "rows": rows}


LONG_DOCUMENT_PROGRAM = """
import hashlib, json, os, sys, threading, time
import numpy as np, tokenizers
from shardtrain.data.tokenizer import HFTokenizer
text_file, tokenizer, mode = sys.argv[1:4]
data = open(text_file, "rb").read()
page = os.sysconf("SC_PAGE_SIZE")
def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * page
baseline, peak, done = resident(), [0], threading.Event()
def watch():  # the resident size's peak above the baseline (ru_maxrss counts the imports' peak)
    while not done.wait(0.005):
        peak[0] = max(peak[0], resident())
watcher = threading.Thread(target=watch)
watcher.start()
started = time.perf_counter()
if mode == "whole":
    ids = tokenizers.Tokenizer.from_file(tokenizer).encode(data.decode()).ids
else:
    ids = HFTokenizer(tokenizer).encode_documents([data])[0]
seconds = time.perf_counter() - started
done.set()
watcher.join()
digest = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()
print(json.dumps({"seconds": seconds, "peak_growth_bytes": max(peak[0], resident()) - baseline,
                  "tokens": len(ids), "sha256": digest}))
"""


def long_document_results(max_bytes: int = 20_000_000) -> dict:
    """One long document encoded whole (the ``tokenizers`` library's encode) and by shardtrain (in
    pieces where the tokenizer allows), each in a fresh process."""
    sys.path.insert(0, str(ROOT / "examples" / "finetune_hf"))
    from make_model import make_llama

    with tempfile.TemporaryDirectory(dir=ROOT) as workdir:
        work = Path(workdir)
        model = make_llama(work / "model", vocab_size=8192)
        corpus = work / "corpus.jsonl"
        write_corpus(corpus, max_bytes)
        text_file = work / "one-document.txt"
        text_file.write_text("".join(json.loads(line)["text"] for line in corpus.open()))
        runs = {}
        for mode in ("whole", "pieces"):
            done = subprocess.run([sys.executable, "-c", LONG_DOCUMENT_PROGRAM, str(text_file),
                                   str(model / "tokenizer.json"), mode],
                                  check=True, capture_output=True, text=True)
            runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        if runs["whole"]["sha256"] != runs["pieces"]["sha256"]:
            raise SystemExit("a long document's ids differ encoded in pieces")
        return {"bytes": text_file.stat().st_size, **runs}


def wait_results(steps: int = 100) -> dict:
    with tempfile.TemporaryDirectory(dir=ROOT) as run_dir:
        subprocess.run([sys.executable, "-m", "shardtrain", "train", f"trainer.max_steps={steps}",
                        "trainer.progress_bar=false", "trainer.sample_tokens=0", "run.trackers=[]",
                        "checkpoint.enabled=false", f"run.dir={run_dir}"], check=True, capture_output=True)
        records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").open()]
    train = [r for r in records if r["kind"] == "train"]
    return {"steps": steps, "records": len(train),
            "data_wait_pct": [r["data_wait_pct"] for r in train],
            "data_wait_ms": [r["data_wait_ms"] for r in train]}
