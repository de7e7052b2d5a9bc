"""Data pipeline benchmarks (run by ``benchmarks/run.py --only data``).

prepare: ``shardtrain prepare`` against the ``datasets`` library (``load_dataset("json")`` then
``map`` with the same fast tokenizer, batched, ``num_proc`` processes) on the same JSON Lines file,
at the same number of processes, alternating, each from a cold output (datasets' cache is a fresh
directory each time). Tokens/s counts the tokens both produce (checked equal).
wait: the default run's ``data_wait_pct``, the share of the wall time steps waited for batches.
long: one long document (the standard library's .py files as one text) through ``shardtrain prepare``
(which encodes it in pieces), the same command with the cut turned off, and the ``tokenizers``
library's encode of the whole text, each in a fresh process: seconds and the peak resident size of
the command and its workers, the ids checked equal.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

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


LIBRARY_WHOLE_PROGRAM = """
import hashlib, sys
import numpy as np, tokenizers
text_file, tokenizer = sys.argv[1:3]
ids = tokenizers.Tokenizer.from_file(tokenizer).encode(open(text_file, encoding="utf-8").read()).ids
print(hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest(), len(ids))
"""

# `shardtrain prepare` as a user runs it, with the cut of long documents turned off: the piece size
# raised past any document (one process: workers=1 encodes in the command's own process).
PREPARE_UNCUT_PROGRAM = """
import runpy, sys
import shardtrain.data.tokenizer
shardtrain.data.tokenizer.PIECE_CHARS = sys.maxsize
sys.argv = ["shardtrain", *sys.argv[1:]]
runpy.run_module("shardtrain", run_name="__main__")
"""


def peak_tree_resident(command: list[str]) -> tuple[float, int, str]:
    """Seconds, the peak of the summed resident size of ``command``'s process and its children
    (prepare's worker processes), sampled every 5 ms, and its standard output; fails if the command
    does."""
    # Files, not pipes: a pipe nobody reads until the end would stop a talkative command.
    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
        started = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out_file, stderr=err_file, text=True)
        root, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree))
            except psutil.NoSuchProcess:  # one ended between the listing and the reading
                pass
            time.sleep(0.005)
        seconds = time.perf_counter() - started
        out_file.seek(0)
        err_file.seek(0)
        out, err = out_file.read(), err_file.read()
    if proc.returncode:
        raise SystemExit(f"{' '.join(command[:4])} ... failed ({proc.returncode}): {err[-2000:]}")
    return seconds, peak, out


def prepared_ids(out: Path) -> tuple[str, int]:
    """The sha256 of a prepared one-document dataset's ids as int64 (its end-of-text token left
    out, as the library's encode has none) and their count."""
    manifest = json.loads((out / "manifest.json").read_text())
    ids = np.concatenate([np.load(out / shard["tokens_file"]).astype(np.int64)
                          for shard in manifest["splits"]["train"]["shards"]])
    if manifest["tokenizer"]["eos_id"] is not None:
        ids = ids[:-1]
    return hashlib.sha256(ids.tobytes()).hexdigest(), len(ids)


def long_document_results(max_bytes: int = 20_000_000) -> dict:
    """One long document through ``shardtrain prepare`` (which cuts it in pieces where the tokenizer
    allows), the same command with the cut turned off, and the ``tokenizers`` library's encode of
    the whole text, each in a fresh process: seconds and peak resident size, the ids checked equal."""
    sys.path.insert(0, str(ROOT / "examples" / "finetune_hf"))
    from make_model import make_llama

    with tempfile.TemporaryDirectory(dir=ROOT) as workdir:
        work = Path(workdir)
        model = make_llama(work / "model", vocab_size=8192)
        tokenizer = str(model / "tokenizer.json")
        corpus = work / "corpus.jsonl"
        write_corpus(corpus, max_bytes)
        text_file = work / "one-document.txt"
        text_file.write_text("".join(json.loads(line)["text"] for line in corpus.open()))
        prepare = ["prepare", str(text_file), "--tokenizer", tokenizer, "--val-percent", "0"]
        commands = {
            "prepare": [sys.executable, "-m", "shardtrain", *prepare, "--workers", "1",
                        "--out", str(work / "cut")],
            "prepare_2_workers": [sys.executable, "-m", "shardtrain", *prepare, "--workers", "2",
                                  "--out", str(work / "cut-2")],
            "prepare_uncut": [sys.executable, "-c", PREPARE_UNCUT_PROGRAM, *prepare, "--workers", "1",
                              "--out", str(work / "uncut")],
            "library_whole": [sys.executable, "-c", LIBRARY_WHOLE_PROGRAM, str(text_file), tokenizer],
        }
        runs = {}
        for name, command in commands.items():
            seconds, peak, done_output = peak_tree_resident(command)
            runs[name] = {"seconds": seconds, "peak_resident_bytes": peak}
            if name == "library_whole":
                digest, count = done_output.split()
                ids = {name: (digest, int(count))}
        ids.update((name, prepared_ids(work / out)) for name, out in
                   (("prepare", "cut"), ("prepare_2_workers", "cut-2"), ("prepare_uncut", "uncut")))
        if len(set(ids.values())) != 1:
            raise SystemExit(f"a long document's ids differ: {ids}")
        return {"bytes": text_file.stat().st_size, "tokens": ids["prepare"][1], **runs}


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
