"""``shardtrain prepare``: every input format, the same bytes for any number of workers, nothing to
do on unchanged inputs, and one clear line for each kind of bad data."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
import torch
from cli_utils import clean_env, run_cli
from hf_models import make_model_dir, train_tokenizer
from tokenizers import processors
from tqdm import tqdm

from shardtrain.config.schema import DataConfig
from shardtrain.data.corpus import fingerprint_at, load_corpus, prepared_path, raw_inputs
from shardtrain.data.documents import (
    Source,
    document_of,
    documents,
    is_prepared_dataset,
    is_text_and_fine_tuning,
    list_files,
    resolve_sources,
)
from shardtrain.data.prepare import (
    PrepareOptions,
    Reading,
    appended_tokens,
    batches,
    encode,
    encode_chat,
    locked,
    prepare,
    recorded_sources,
    tokenizer_entry,
)
from shardtrain.data.prepared import open_prepared
from shardtrain.data.tokenizer import (
    SPLIT_PROBES,
    ByteTokenizer,
    HFTokenizer,
    line_pieces,
    piecewise_affixes,
    pre_token_starts_at,
    reads_bytes,
    token_dtype,
)
from shardtrain.errors import DataError

TEXTS = [f"def f{i}():\n    return {i} * 'héllo'  # 日本\n" * (1 + i % 7) for i in range(300)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The same kind of text in every format prepare reads."""
    root = tmp_path_factory.mktemp("inputs")
    text_dir = root / "texts"
    text_dir.mkdir()
    for i, text in enumerate(TEXTS[:40]):
        (text_dir / f"doc{i:03d}.txt").write_text(text)
    with gzip.open(root / "records.jsonl.gz", "wt") as f:
        for i, text in enumerate(TEXTS[40:140]):
            f.write(json.dumps({"id": i, "body": text}) + "\n")
    pq.write_table(pa.table({"body": TEXTS[140:220]}), root / "rows.parquet", row_group_size=30)
    datasets.Dataset.from_dict({"body": TEXTS[220:]}).save_to_disk(str(root / "saved"))
    return root


def all_inputs(root) -> list[str]:
    return [str(root / "texts"), str(root / "records.jsonl.gz"), str(root / "rows.parquet"),
            str(root / "saved")]


def read_split(out, split: str) -> tuple[np.ndarray, np.ndarray]:
    manifest = json.loads((out / "manifest.json").read_text())
    shards = manifest["splits"][split]["shards"]
    tokens = [np.load(out / s["tokens_file"]) for s in shards]
    docs = [np.load(out / s["docs_file"]) for s in shards]
    return np.concatenate(tokens), docs


def test_every_format_is_read_and_workers_do_not_change_a_byte(inputs, tmp_path, monkeypatch):
    model = make_model_dir(tmp_path / "model", "llama")
    # 19 batches: more than the 8 that 4 workers keep in flight, so results are waited for in order.
    monkeypatch.setattr("shardtrain.data.prepare.BATCH_DOCUMENTS", 16)
    common = dict(inputs=all_inputs(inputs), tokenizer=str(model), text_field="body", val_percent=10.0,
                  shard_tokens=4000)  # several shards per split
    one = prepare(PrepareOptions(**common, workers=1), tmp_path / "one", progress=False)
    four = prepare(PrepareOptions(**common, workers=4), tmp_path / "four", progress=False)
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert len(files) > 6 and four.manifest == one.manifest
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "four" / name).read_bytes(), name
    # Batches are cut at BATCH_BYTES of text too (what is in flight stays bounded for huge
    # documents): more, smaller batches, the same bytes.
    monkeypatch.setattr("shardtrain.data.prepare.BATCH_BYTES", 300)
    options = PrepareOptions(**common, workers=2)
    cut = [len(texts) for _, texts, _ in batches(resolve_sources(options.inputs, options.file_glob), options,
                                              tqdm(disable=True), Reading())]
    assert max(cut) < 16 and sum(cut) == len(TEXTS), cut
    prepare(options, tmp_path / "cut", progress=False)
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "cut" / name).read_bytes(), name
    splits = one.manifest["splits"]
    assert splits["train"]["documents"] + splits["val"]["documents"] == len(TEXTS)
    assert len(splits["train"]["shards"]) > 1 and splits["val"]["documents"] > 0

    # Every document, in input order, is its tokens followed by the end-of-text token.
    tokenizer = HFTokenizer(model)
    tokens, docs = read_split(tmp_path / "one", "train")
    first = tokenizer.encode(TEXTS[0]) + [tokenizer.eos_id]
    assert tokens[:len(first)].tolist() == first
    assert one.manifest["tokenizer"]["name"] == tokenizer.name and tokens.dtype == np.uint16
    assert sum(len(d) for d in docs) == splits["train"]["documents"]


def test_bytes_match_the_built_in_corpus_and_unchanged_inputs_do_nothing(tmp_path):
    out = tmp_path / "stdlib"
    done = run_cli("prepare", __import__("sysconfig").get_paths()["stdlib"], "--glob", "*.py",
                    "--max-bytes", "2000000", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "tokens/s" in done.stdout
    corpus = load_corpus(DataConfig(max_bytes=2_000_000))
    assert np.array_equal(read_split(out, "train")[0], corpus.train)
    assert np.array_equal(read_split(out, "val")[0], corpus.val)
    again = run_cli("prepare", __import__("sysconfig").get_paths()["stdlib"], "--glob", "*.py",
                     "--max-bytes", "2000000", "--out", str(out))
    assert again.returncode == 0 and "up to date" in again.stdout


def test_a_changed_input_is_prepared_again(tmp_path):
    (tmp_path / "in").mkdir()
    doc = tmp_path / "in" / "a.txt"
    doc.write_text("one two three " * 50)
    (tmp_path / "in" / "b.txt").write_text("four five " * 50)
    options = PrepareOptions(inputs=[str(tmp_path / "in")], val_percent=0.0)
    assert not prepare(options, tmp_path / "out", progress=False).up_to_date
    assert prepare(options, tmp_path / "out", progress=False).up_to_date
    # A shard lost since: prepared again, where "up to date" left it broken for good (found by review)
    shard = tmp_path / "out" / "train" / "tokens-00000.npy"
    shard.unlink()
    assert not prepare(options, tmp_path / "out", progress=False).up_to_date and shard.is_file()
    # A crash between putting the old dataset aside and the new one in place: the next preparation
    # removes the old one (found by review: left on disk for good)
    (tmp_path / "out").rename(tmp_path / ".out.replaced")
    assert not prepare(options, tmp_path / "out", progress=False).up_to_date
    assert not (tmp_path / ".out.replaced").exists()
    # An output that is a link to a dataset: prepared where it points, the link kept (found by
    # review: the link was put aside, a directory made in its place, and removing the aside failed)
    (tmp_path / "link").symlink_to(tmp_path / "out")
    doc.write_text("one two three " * 60)
    assert not prepare(options, tmp_path / "link", progress=False).up_to_date
    assert (tmp_path / "link").is_symlink() and prepare(options, tmp_path / "out", progress=False).up_to_date
    assert not (tmp_path / ".link.replaced").exists() and not (tmp_path / ".out.replaced").exists()
    # Up to date, nothing is written beside it, not even the lock (a read-only share's dataset)
    lock = tmp_path / ".out.shardtrain-lock"
    lock.unlink()
    assert prepare(options, tmp_path / "out", progress=False).up_to_date and not lock.exists()
    # Another output's lock file is never an input, through a directory or a pattern
    lock.touch()
    with pytest.raises(DataError, match="matches no file"):  # the lock is all the pattern finds
        resolve_sources([str(tmp_path / "*")], "*", [])
    assert [s.name for s in resolve_sources([str(tmp_path / "in" / "*")], "*", [])] == ["a.txt", "b.txt"]
    (tmp_path / "in" / ".old.shardtrain-lock").touch()
    assert [s.name for s in resolve_sources([str(tmp_path / "in" / "*")], "*", [])] == ["a.txt", "b.txt"]
    assert [s.name for s in resolve_sources([str(tmp_path / "in")], "*", [])] == ["a.txt", "b.txt"]
    # A dataset holding what prepare did not write (a run's checkpoints, run.dir having named it) is
    # not replaced: found by the walkthrough, the checkpoints were deleted with the old dataset
    (tmp_path / "out" / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "out" / "config.yaml").write_text("mine")
    doc.write_text("one two three " * 70)
    with pytest.raises(DataError, match=r"out is a prepared dataset that also holds what prepare did not "
                                         r"write \(checkpoints, config.yaml\), which preparing it again"):
        prepare(options, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "checkpoints" / "step-2").is_dir()
    assert (tmp_path / "out" / "config.yaml").read_text() == "mine"
    shutil.rmtree(tmp_path / "out" / "checkpoints")
    (tmp_path / "out" / "config.yaml").unlink()
    # what a file browser leaves is nobody's data: the dataset is prepared again over it
    (tmp_path / "out" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (tmp_path / "out" / "._manifest.json").write_bytes(b"\0\5\26\7")
    assert not prepare(options, tmp_path / "out", progress=False).up_to_date
    assert not (tmp_path / "out" / ".DS_Store").exists()
    # A pattern in a directory part, and ** (found by review: "matches no file"; data.paths has no
    # shell to expand it), named from the last directory before the pattern
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    for name in ("a.txt", "sub/a.txt"):
        (tmp_path / "tree" / name).write_text("six " * 50)
    assert [s.name for s in resolve_sources([str(tmp_path / "t*" / "a.txt")], "*", [])] == ["tree/a.txt"]
    assert [s.name for s in resolve_sources([str(tmp_path / "tree" / "**" / "a.txt")], "*", [])] == [
        "a.txt", "sub/a.txt"]
    (tmp_path / "tree" / "run[1]").mkdir()  # a directory that exists is read as named
    (tmp_path / "tree" / "run[1]" / "x.txt").write_text("seven " * 50)
    (tmp_path / "tree" / "run1").mkdir()
    (tmp_path / "tree" / "run1" / "y.txt").write_text("eight " * 50)
    assert [s.name for s in resolve_sources([str(tmp_path / "tree" / "run[1]" / "*.txt")], "*", [])] == [
        "x.txt"]
    (tmp_path / "in" / ".old.shardtrain-lock").unlink()
    doc.write_text("six seven " * 80)
    os.utime(doc, ns=(doc.stat().st_mtime_ns + 10**9,) * 2)
    result = prepare(options, tmp_path / "out", progress=False)
    assert not result.up_to_date and result.manifest["splits"]["train"]["tokens"] == 800 + 500

    # An output inside its input (prepare's --out, or data.cache_dir under data.paths) is never
    # read back into the next preparation, which would then never be up to date.
    inside = tmp_path / "in" / "prepared"
    assert not prepare(options, inside, progress=False).up_to_date
    again = prepare(options, inside, progress=False)
    assert again.up_to_date and [s["name"] for s in recorded_sources(inside, again.manifest)] == [
        "a.txt", "b.txt"]
    # ... also where a pattern covers it (found by review: the output's shards and manifest were
    # read back, each preparation grew by the previous one's), and a prepared dataset it goes into.
    pattern = PrepareOptions(inputs=[str(tmp_path / "in" / "**" / "*")], file_glob="*")
    assert not prepare(pattern, tmp_path / "in" / "globbed", progress=False).up_to_date
    again = prepare(pattern, tmp_path / "in" / "globbed", progress=False)
    assert again.up_to_date and [s["name"] for s in recorded_sources(tmp_path / "in" / "globbed",
                                                                     again.manifest)] == ["a.txt", "b.txt"]
    shutil.rmtree(tmp_path / "in" / "globbed")
    # What is excluded counts below the pattern's base only (a cache directory above the inputs),
    # and a state.json without Arrow files beside it is no dataset (found by review of the above:
    # "matches no file", and files hidden)
    assert [s.name for s in resolve_sources([str(tmp_path / "in" / "*")], "*", [tmp_path])] == [
        "a.txt", "b.txt"]
    (tmp_path / "in" / "state.json").write_text("{}")
    assert [s.name for s in resolve_sources([str(tmp_path / "in" / "*.txt")], "*", [])] == ["a.txt", "b.txt"]
    (tmp_path / "in" / "state.json").unlink()
    shutil.rmtree(inside)
    cfg = DataConfig(source="files", paths=[str(tmp_path / "in")], file_glob="*",
                     cache_dir=str(tmp_path / "in" / "cache"))
    cached = prepared_path(cfg, ByteTokenizer())
    manifest = json.loads((cached / "manifest.json").read_text())
    assert [s["name"] for s in recorded_sources(cached, manifest)] == ["a.txt", "b.txt"]
    assert prepared_path(cfg, ByteTokenizer()) == cached
    assert not list((tmp_path / "in" / "cache").glob("*.lock"))  # its lock is named as prepare's
    globbed = DataConfig(source="files", paths=[str(tmp_path / "in" / "**" / "*")], file_glob="*",
                         cache_dir=str(tmp_path / "in" / "cache"))
    in_cache = prepared_path(globbed, ByteTokenizer())
    in_cache_manifest = json.loads((in_cache / "manifest.json").read_text())
    assert [s["name"] for s in recorded_sources(in_cache, in_cache_manifest)] == ["a.txt", "b.txt"]
    assert prepared_path(globbed, ByteTokenizer()) == in_cache
    # A cache entry with a shard missing is no rank's to read: prepared again on the next use
    (cached / "train" / "tokens-00000.npy").unlink()
    assert fingerprint_at(cached) is None
    assert prepared_path(cfg, ByteTokenizer()) == cached and fingerprint_at(cached) == manifest["fingerprint"]
    assert json.loads((cached / "manifest.json").read_text()) == manifest
    # ... nor is one written by an earlier preparation to another --out: its shards are token ids,
    # which were tokenized as text. Given as the input itself, it is refused with the way to use it.
    shutil.rmtree(tmp_path / "in" / "cache")
    prepare(options, tmp_path / "in" / "old", progress=False)
    other = prepare(options, tmp_path / "elsewhere", progress=False)
    assert [s["name"] for s in recorded_sources(tmp_path / "elsewhere", other.manifest)] == ["a.txt", "b.txt"]
    with pytest.raises(DataError, match="already a prepared dataset.*data.source=prepared"):
        prepare(PrepareOptions(inputs=[str(tmp_path / "in" / "old")]), tmp_path / "twice", progress=False)


def test_a_damaged_shard_is_prepared_again_and_the_output_is_flushed(tmp_path, caplog, monkeypatch):
    """Found by review: a shard cut short (a full disk, a copy that stopped) kept its name, so
    `prepare` said "up to date" while training said "prepare the dataset again", and the data cache
    reused the broken entry for good. Each file's size is recorded and checked; every file and
    directory is flushed to the disk before the dataset is renamed into place, and the rename after."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("one two three " * 50)
    options = PrepareOptions(inputs=[str(tmp_path / "in")], val_percent=0.0)
    out = tmp_path / "out"
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                 real_fsync(fd))[1])
    made = prepare(options, out, progress=False)
    staging = tmp_path / ".out.preparing"
    assert sorted(synced) == sorted(map(str, [staging / "train" / "tokens-00000.npy",
                                              staging / "train" / "docs-00000.npy", staging / "sources.json",
                                              staging / "manifest.json",
                                              staging / "train", staging, tmp_path]))
    shard = made.manifest["splits"]["train"]["shards"][0]
    whole = (out / "train" / "tokens-00000.npy").stat().st_size
    starts = (out / "train" / "docs-00000.npy").stat().st_size
    assert shard["bytes"] == {"tokens_file": whole, "docs_file": starts}
    os.truncate(out / "train" / "tokens-00000.npy", 100)
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        assert not prepare(options, out, progress=False).up_to_date
    assert (f"{out} is prepared but damaged (train/tokens-00000.npy: 100 of {whole} bytes); preparing it "
            "again") in caplog.text
    assert (out / "train" / "tokens-00000.npy").stat().st_size == whole
    assert open_prepared(out).train[0:3].tolist() == list(b"one")
    # A manifest written before sizes were recorded is checked by name, as then
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["splits"]["train"]["shards"][0]["bytes"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    os.truncate(out / "train" / "tokens-00000.npy", 100)
    assert prepare(options, out, progress=False).up_to_date
    # A manifest cut short is prepared again too, as the reader's "run shardtrain prepare again" says
    # (found by review: refused as not a prepared dataset); beside files of another's, it is refused
    # naming the manifest
    (out / "manifest.json").write_bytes((out / "manifest.json").read_bytes()[:100])
    with pytest.raises(DataError, match="manifest.json cannot be read.*run shardtrain prepare again"):
        is_prepared_dataset(out)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        assert not prepare(options, out, progress=False).up_to_date
    assert f"{out} holds a prepared dataset's shards but no readable manifest.json" in caplog.text
    assert open_prepared(out).train[0:3].tolist() == list(b"one")
    (out / "manifest.json").write_text("{")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match=r"is not a prepared dataset \(its manifest.json cannot be read\); "):
        prepare(options, out, progress=False)
    assert (out / "notes.txt").read_text() == "mine"
    # The data cache: a rank's damaged copy is not the dataset, and the next use prepares it again
    cfg = DataConfig(source="files", paths=[str(tmp_path / "in")], file_glob="*",
                     cache_dir=str(tmp_path / "cache"), val_percent=0.0)
    cached = prepared_path(cfg, ByteTokenizer())
    fingerprint = fingerprint_at(cached)
    os.truncate(cached / "train" / "docs-00000.npy", 10)
    assert fingerprint is not None and fingerprint_at(cached) is None
    assert prepared_path(cfg, ByteTokenizer()) == cached and fingerprint_at(cached) == fingerprint


def test_source_entries_are_beside_the_manifest(tmp_path):
    """Found by review: the manifest held one entry per input file, and every rank parsed it at
    start-up (106 MB for a million files). They are in sources.json; the manifest holds their
    count, and a manifest holding them inline (older) is read, and is up to date, as before."""
    (tmp_path / "in").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "in" / name).write_text(f"{name} " * 50)
    options = PrepareOptions(inputs=[str(tmp_path / "in")], val_percent=0.0)
    out = tmp_path / "out"
    made = prepare(options, out, progress=False).manifest
    size = (out / "sources.json").stat().st_size
    assert made["sources"] == {"file": "sources.json", "count": 2, "bytes": size}
    entries = recorded_sources(out, made)
    assert [e["name"] for e in entries] == ["a.txt", "b.txt"]
    assert set(entries[0]) == {"name", "bytes", "mtime_ns"}
    # Lost or cut short: prepared again, as a shard is
    (out / "sources.json").write_text("[]")
    assert not prepare(options, out, progress=False).up_to_date and recorded_sources(out, made) == entries
    # An older manifest, its entries inline: read, up to date, trained on
    inline = {**made, "sources": entries}
    (out / "manifest.json").write_text(json.dumps(inline))
    (out / "sources.json").unlink()
    assert recorded_sources(out, inline) == entries and prepare(options, out, progress=False).up_to_date
    assert open_prepared(out).train.documents == 2
    with pytest.raises(DataError, match=r"sources.json cannot be read .*; prepare it again"):
        recorded_sources(out, made)


def test_an_output_is_any_path_to_a_directory_to_create(tmp_path, monkeypatch):
    """Found by review: `--out .` (and `..`, `a/..`) raised a traceback (no name to put the staging
    directory beside); `--out /` can be no output, and says so in one line."""
    (tmp_path / "a.txt").write_text("one two three " * 50)
    options = PrepareOptions(inputs=[str(tmp_path / "a.txt")], val_percent=0.0)
    (tmp_path / "here" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "here" / "sub")
    assert not prepare(options, ".", progress=False).up_to_date
    assert (tmp_path / "here" / "sub" / "manifest.json").is_file()
    monkeypatch.chdir(tmp_path / "here" / "sub")  # the directory was replaced: the new one
    assert prepare(options, "../sub", progress=False).up_to_date
    monkeypatch.chdir(tmp_path)
    assert prepare(options, "here/sub/x/..", progress=False).up_to_date
    with pytest.raises(DataError, match=r"^the output / has no name .*; choose a directory to create$"):
        prepare(options, "/", progress=False)


def test_the_same_inputs_however_written_are_up_to_date(tmp_path, monkeypatch):
    """Found by review: inputs and the tokenizer were fingerprinted as typed, so `t/in.jsonl` then
    `./t/in.jsonl` (or `--tokenizer DIR/` then `DIR/tokenizer.json`) tokenized everything again. The
    options recorded stay as typed; a dataset fingerprinted before (recipe 1) is prepared again."""
    from shardtrain.data.prepare import FORMAT, VERSION, output_options

    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel({"alpha": 0, "beta": 1, "[UNK]": 2},
                                                           unk_token="[UNK]"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    save_tokenizer(raw, tmp_path / "tok")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "in.jsonl").write_text('{"text": "alpha beta"}\n{"text": "beta"}\n')
    monkeypatch.chdir(tmp_path)
    first = prepare(PrepareOptions(inputs=["t/in.jsonl"], tokenizer="tok"), "out", progress=False)
    assert not first.up_to_date and first.manifest["options"]["inputs"] == ["t/in.jsonl"]
    for inputs, tokenizer in ((["./t/in.jsonl"], "tok/"),
                              ([str(tmp_path / "t" / "in.jsonl")], "tok/tokenizer.json"),
                              (["t/../t/in.jsonl"], str(tmp_path / "tok"))):
        again = prepare(PrepareOptions(inputs=inputs, tokenizer=tokenizer), "out", progress=False)
        assert again.up_to_date, (inputs, tokenizer)
    assert again.manifest["options"]["inputs"] == ["t/in.jsonl"]  # as typed
    # The fingerprint as it was before recipe 2 (the split's rounding) is prepared again once
    options = PrepareOptions(inputs=["t/in.jsonl"], tokenizer="tok")
    old = {"format": FORMAT, "version": VERSION, "options": output_options(options),
           "tokenizer": first.manifest["tokenizer"],
           "sources": recorded_sources(tmp_path / "out", first.manifest)}
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    manifest["fingerprint"] = hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    assert not prepare(options, "out", progress=False).up_to_date
    assert prepare(options, "out", progress=False).up_to_date


def test_json_files_of_records_are_json_lines(tmp_path, caplog):
    """Found by review: a .json file of JSON Lines (Hugging Face datasets' train.json) was one text
    document, JSON syntax included, and a .json.gz was refused with "decompress it", which led to
    the same. Records by their first line; other .json files stay text (package.json), and so do
    JSON Lines of other fields, said (the diff review: a code corpus's NDJSON fixtures of events
    stopped its preparation as records without a text field)."""
    records = '{"text": "alpha"}\n\n{"text": "beta"}\n'
    (tmp_path / "train.json").write_text("\n" + records)
    (tmp_path / "UPPER.JSON").write_text(records)
    (tmp_path / "train.json.gz").write_bytes(gzip.compress(records.encode()))
    (tmp_path / "chat.json").write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    (tmp_path / "package.json").write_text('{\n  "name": "x",\n  "text": "y"\n}\n')
    (tmp_path / "one.json").write_text('{"name": "x", "version": "1.0"}\n')
    (tmp_path / "list.json").write_text('["a", "b"]\n')
    (tmp_path / "other.json").write_text('{"content": "alpha"}\n{"content": "beta"}\n')
    kinds = {p.name: Source(p, p.name).kind for p in sorted(tmp_path.iterdir())}
    # package.json holds the text field: a record, written with an indent or on one line alike
    assert kinds == {"UPPER.JSON": "jsonl", "chat.json": "jsonl", "list.json": "text", "one.json": "text",
                     "other.json": "text", "package.json": "json objects", "train.json": "jsonl",
                     "train.json.gz": "jsonl"}
    # The text field named decides too, and what is read shows in the fingerprint (not as text)
    assert Source(tmp_path / "one.json", "one.json", text_field="name").kind == "jsonl"
    assert Source(tmp_path / "train.json", "train.json").fingerprint()["read_as"] == "jsonl"
    made = prepare(PrepareOptions(inputs=[str(tmp_path / "train.json.gz")], val_percent=0.0), tmp_path / "gz",
                   progress=False)
    assert made.manifest["splits"]["train"]["documents"] == 2
    # A link named .jsonl to a file named by its hash (a Hugging Face snapshot's): records, by the
    # link's name, for training's data.paths as for prepare (found by review: resolved first, one
    # text document of JSON)
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "9f2c41").write_text(records)
    (tmp_path / "snapshot.jsonl").symlink_to(tmp_path / "blobs" / "9f2c41")
    corpus = load_corpus(DataConfig(source="files", paths=[str(tmp_path / "snapshot.jsonl")], val_percent=0.0,
                                    cache_dir=str(tmp_path / "cache")), need=("train",))
    assert corpus.train_files == 2, corpus
    # the directories above it are resolved as before (a cache key's spelling kept), its name not
    (tmp_path / "linked_dir").symlink_to(tmp_path)
    assert raw_inputs(DataConfig(source="files", paths=[str(tmp_path / "linked_dir" / "snapshot.jsonl")])) \
        == [tmp_path.resolve() / "snapshot.jsonl"]
    assert bytes(read_split(tmp_path / "gz", "train")[0].tolist()) == b"alphabeta"
    # A byte-order mark before the first record (Windows tools write one) is no JSON error (found
    # by the walkthrough: "not valid JSON (Unexpected UTF-8 BOM)"), in .jsonl and .json alike
    (tmp_path / "bom").mkdir()
    (tmp_path / "bom" / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + records.encode())
    (tmp_path / "bom" / "b.json").write_bytes(b"\xef\xbb\xbf" + records.encode())
    prepare(PrepareOptions(inputs=[str(tmp_path / "bom")], val_percent=0.0), tmp_path / "bom_out",
            progress=False)
    assert bytes(read_split(tmp_path / "bom_out", "train")[0].tolist()) == b"alphabetaalphabeta"
    # JSON Lines of another field: text, said once for all such files; with that field named, records
    (tmp_path / "events.json").write_text('{"id": 1}\n{"id": 2}\n')
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        resolve_sources([str(tmp_path / "other.json"), str(tmp_path / "events.json")], "*")
    assert ("data: other.json, events.json: JSON records (lines, or an array) whose first record has no "
            "'text' field, each file read as one text document; to read them as records name their text "
            "field") in caplog.text
    assert Source(tmp_path / "other.json", "other.json", text_field="content").kind == "jsonl"
    # A JSON array of records (Alpaca's alpaca_data.json, to_json(lines=False)): its records, not its
    # JSON text with brackets and quotes (found by a trial), gzipped too; one of other fields is text, said
    (tmp_path / "array").mkdir()
    alpaca = [{"text": "gamma", "instruction": "q"}, {"text": "delta", "instruction": "q"}]
    (tmp_path / "array" / "a.json").write_text(json.dumps(alpaca, indent=2))
    (tmp_path / "array" / "b.json.gz").write_bytes(gzip.compress(json.dumps(
        [{"prompt": "p", "completion": "c"}]).encode()))
    assert {p.name: Source(p, p.name).kind for p in (tmp_path / "array").iterdir()} == {
        "a.json": "json array", "b.json.gz": "json array"}
    assert Source(tmp_path / "array" / "a.json", "a.json").fingerprint()["read_as"] == "json array"
    (tmp_path / "bom" / "array.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(alpaca).encode())
    assert Source(tmp_path / "bom" / "array.json", "array.json").kind == "json array"  # found by review
    (tmp_path / "bom" / "array.json").write_bytes(b"\xef\xbb\xbf\n" + json.dumps(alpaca).encode())
    assert Source(tmp_path / "bom" / "array.json", "array.json").kind == "json array"  # a blank line first
    made = prepare(PrepareOptions(inputs=[str(tmp_path / "array")], val_percent=0.0), tmp_path / "array_out",
                   progress=False)
    assert made.manifest["splits"]["train"]["documents"] == 3
    assert bytes(read_split(tmp_path / "array_out", "train")[0].tolist()).startswith(b"gammadelta")
    (tmp_path / "array" / "c.json").write_text(json.dumps([{"instruction": "q", "output": "a"}]))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        assert Source(tmp_path / "array" / "c.json", "c.json").kind == "text"
        resolve_sources([str(tmp_path / "array" / "c.json")], "*")
    assert "c.json: JSON records (lines, or an array) whose first record has no 'text' field" in caplog.text
    assert Source(tmp_path / "array" / "c.json", "c.json", text_field="output").kind == "json array"
    # A record written with an indent (json.dump(record, f, indent=2), jq .), one or more to a file:
    # its records (found by review: trained on as JSON text, braces and keys included, without a
    # word); such a file of other fields (a package.json) is text, as before
    (tmp_path / "indented").mkdir()
    (tmp_path / "indented" / "one.json").write_text(json.dumps({"id": 1, "text": "epsilon"}, indent=2))
    (tmp_path / "indented" / "two.json").write_text(
        "\n".join(json.dumps({"text": t, "n": [1, 2]}, indent=1) for t in ("zeta", "eta")) + "\n")
    (tmp_path / "indented" / "chat.json").write_text(json.dumps(
        {"prompt": "p", "completion": "c"}, indent="\t"))
    (tmp_path / "indented" / "package.json").write_text(json.dumps({"name": "x"}, indent=2))
    assert {p.name: Source(p, p.name).kind for p in (tmp_path / "indented").iterdir()} == {
        "one.json": "json objects", "two.json": "json objects", "chat.json": "json objects",
        "package.json": "text"}
    read = [list(documents(Source(tmp_path / "indented" / name, name), "text")) for name in ("one.json",
                                                                                            "two.json")]
    assert read == [[("one.json:1", b"epsilon")], [("two.json:1", b"zeta"), ("two.json:2", b"eta")]]
    assert Source(tmp_path / "indented" / "one.json", "one.json").fingerprint()["read_as"] == "json objects"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardtrain"):  # the text beside them: said once
        prepare(PrepareOptions(inputs=[str(tmp_path / "indented")], val_percent=0.0),
                tmp_path / "indented_out", progress=False)
    assert caplog.text.count("holds records (JSON Lines, Parquet or Arrow) and text files") == 1, caplog.text
    assert bytes(read_split(tmp_path / "indented_out", "train")[0].tolist()).startswith(b"pc")  # chat.json
    (tmp_path / "indented" / "two.json").write_text(json.dumps({"text": "zeta"}, indent=1) + "\n{ oops\n")
    with pytest.raises(DataError, match=r"two.json: not a valid JSON object of records, or objects \("):
        list(documents(Source(tmp_path / "indented" / "two.json", "two.json"), "text"))
    (tmp_path / "notes.json.gz").write_bytes(gzip.compress(b'{\n  "a": 1\n}\n'))
    with pytest.raises(DataError, match=r"notes.json.gz: compressed, and not JSON Lines records .* reads a "
                                        r"\.json\.gz as JSON Lines only: name the text field"):
        resolve_sources([str(tmp_path / "notes.json.gz")], "*")


def test_hidden_files_of_a_directory_input_are_skipped(tmp_path, caplog):
    """Found by review: a Hugging Face download directory gave its .gitattributes and
    .cache/huggingface/download/*.lock and *.metadata files as text documents. Hidden files and
    directories below the input are skipped unless the pattern asks for them; text files beside
    records (a README.md) are named in a warning."""
    root = tmp_path / ".hub" / "dataset"  # an input under a hidden directory is read all the same
    for name in ("data/train.jsonl", "README.md", ".gitattributes", ".cache/huggingface/download/data/x.lock",
                 ".cache/huggingface/download/data/train.jsonl.metadata", "data/.keep.txt"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text('{"text": "alpha"}\n' if name.endswith(".jsonl") else name)
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        assert [s.name for s in resolve_sources([str(root)], "*")] == ["README.md", "data/train.jsonl"]
    said = [r.getMessage() for r in caplog.records if "holds records" in r.getMessage()]
    assert len(said) == 1 and "each read as one document: README.md; leave them out with --glob" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        assert [s.name for s in resolve_sources([str(root)], "*.jsonl")] == ["data/train.jsonl"]
    assert "holds records" not in caplog.text
    # A pattern that names hidden files or directories takes them
    assert [p.relative_to(root).as_posix() for p in list_files(root, ".*")] == [
        ".gitattributes", "data/.keep.txt"]
    assert [p.relative_to(root).as_posix() for p in list_files(root, ".cache/**/*.lock")] == [
        ".cache/huggingface/download/data/x.lock"]
    # A glob pattern as the input skips them too (pathlib's ** went into .cache, its * took .keep.txt)
    assert [s.name for s in resolve_sources([f"{root}/**/*"], "*")] == ["README.md", "data/train.jsonl"]
    assert [s.name for s in resolve_sources([f"{root}/data/.*"], "*")] == [".keep.txt"]
    assert [s.name for s in resolve_sources([f"{root}/.cache/**/*.lock"], "*")] == [
        "huggingface/download/data/x.lock"]
    with pytest.raises(DataError, match=r"matches no file but hidden ones \(.*\.keep\.txt\), which are "
                                        "skipped unless the pattern's part starts with '.'"):
        resolve_sources([f"{root}/*/*.txt"], "*")
    # A directory input that gives nothing says what it holds instead, and the fix (found by
    # review: "no files matching '*'" beside a hidden file that matched it)
    (tmp_path / "quiet").mkdir()
    (tmp_path / "quiet" / ".keep.txt").write_text("notes")
    with pytest.raises(DataError, match=r"has no files matching '\*\.py'; it holds README.md and 1 more: "
                                        r"name the files to read with --glob \(data.file_glob"):
        resolve_sources([str(root)], "*.py")
    with pytest.raises(DataError, match=r"matching '\*\.txt' but hidden ones \(\.keep\.txt\), which "
                                        r"are skipped unless the pattern \(--glob, data.file_glob\) starts"):
        resolve_sources([str(tmp_path / "quiet")], "*.txt")


def test_a_file_name_that_is_not_utf8_is_read(tmp_path):
    """Linux names are bytes: Python keeps a non-UTF-8 one as lone surrogates, and the split's hash of
    the document's key refused them with a traceback (found by review). Its bytes are hashed now."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("alpha")
    (tmp_path / "in" / os.fsdecode(b"b\xff.txt")).write_text("beta")
    result = prepare(PrepareOptions(inputs=[str(tmp_path / "in")], val_percent=0), tmp_path / "out",
                     progress=False)
    assert result.manifest["splits"]["train"]["documents"] == 2
    names = [entry["name"] for entry in json.loads((tmp_path / "out" / "sources.json").read_text())]
    assert names == ["a.txt", os.fsdecode(b"b\xff.txt")]


def test_preparations_of_one_output_run_one_after_the_other(tmp_path, caplog):
    """Found by review: two `prepare --out X` at once (one per node of a job) shared X's staging
    directory, each deleting the other's shards, and both said they succeeded. The later one waits
    for the lock beside X, then finds X up to date."""
    caplog.set_level(logging.INFO, logger="shardtrain")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("one two three " * 50)
    options = PrepareOptions(inputs=[str(tmp_path / "in")], val_percent=0.0)
    out = tmp_path / "out"
    results = []
    with locked(tmp_path / ".out.shardtrain-lock"):  # another preparation of out is under way
        waiting = threading.Thread(target=lambda: results.append(prepare(options, out, progress=False)))
        waiting.start()
        waiting.join(timeout=2)
        assert waiting.is_alive() and not out.exists()  # it waits, writing nothing
        prepare(options, out, progress=False, lock=False)  # the one holding the lock
    waiting.join(timeout=60)
    assert not waiting.is_alive() and results[0].up_to_date
    # The wait was said (found by review: silent behind a stopped preparation)
    assert "waiting for another preparation of the same output" in caplog.text


def test_the_tokenizer_entry_covers_what_renders_conversations():
    """A changed chat template (or BOS token) renders fine-tuning conversations to other tokens: the
    preparation's fingerprint covers it (found by review: a stale cache was used)."""
    tokenizer = SimpleNamespace(name="tokenizers:abc", vocab_size=100, eos_id=2, chat_template="{{ a }}",
                                bos_token="<s>", encode=lambda text, special_tokens=True: [5])
    entries = [tokenizer_entry(tokenizer)]
    for change in ({"chat_template": "{{ b }}"}, {"bos_token": "<bos>"}, {"eos_id": 3}):
        entries.append(tokenizer_entry(SimpleNamespace(**{**vars(tokenizer), **change})))
    assert len({json.dumps(entry, sort_keys=True) for entry in entries}) == len(entries)
    assert tokenizer_entry(ByteTokenizer())["chat_template"] is None


def test_inputs_in_every_layout_are_read_as_documented(tmp_path):
    """Text the reader used to refuse or mangle: Parquet's dictionary-encoded and string_view
    columns, a lone surrogate in JSON (replaced, as a text file's invalid bytes are), a file whose
    name holds glob characters, ``--glob '**/*.txt'`` at the top level (as rglob), and a
    ``save_to_disk`` directory inside an input directory (its rows, not its files as text)."""
    def prepared(*inputs, glob="*"):
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        prepare(PrepareOptions(inputs=[str(i) for i in inputs], file_glob=glob, val_percent=0.0), out,
                progress=False)
        return bytes(read_split(out, "train")[0].tolist()).decode()

    kinds = {"dict": pa.array(["ab", "cd", "ab"]).dictionary_encode(),
             "view": pa.array(["ab", "cd", "ab"], type=pa.string_view())}
    for name, column in kinds.items():
        pq.write_table(pa.table({"text": column}), tmp_path / f"{name}.parquet")
        assert prepared(tmp_path / f"{name}.parquet") == "abcdab", name
    # Bytes that are not UTF-8 in a string column (Arrow does not check what other tools wrote):
    # read as a text file's bytes are (found by review: a traceback)
    bad = pa.array([b"ok \xff", b"cd"]).view(pa.string())
    pq.write_table(pa.table({"text": bad}), tmp_path / "bad.parquet")
    prepare(PrepareOptions(inputs=[str(tmp_path / "bad.parquet")], val_percent=0.0), tmp_path / "bad",
            progress=False)
    assert bytes(read_split(tmp_path / "bad", "train")[0].tolist()) == b"ok \xffcd"

    (tmp_path / "odd.jsonl").write_text('{"text": "bad \\ud800!"}\n'
                                        '{"prompt": "p\\udfff", "completion": "c"}\n')
    assert prepared(tmp_path / "odd.jsonl") == "bad \ufffd!p\ufffdc"

    (tmp_path / "data[1].txt").write_text("bracketed")
    assert prepared(tmp_path / "data[1].txt") == "bracketed"

    tree = tmp_path / "tree"
    for name in ("top.txt", ".hidden.txt", "top.md", "sub/mid.txt", "sub/deep/low.txt", "x/sub/y/z.txt"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(name)
    for pattern in ("*", "*.txt", "**/*.txt", "sub/*.txt", "**/sub/**/*.txt", "s*/*/*.txt"):
        found = [p.relative_to(tree) for p in list_files(tree, pattern)]
        # as rglob, but for hidden files (see test_hidden_files_of_a_directory_input_are_skipped)
        assert found == sorted(p.relative_to(tree) for p in tree.rglob(pattern)
                               if p.is_file() and not p.name.startswith(".")), pattern
    assert prepared(tree, glob="**/*.txt") == "sub/deep/low.txtsub/mid.txttop.txtx/sub/y/z.txt"

    datasets.Dataset.from_dict({"text": ["row0", "row1"]}).save_to_disk(str(tree / "x" / "saved"))
    assert prepared(tree, glob="*").endswith("top.mdtop.txtrow0row1x/sub/y/z.txt")


def test_a_dead_worker_is_one_line_not_a_hang(tmp_path):
    """A tokenizing worker killed mid-run (SIGKILL, as for lack of memory) stops prepare with one
    line; multiprocessing.Pool waited forever for its batch. The worker's function is replaced in
    the parent by one that kills its process; spawned workers import it from the script."""
    (tmp_path / "a.txt").write_text("hello " * 100)
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""\
        import os
        import sys

        from shardtrain.cli.main import main
        from shardtrain.data import prepare


        def killed(batch):
            os.kill(os.getpid(), 9)  # what the out-of-memory killer does


        if __name__ == "__main__":
            prepare._encode_in_worker = killed
            sys.exit(main(["prepare", {str(tmp_path / "a.txt")!r}, "--workers", "2",
                           "--out", {str(tmp_path / "out")!r}]))
        """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=clean_env(), stdin=subprocess.DEVNULL)  # a hang fails here
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "a tokenizing worker process died" in lines[0], done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.preparing").exists()


@pytest.mark.parametrize("case", ["empty", "empty_text", "unreadable", "corrupt_deflate", "malformed",
                                  "missing_field", "not_text", "sharegpt_roles", "parquet_column",
                                  "missing_input", "dataset_dict", "not_prepared", "out_is_a_file",
                                  "compressed_text", "not_utf8", "binary", "utf16", "no_targets"])
def test_bad_data_is_one_clear_line(case, tmp_path):
    target = tmp_path / "data.jsonl"
    args = [str(target)]
    if case == "empty":
        target.write_text("\n\n")
        message = "no documents (the input is empty)"
    elif case == "empty_text":
        target = tmp_path / "data.txt"
        target.write_text("")
        args, message = [str(target)], "no text (the input is empty: 1 empty document(s))"
    elif case == "unreadable":
        target = tmp_path / "data.jsonl.gz"
        target.write_bytes(b"\x1f\x8b not really gzip")
        args, message = [str(target)], "cannot be read"
    elif case == "corrupt_deflate":  # zlib.error, which is no OSError
        target = tmp_path / "data.jsonl.gz"
        compressed = bytearray(gzip.compress(b'{"text": "fine"}\n' * 10))
        compressed[10] = 0x07  # the first deflate block's type: 3, which does not exist
        target.write_bytes(compressed)
        args, message = [str(target)], "cannot be read (Error -3 while decompressing data"
    elif case == "malformed":
        target.write_text('{"text": "fine"}\n{"text": "broken\n')
        message = f"{target}:2: not valid JSON"
    elif case == "missing_field":
        target.write_text('{"text": "fine"}\n{"content": "x"}\n')
        message = f"{target}:2: no 'text' field (fields: content)"
    elif case == "not_text":
        target.write_text('{"text": 3}\n')
        message = "field 'text' is int, not text"
    elif case == "sharegpt_roles":  # the roles it found, and ShareGPT's names for the template's
        chat = {"messages": [{"role": "human", "content": "Hi?"}, {"role": "gpt", "content": "Hello."}]}
        target.write_text(json.dumps(chat) + "\n")
        message = (f"{target}:1: a chat without an assistant message has nothing to learn (its roles: gpt, "
                   "human; the chat template's are system, user and assistant (ShareGPT's human and gpt are "
                   "user and assistant))")
    elif case == "parquet_column":
        target = tmp_path / "rows.parquet"
        pq.write_table(pa.table({"body": ["a", "b"]}), target)
        args, message = [str(target)], "no column 'text' (columns: body)"
    elif case == "missing_input":
        args, message = [str(tmp_path / "nowhere.jsonl")], "does not exist"
    elif case == "dataset_dict":
        split = datasets.Dataset.from_dict({"text": ["a", "b"]})
        datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
        args = [str(tmp_path / "dd")]
        message = f"{tmp_path / 'dd'} is a datasets DatasetDict (splits: train, test); give one split's"
    elif case == "compressed_text":  # found by review: tokenized as its compressed bytes
        target = tmp_path / "notes.txt.gz"
        target.write_bytes(gzip.compress(b"hello"))
        args, message = [str(target)], "notes.txt.gz: a compressed or archived file"
    elif case == "not_utf8":  # found by review: named a position in the decoder's chunk, no line
        target.write_bytes(b'{"text": "fine"}\n' * 3 + b'{"text": "caf\xe9"}\n')
        message = f"{target}:4: not UTF-8 (byte 0xe9 at byte 14 of the line)"
    elif case == "binary":  # found by review: a checkpoint's shards in a directory scored as text
        target = tmp_path / "__0_0.distcp"
        target.write_bytes(b"PK\x03\x04" + bytes(100))
        args, message = [str(target)], f"{target}: not text (a NUL byte at byte 5; a binary file: leave"
    elif case == "utf16":
        target = tmp_path / "notes.txt"
        target.write_bytes("notes".encode("utf-16"))
        args, message = [str(target)], "not text (a NUL byte at byte 4; UTF-16 text: re-encode it as UTF-8)"
    elif case == "no_targets":  # found by the walkthrough: trained to NaN, every step skipped, exit 0
        target.write_text('{"prompt": "p", "completion": ""}\n' * 5)
        message = "no token to train on: the records' completions (or assistant turns) are all empty"
    elif case == "out_is_a_file":
        target.write_text('{"text": "fine"}\n')
        (tmp_path / "out").write_text("mine")
        message = "out is a file, not a directory"
    else:
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "something.txt").write_text("mine")
        target.write_text('{"text": "fine"}\n')
        message = "is not a prepared dataset"
    done = run_cli("prepare", *args, "--out", str(tmp_path / "out"), "--val-percent", "0")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    if case == "not_prepared":
        assert (tmp_path / "out" / "something.txt").read_text() == "mine"  # never touched
    assert not (tmp_path / ".out.preparing").exists()  # nothing written
    assert case in ("not_prepared", "out_is_a_file") or not (tmp_path / "out").exists()


def test_a_datasets_split_files_and_a_file_named_twice_are_refused(tmp_path):
    """Found by review: a directory in the Hub's layout (train, test and validation files side by
    side) was one corpus, its test and validation rows trained on; a file named by two inputs was
    read twice, under two keys (a document held out in one copy was trained on in the other)."""
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    for split in ("train", "test", "validation"):
        pq.write_table(pa.table({"text": [f"{split} {i}" for i in range(3)]}),
                       hub / "data" / f"{split}-00000-of-00001.parquet")
    (hub / "README.md").write_text("a dataset card")
    held = ("holds a dataset's splits as files (test: data/test-00000-of-00001.parquet; train: "
            "data/train-00000-of-00001.parquet; validation: data/validation-00000-of-00001.parquet): read "
            "together, the held-out splits are trained on; give the training split alone (--glob / "
            "data.file_glob 'train*', or its files)")
    with pytest.raises(DataError, match=f"^input '{re.escape(str(hub))}' {re.escape(held)}"):
        resolve_sources([str(hub)], "*.parquet")
    with pytest.raises(DataError, match="holds a dataset's splits as files"):
        resolve_sources([f"{hub}/**/*.parquet"], "*")
    assert [s.name for s in resolve_sources([str(hub)], "train*")] == ["data/train-00000-of-00001.parquet"]
    # named one by one, they are read as asked; directories of a split's name count too, and
    # text files (a code corpus's train.py beside test_train.py) never do
    assert len(resolve_sources(sorted(map(str, (hub / "data").iterdir())), "*")) == 3
    (tmp_path / "dirs" / "train").mkdir(parents=True)
    (tmp_path / "dirs" / "dev").mkdir()
    for split in ("train", "dev"):
        (tmp_path / "dirs" / split / "part-0.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match=r"\(train: train/part-0.jsonl; validation: dev/part-0.jsonl\): .*"
                                        r"data.file_glob 'train/\*\*/\*'"):
        resolve_sources([str(tmp_path / "dirs")], "*.jsonl")
    assert [s.name for s in resolve_sources([str(tmp_path / "dirs")], "train/**/*")] == ["train/part-0.jsonl"]
    # a pattern is told to match the training files alone (--glob does not apply to it); a split's
    # word deeper than a dataset's layout names splits is another file's name (found by the diff
    # review: a corpus of repositories holding tests/fixtures/train.jsonl and test.jsonl)
    with pytest.raises(DataError, match=r"give the training split alone \(a pattern that matches its files "):
        resolve_sources([f"{tmp_path / 'dirs'}/*/*.jsonl"], "*")
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / "repos" / "tool" / "tests" / "fixtures").mkdir(parents=True, exist_ok=True)
        (tmp_path / "repos" / "tool" / "tests" / "fixtures" / name).write_text('{"text": "x"}\n')
    assert len(resolve_sources([str(tmp_path / "repos")], "*")) == 2
    (tmp_path / "code").mkdir()
    for name in ("train.py", "test_train.py"):
        (tmp_path / "code" / name).write_text("pass\n")
    assert len(resolve_sources([str(tmp_path / "code")], "*.py")) == 2
    # one file through two inputs: refused, naming both keys
    (tmp_path / "c" / "sub").mkdir(parents=True)
    (tmp_path / "c" / "sub" / "x.jsonl").write_text('{"text": "x"}\n')
    twice = tmp_path / "c" / "sub" / "x.jsonl"
    with pytest.raises(DataError, match=f"^{re.escape(str(twice))} is read twice \\(as 'sub/x.jsonl' and "
                                        "'x.jsonl', inputs: "):
        resolve_sources([str(tmp_path / "c"), str(twice)], "*.jsonl")
    with pytest.raises(DataError, match=r"is read twice \(inputs: "):
        resolve_sources([str(twice), str(twice.parent / ".." / "sub" / "x.jsonl")], "*")
    # a Hugging Face snapshot's files alike are links to one blob: each file is its own (found by
    # the diff review: two empty __init__.py files were "read twice")
    snapshot = tmp_path / "snapshot"
    (snapshot / "blobs").mkdir(parents=True)
    (snapshot / "blobs" / "e69de29").write_text("")
    for package in ("a", "b"):
        (snapshot / "pkg" / package).mkdir(parents=True)
        (snapshot / "pkg" / package / "__init__.py").symlink_to(snapshot / "blobs" / "e69de29")
    assert len(resolve_sources([str(snapshot / "pkg")], "*.py")) == 2


def test_data_smaller_than_one_global_batch_fails_before_training(tmp_path):
    """A global batch must hold distinct windows: fewer windows than one global batch is one line
    naming both counts and the batch's factors."""
    (tmp_path / "texts").mkdir()
    for i in range(20):
        (tmp_path / "texts" / f"{i}.txt").write_text(f"line {i}\n" * 8)  # ~60 windows of 17 bytes
    prepare(PrepareOptions(inputs=[str(tmp_path / "texts")], val_percent=20.0), tmp_path / "p",
            progress=False)
    done = run_cli("train", "experiment=quick", "trainer.max_steps=1", "checkpoint.enabled=false",
                   "data.source=prepared", f"data.paths=[{tmp_path / 'p'}]", "trainer.seq_len=16",
                   "trainer.micro_batch_size=64", "trainer.grad_accum_steps=2", f"run.dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "fewer than one global batch of 128" in lines[0], done.stderr[-2000:]
    assert "trainer.micro_batch_size=64 x trainer.grad_accum_steps=2 x 1 data-parallel ranks" in lines[0]


def test_a_tokenizer_naming_no_end_of_text_is_said(tmp_path, caplog):
    """Found by review: a tokenizer.json copied without its tokenizer_config.json ran the documents
    into each other with nothing between them, without a word (its vocabulary had <|endoftext|>)."""
    vocabulary = {"alpha": 0, "beta": 1, "[UNK]": 2}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<|endoftext|>"])
    tokenizer = save_tokenizer(raw, tmp_path / "tokenizer")
    assert not reads_bytes(tokenizer) and reads_bytes(ByteTokenizer())  # eval's loss: per token, per byte
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("alpha beta")
    options = PrepareOptions(inputs=[str(tmp_path / "a.txt"), str(tmp_path / "b.txt")],
                             tokenizer=tokenizer.source, val_percent=0.0)
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        prepare(options, tmp_path / "out", progress=False)
    said = [r.getMessage() for r in caplog.records if "names no end-of-text token" in r.getMessage()]
    assert len(said) == 1 and f'add "eos_token": "<|endoftext|>" (in its vocabulary) to {tmp_path}' in said[0]
    (tmp_path / "tokenizer" / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        separated = prepare(options, tmp_path / "out", progress=False)  # another eos_id: prepared again
    assert not separated.up_to_date and not any("end-of-text" in r.getMessage() for r in caplog.records)
    assert read_split(tmp_path / "out", "train")[0].tolist() == [0, 1, 3, 0, 1, 3]


def test_parquet_is_read_a_column_at_a_time(tmp_path, monkeypatch):
    """Found by review: every column was read and decoded (an image column beside the text)."""
    from shardtrain.data.documents import parquet_tables

    monkeypatch.setattr("shardtrain.data.documents.TABLE_ROWS", 2)
    rows = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"body": ["a", "b", "c"], "image": [b"\x00" * 1000] * 3}), rows, row_group_size=2)
    assert [t.schema.names for t in parquet_tables(rows, "body")] == [["body"]] * 2
    # for the error: the columns alone first (no row read), then the rows
    assert [(t.schema.names, t.num_rows) for t in parquet_tables(rows, "text")] == [
        (["body", "image"], 0), (["body", "image"], 2), (["body", "image"], 1)]


def test_parquet_and_arrow_rows_are_read_a_batch_at_a_time(tmp_path, monkeypatch):
    """Found by review: a whole row group's (or Arrow file's) column became Python bytes at once (a
    125 MB file with one row group took 1 GB). Rows come TABLE_ROWS at a time, keys numbered through
    the file as before (they decide the split)."""
    from shardtrain.data.documents import arrow_tables, documents, parquet_tables

    monkeypatch.setattr("shardtrain.data.documents.TABLE_ROWS", 2)
    texts = [f"row {i}" for i in range(7)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "rows.parquet", row_group_size=5)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    assert [b.num_rows for b in parquet_tables(tmp_path / "rows.parquet", "text")] == [2, 2, 2, 1]
    assert max(b.num_rows for b in arrow_tables(tmp_path / "saved")) == 2
    for source in (Source(tmp_path / "rows.parquet", "rows.parquet"), Source(tmp_path / "saved", "saved")):
        assert list(documents(source, "text")) == [(f"{source.name}:{i}", t.encode())
                                                   for i, t in enumerate(texts)]
    with pytest.raises(DataError, match=r"no column 'body' \(columns: text\)"):
        list(documents(Source(tmp_path / "saved", "saved"), "body"))
    # a Parquet file of no rows names its columns too (found by review: "no documents")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"no column 'body' \(columns: text\)"):
        list(documents(Source(tmp_path / "empty.parquet", "empty.parquet"), "body"))
    assert list(documents(Source(tmp_path / "empty.parquet", "empty.parquet"), "text")) == []
    # a partial copy of a save_to_disk directory: one line naming the file (found by review: a bare
    # FileNotFoundError from the fingerprint)
    [arrow] = (tmp_path / "saved").glob("*.arrow")
    arrow.unlink()
    with pytest.raises(DataError, match=rf"saved: state.json lists {arrow.name}, which the directory lacks; "
                                        "copy the whole directory again"):
        Source(tmp_path / "saved", "saved").fingerprint()


def test_a_null_text_is_an_empty_document_in_every_format(tmp_path):
    """A JSON null stopped preparation (a traceback-free 'NoneType, not text') where a Parquet or
    Arrow null was an empty document: pandas writes missing text as null in both."""
    from shardtrain.data.documents import documents

    (tmp_path / "a.jsonl").write_text('{"text": "ab"}\n{"text": null}\n')
    pq.write_table(pa.table({"text": ["ab", None]}), tmp_path / "a.parquet")
    read = {kind: [text for _, text in documents(Source(tmp_path / f"a.{kind}", f"a.{kind}"), "text")]
            for kind in ("jsonl", "parquet")}
    assert read == {"jsonl": [b"ab", b""], "parquet": [b"ab", b""]}
    # A table of both kinds (text rows, fine-tuning rows, a row of neither): each row as it holds
    # (found by review: a Parquet file's fine-tuning rows were empty documents)
    chat = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    pq.write_table(pa.table({"text": ["ab", None, None], "messages": [None, chat, None]}),
                   tmp_path / "both.parquet")
    read = [doc for _, doc in documents(Source(tmp_path / "both.parquet", "both.parquet"), "text")]
    assert read == [b"ab", {"messages": chat}, b""]


def test_a_file_is_read_by_its_suffix_whatever_its_case(tmp_path):
    """JSON Lines' other name and upper-case suffixes are records too (found by review: read as
    text, a document of JSON syntax); datasets prepared from them as text are stale, no other."""
    names = ("a.jsonl", "a.JSONL", "a.ndjson", "a.ndjson.gz", "a.Jsonl.GZ", "a.PARQUET", "a.json", "a.txt")
    for name in names:
        (tmp_path / name).write_text("{}")
    sources = {name: Source(tmp_path / name, name) for name in names}
    assert {name: source.kind for name, source in sources.items()} == {
        "a.jsonl": "jsonl", "a.JSONL": "jsonl", "a.ndjson": "jsonl", "a.ndjson.gz": "jsonl",
        "a.Jsonl.GZ": "jsonl", "a.PARQUET": "parquet", "a.json": "text", "a.txt": "text"}
    assert [name for name, source in sources.items() if "read_as" in source.fingerprint()] == [
        "a.JSONL", "a.ndjson", "a.ndjson.gz", "a.Jsonl.GZ", "a.PARQUET"]


def test_prepare_options_reject_bad_values(tmp_path):
    done = run_cli("prepare", str(tmp_path), "--out", str(tmp_path / "o"), "--workers", "0")
    assert done.returncode == 2 and "--workers 0 must be at least 1" in done.stderr
    # Found by review: one message listed every bound, and a split without validation documents was
    # written without a word (training refuses it, naming a data.val_percent that cannot apply).
    (tmp_path / "one.txt").write_text("a single document")
    done = run_cli("prepare", str(tmp_path / "one.txt"), "--out", str(tmp_path / "single"))
    assert done.returncode == 0 and done.stderr.startswith(f"warning: {tmp_path / 'single'} has no "
                                                           "validation tokens (--val-percent 5 of 1 "
                                                           "documents)"), done.stderr
    # All held out: no training tokens, said as well (found by a trial: a dataset training refuses,
    # written without a word); an evaluation set, which it may be meant as
    done = run_cli("prepare", str(tmp_path / "one.txt"), "--out", str(tmp_path / "all_val"),
                   "--val-percent", "100")
    assert done.returncode == 0 and done.stderr.startswith(
        f"warning: {tmp_path / 'all_val'} has no training tokens (--val-percent 100 held out all 1 "
        "documents): training on it refuses to run; it serves as an evaluation set"), done.stderr
    with pytest.raises(DataError, match=r"0 validation documents; both need at least one \(prepare it again"):
        load_corpus(DataConfig(source="prepared", paths=[str(tmp_path / "single")]))
    # The same file as data.source=files: one document whatever data.val_percent says (found by
    # review: the message told to change data.val_percent)
    with pytest.raises(DataError, match=r"both need at least one \(a text file is one document, held out or "
                                        r"trained on whole: split it into several files"):
        load_corpus(DataConfig(source="files", paths=[str(tmp_path / "one.txt")],
                               cache_dir=str(tmp_path / "cache")))
    # eval --file reads the validation split alone: the message named both splits as needed
    with pytest.raises(DataError, match=r"0 validation documents; the validation split needs at least one "
                                        r"\(prepare it again with --val-percent above 0\)$"):
        load_corpus(DataConfig(source="prepared", paths=[str(tmp_path / "single")]), need=("val",))
    # Found by review: a prepared dataset with a damaged manifest was read as text (eval --file scored
    # its .npy bytes); another manifest.json beside text files is still just a file
    (tmp_path / "single" / "manifest.json").write_text('{"format": "shardtrain-prep')
    for found in (lambda: is_prepared_dataset(tmp_path / "single"),
                  lambda: resolve_sources([str(tmp_path / "single")], "*")):
        with pytest.raises(DataError, match=f"^{tmp_path / 'single' / 'manifest.json'} cannot be read "
                                            r"\(JSONDecodeError\): the prepared dataset is damaged"):
            found()
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "manifest.json").write_text("{not json")
    assert not is_prepared_dataset(tmp_path / "web") and not is_prepared_dataset(tmp_path / "one.txt")
    with pytest.raises(DataError, match="no tokenizer.json"):
        prepare(PrepareOptions(inputs=[str(tmp_path)], tokenizer=str(tmp_path)), tmp_path / "o")
    with pytest.raises(DataError, match="tokenizer '.*nomodel' does not exist"):  # not "no tokenizer.json"
        prepare(PrepareOptions(inputs=[str(tmp_path)], tokenizer=str(tmp_path / "nomodel")), tmp_path / "o")


def test_training_reads_a_prepared_dataset(tmp_path):
    """data.source=prepared trains on exactly what data.source=stdlib prepares into the cache (the
    same losses), and a dataset made with another tokenizer is refused before training starts."""
    from cli_utils import read_metrics

    stdlib = __import__("sysconfig").get_paths()["stdlib"]
    out = tmp_path / "prepared"
    assert run_cli("prepare", stdlib, "--glob", "*.py", "--max-bytes", "2000000",
                    "--out", str(out)).returncode == 0
    common = ["experiment=quick", "trainer.max_steps=3", "trainer.log_every=1",
              "trainer.sample_tokens=0", "checkpoint.enabled=false"]
    given = run_cli("train", *common, "data.source=prepared", f"data.paths=[{out}]",
                    f"run.dir={tmp_path / 'given'}")
    assert given.returncode == 0, given.stderr[-2000:]
    assert f"prepared at {out}" in given.stderr
    cached = run_cli("train", *common, f"data.cache_dir={tmp_path / 'cache'}",
                     f"run.dir={tmp_path / 'cached'}")
    assert cached.returncode == 0, cached.stderr[-2000:]
    losses = [[r["loss"] for r in read_metrics(tmp_path / name)] for name in ("given", "cached")]
    assert len(losses[0]) == 3 and losses[0] == losses[1]

    model = make_model_dir(tmp_path / "model", "llama")
    other = tmp_path / "other"
    assert run_cli("prepare", stdlib, "--glob", "*.py", "--max-bytes", "300000",
                    "--tokenizer", str(model), "--out", str(other)).returncode == 0
    refused = run_cli("train", *common, "data.source=prepared", f"data.paths=[{other}]",
                      f"run.dir={tmp_path / 'refused'}")
    assert refused.returncode == 2
    assert "but the model's is bytes (256 tokens)" in refused.stderr and "(300 tokens)" in refused.stderr


def test_resident_memory_does_not_grow_with_the_dataset(tmp_path):
    """20 training steps on a 2 GB prepared dataset (a billion uint16 tokens) end with the same
    anonymous resident memory (the process's own, not mapped page cache), within 5%, as on 20 MB:
    the tokens are memory-mapped and the sample order is computed, not stored."""
    from data_workers import resident_after_steps, write_prepared
    from distributed import run_on_ranks

    small = write_prepared(tmp_path / "small", train_tokens=10_000_000)
    large = write_prepared(tmp_path / "large", train_tokens=1_000_000_000)
    for dataset in (small, large):
        run_on_ranks(resident_after_steps, 1, str(dataset), 20, str(tmp_path), tmp_path=tmp_path)
    rss = {name: int((tmp_path / f"rss-{name}.txt").read_text()) for name in ("small", "large")}
    print(f"resident after 20 steps: 20 MB dataset {rss['small'] / 2**20:.0f} MiB, "
          f"2 GB dataset {rss['large'] / 2**20:.0f} MiB")
    assert abs(rss["large"] - rss["small"]) < 0.05 * rss["small"], rss


def test_chat_records_train_on_the_assistant_turns_only(tmp_path):
    """``messages`` rendered with the model's chat template; the target tokens are exactly the
    assistant's turns as the template writes them (with its end-of-turn marker)."""
    model = make_model_dir(tmp_path / "model", "llama")
    chats = [{"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": f"What is {i} + {i}?"},
                           {"role": "assistant", "content": f"{2 * i}."},
                           {"role": "user", "content": "Sure?"},
                           {"role": "assistant", "content": "Yes."}]} for i in range(20)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    result = prepare(PrepareOptions(inputs=[str(tmp_path / "chats.jsonl")], tokenizer=str(model),
                                    val_percent=0.0), tmp_path / "out", progress=False)
    assert "mask_file" in result.manifest["splits"]["train"]["shards"][0]
    tokenizer = HFTokenizer(model)
    tokens, _ = read_split(tmp_path / "out", "train")
    mask = np.load(tmp_path / "out" / "train" / "mask-00000.npy")
    targets = tokenizer.decode(tokens[mask == 1].tolist())
    assert targets == "".join(f"{2 * i}.<|im_end|>\nYes.<|im_end|>\n" for i in range(20))
    assert tokenizer.decode(tokens[:len(tokenizer.encode(tokenizer.render_chat(chats[0]["messages"],
                                                                               False), False))].tolist()) \
        == tokenizer.render_chat(chats[0]["messages"], add_generation_prompt=False)
    assert open_prepared(tmp_path / "out", tokenizer).manifest is not None
    # Another vocabulary is named by where each tokenizer was read, not by its digest (found by the
    # walkthrough: "tokenizers:3308d1e6c1057652")
    with pytest.raises(DataError, match=f"prepared with the tokenizer {model} .* but the model's is bytes "):
        open_prepared(tmp_path / "out", ByteTokenizer())
    # The model's tokenizer with another template (its vocabulary the same): these renderings are
    # not its format (found by review: accepted, and a changed template's preparation was reused)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    other = HFTokenizer(model)
    assert other.name == tokenizer.name and other.chat_template != tokenizer.chat_template
    with pytest.raises(DataError, match="rendered with another chat template than the model's"):
        open_prepared(tmp_path / "out", other)
    # ... and a tokenizer without any is told so (a new-user trial was told of "another" template)
    (model / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                             if k != "chat_template"}))
    with pytest.raises(DataError, match="a chat template, and the model's tokenizer .* has none"):
        open_prepared(tmp_path / "out", HFTokenizer(model))
    # A template that does not compile refuses only what renders it, naming the tokenizer (found by
    # a trial: every run of the tokenizer, plain text too, was refused, naming nothing)
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    broken = HFTokenizer(model)
    assert broken.encode("plain text")
    with pytest.raises(DataError, match=f"the chat template of {model} does not compile .*; repair it"):
        broken.render_chat(chats[0]["messages"])
    # A template that refuses a role (Gemma's and Mistral's raise on "system"): the record is named
    # (found by a new-user trial: only the template's words, for a system message on line 51)
    config["chat_template"] = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception("
                               "'System role not supported') }}{% endif %}{{ m.content }}\n{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    plain = [{"messages": c["messages"][1:]} for c in chats]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(c) + "\n" for c in [*plain[:2], chats[2]]))
    with pytest.raises(DataError, match=r"^mixed.jsonl:3: the chat template of .* failed: System role not "
                                        r"supported"):
        prepare(PrepareOptions(inputs=[str(tmp_path / "mixed.jsonl")], tokenizer=str(model), val_percent=0.0),
                tmp_path / "refused", progress=False)
    # Prompt/completion records render no template: read with any (found by review: refused,
    # advising to prepare them as prompt/completion records, which they were)
    pairs = [{"prompt": f"What is {i} + {i}? ", "completion": f"{2 * i}."} for i in range(20)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    prepared = prepare(PrepareOptions(inputs=[str(tmp_path / "pairs.jsonl")], tokenizer=str(model),
                                      val_percent=0.0), tmp_path / "pairs", progress=False)
    assert prepared.manifest["conversations"] == 0
    assert open_prepared(tmp_path / "pairs", other).manifest is not None
    assert result.manifest["conversations"] == 20
    # A template that ends a conversation with the end-of-text token itself (Llama 2's "</s>"):
    # not doubled by the separator (found by review)
    config["chat_template"] = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}"
                               "{{ eos_token }}{% else %}[{{ m.content }}]{% endif %}{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    ending = HFTokenizer(model)
    ids, mask, last_only = encode_chat(ending, chats[0]["messages"])
    assert not last_only
    assert ids[-1] == ending.eos_id and ids[-2] != ending.eos_id and ids.count(ending.eos_id) == 2
    assert len(mask) == len(ids) and mask[-1] == 1  # the turn's end-of-text is the answer's: a target


def test_resume_at_other_world_sizes_consumes_exactly_the_uninterrupted_samples(tmp_path):
    """On a prepared dataset: 3 steps at 4 processes, resumed for 2 at 2 processes with 2
    micro-batches, then for 2 at 1 process with 4: every step consumes the same samples, in the
    same global order, as an uninterrupted 7-step run at 1 process; none repeated or skipped."""
    from data_workers import consume
    from distributed import run_on_ranks

    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    prepare(PrepareOptions(inputs=[str(source)], val_percent=10.0), tmp_path / "data", progress=False)

    def steps(world: int, out, rows: bool = False) -> dict[int, list]:
        """Step -> the step's sample ids (``rows``: the (inputs, targets) rows its batches returned)
        in global order (micro-step after micro-step, the ranks' slices side by side in each)."""
        per_rank = [{step: batches if rows else micro for step, micro, batches in json.loads(
            (out / f"seen-{world}-{rank}.json").read_text())} for rank in range(world)]
        if rows:
            return {step: [(x, y) for k in range(len(per_rank[0][step])) for rank in per_rank
                           for x, y in zip(*rank[step][k])] for step in per_rank[0]}
        return {step: [i for k in range(len(per_rank[0][step])) for rank in per_rank for i in rank[step][k]]
                for step in per_rank[0]}

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole.mkdir()
    parts.mkdir()
    run_on_ranks(consume, 1, str(tmp_path / "data"), str(tmp_path / "run-whole"), 7, 1, str(whole),
                 tmp_path=tmp_path)
    resumed: dict[int, list[int]] = {}
    resumed_rows: dict[int, list] = {}
    for world, accum, until in ((4, 1, 3), (2, 2, 5), (1, 4, 7)):
        run_on_ranks(consume, world, str(tmp_path / "data"), str(tmp_path / "run-parts"), until, accum,
                     str(parts), tmp_path=tmp_path)
        resumed.update(steps(world, parts))
        resumed_rows.update(steps(world, parts, rows=True))
    uninterrupted, uninterrupted_rows = steps(1, whole), steps(1, whole, rows=True)
    assert sorted(resumed) == sorted(uninterrupted) == list(range(1, 8))
    for step in uninterrupted:
        assert resumed[step] == uninterrupted[step], step
        # The rows the batches returned, in the same order (a batch built from another position
        # than the ids say would pass the ids' check alone).
        assert len(resumed_rows[step]) == len(resumed[step]), step
        assert resumed_rows[step] == uninterrupted_rows[step], step
    consumed = [i for step in sorted(uninterrupted) for i in uninterrupted[step]]
    assert len(set(consumed)) == len(consumed)  # one epoch: nothing repeated


def test_a_mixture_draws_each_dataset_by_its_weight(tmp_path):
    """Two prepared datasets with weights 3:1: every block of the order holds them 768:256, each
    dataset's samples come in its own order without repeats, the order is the same at any split of
    the global batch, and a run trains on the mixture (with data.document_mask=true)."""
    from cli_utils import read_metrics

    from shardtrain.data.batches import MIXTURE_BLOCK, BatchLayout, TrainBatches

    for name, letter in (("a", "a"), ("b", "b")):
        (tmp_path / name).mkdir()
        for i in range(30):
            (tmp_path / name / f"{i}.txt").write_text(letter * 400)
        prepare(PrepareOptions(inputs=[str(tmp_path / name)], val_percent=10.0), tmp_path / f"p{name}",
                progress=False)
    paths = [str(tmp_path / "pa"), str(tmp_path / "pb")]
    corpus = load_corpus(DataConfig(source="prepared", paths=paths, weights=[3.0, 1.0]))
    windows = corpus.train_windows(16)
    order = windows.order(seed=7)
    ids = order.take(0, 2 * MIXTURE_BLOCK)
    datasets = ids >> 40
    for block in range(2):
        part = datasets[block * MIXTURE_BLOCK:(block + 1) * MIXTURE_BLOCK]
        assert (part == 0).sum() == 768 and (part == 1).sum() == 256
    a_ids = ids[datasets == 0] & ((1 << 40) - 1)
    first_epoch = a_ids[:windows.parts[0].num_samples]
    assert sorted(first_epoch.tolist()) == list(range(windows.parts[0].num_samples))
    assert np.array_equal(order.take(100, 50), ids[100:150])
    x = windows.batch(ids[:64]).inputs
    assert ((x == ord("a")).all(dim=1) == torch.from_numpy(datasets[:64] == 0)).all()

    def rows(world: int, micro: int, accum: int) -> list[list[int]]:
        loaders = [TrainBatches(windows, BatchLayout(micro, accum, world), rank, seed=7, prefetch=False)
                   for rank in range(world)]
        return [sorted(int(row[0]) for loader in loaders for batch in loader.next_step()
                       for row in batch.inputs)
                for _ in range(5)]

    assert rows(1, 8, 1) == rows(2, 2, 2) == rows(4, 1, 2)

    # Validation interleaves the datasets' held-out windows, each once: the first that an evaluation
    # reads hold every dataset's (found by review: the splits one after another, the first dataset's
    # alone). A dataset without a validation split (here one prepared with none) is left out.
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "0.txt").write_text("c" * 400)
    prepare(PrepareOptions(inputs=[str(tmp_path / "c")], val_percent=0.0), tmp_path / "pc", progress=False)
    with_empty = load_corpus(DataConfig(source="prepared", paths=[str(tmp_path / "pc"), *paths]))
    val = with_empty.val_windows(16, document_mask=True)
    counts = [(len(part) - 1) // 16 for part in corpus.val_parts]
    assert val.num_samples == sum(counts) and min(counts) > 0
    assert sorted(val.first(val.num_samples).tolist()) == [(d << 40) | i for d, n in enumerate(counts)
                                                          for i in range(n)]
    every = val.batch(np.arange(val.num_samples)).inputs
    assert [chr(int(row[0])) for row in every[:2]] == ["a", "b"]  # the first window of each
    assert val.batch(np.array([-1, -1])).inputs.eq(0).all()  # padding alone

    done = run_cli("train", "experiment=quick", "trainer.max_steps=2", "trainer.sample_tokens=0",
                   "data.source=prepared", f"data.paths=[{paths[0]},{paths[1]}]",
                   "data.weights=[3,1]", "trainer.seq_len=16", "data.document_mask=true",
                   f"run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mixture of" in done.stderr and read_metrics(tmp_path / "run")[-1]["step"] == 2
    # the checkpoint keeps each dataset's sample count, which a resume and eval compare
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert saved["train_part_samples"] == [part.num_samples for part in windows.parts], saved
    # eval scores the run's held-out windows as its evaluation did, documents masked (found by
    # review: eval packed them unmasked, 4.0374 where a run of short documents logged 4.0391; these
    # documents of one letter each score alike either way, so the line says which was done)
    scored = run_cli("eval", str(tmp_path / "run" / "checkpoints" / "step-2"), "--samples", "16",
                     "--seq-len", "16", "--batch-size", "4")
    assert scored.returncode == 0, scored.stderr[-2000:]
    loss, logged = float(scored.stdout.split("loss ")[1].split()[0]), read_metrics(tmp_path / "run")[-1]
    assert abs(loss - logged["val_loss"]) <= 6e-5, (loss, logged["val_loss"])  # printed to 4 places
    assert "each document attending within itself" in scored.stdout
    # and, where windows cross a document's end, how many targets the loss is per (found by review:
    # every input token was named)
    across = run_cli("eval", str(tmp_path / "run" / "checkpoints" / "step-2"), "--seq-len", "16",
                     "--samples", "1000")
    assert across.returncode == 0, across.stderr[-2000:]
    said = re.search(r": (\d+) bytes in windows of 16, each document attending within itself "
                     r"\(data.document_mask\), (\d+) of them scored \(no target across a document's end\)",
                     across.stdout)
    assert said and 0 < int(said[1]) - int(said[2]) < int(said[1]) // 100, across.stdout
    assert "windows a block of 1,024 (weight's share): pa 768 (75.00%), pb 256 (25.00%)" in done.stderr
    assert "as often as its weight says" not in done.stderr
    # A weight under one window in a block is raised to one: said (found by review: it was silent,
    # and weights=[] by size gives a small dataset beside large ones such a weight)
    windows.weights = [0.9995, 0.0005]
    assert ("big 1023 (99.95%), small 1 (0.05%); small drawn 2x as often as its weight says"
            in windows.describe(["big", "small"]))
    # Found by review: a dataset too small for a window was named "mixture part 1", and a damaged
    # validation split was left out of the interleaved validation as if too small, without a word
    with pytest.raises(DataError, match=f"^training data of {re.escape(paths[0])} has "):
        corpus.train_windows(corpus.train_parts[0].size)
    damaged = shutil.copytree(tmp_path / "pb", tmp_path / "pb-damaged")
    starts = damaged / "val" / "docs-00000.npy"
    starts.write_bytes(b"\0" * starts.stat().st_size)
    mixture = load_corpus(DataConfig(source="prepared", paths=[paths[0], str(damaged)]))
    with pytest.raises(DataError, match=f"{re.escape(str(damaged))}: val/docs-00000.npy is not a readable"):
        mixture.val_windows(16, packing="records")  # whole records: the starts read at once
    # Datasets of two token dtypes (an older uint32 one beside a uint16 one): their joined validation
    # stream reads each shard in its own (found by review: read as the first's, its manifest blamed)
    wide = shutil.copytree(tmp_path / "pb", tmp_path / "pb-uint32")
    for shard in wide.glob("*/tokens-*.npy"):
        np.save(shard, np.load(shard).astype(np.uint32))
    manifest = json.loads((wide / "manifest.json").read_text())
    (wide / "manifest.json").write_text(json.dumps(manifest | {"dtype": "uint32"}))
    from shardtrain.data.prepared import TokenStream

    narrow, wide = open_prepared(tmp_path / "pa").val, open_prepared(wide).val
    joined = TokenStream.concat([narrow, wide])
    assert joined.dtype == np.uint32
    assert np.array_equal(np.asarray(joined), np.concatenate([np.asarray(narrow), np.asarray(wide)]))


def save_tokenizer(tokenizer: tokenizers.Tokenizer, directory) -> HFTokenizer:
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    return HFTokenizer(directory)


def test_long_documents_are_encoded_a_piece_at_a_time_to_the_same_ids(tmp_path, monkeypatch):
    """Found by review: a document was encoded in one piece, at some 500 bytes a token (a 100 MB
    text file took 12 GB per worker). Cut at line starts where the tokenizer encodes them alike,
    with its special tokens around the whole, the ids are those of one piece; a tokenizer that
    marks a text's start (SentencePiece's prefix space) is encoded whole."""
    text = (Path(textwrap.__file__).read_text() + "\n\n  indented\n\ttab\r\nÉté\n") * 3
    # 2,000 tokens: merges of whitespace runs ("\n\n\n", indentations), which GPT-2's pre-tokenizer
    # splits before a word; a piece cut after such a run would encode it otherwise.
    byte_level = train_tokenizer(sample_texts_for_tokenizer(), vocab_size=2000)
    with_specials = train_tokenizer(sample_texts_for_tokenizer(), vocab_size=2000)
    with_specials.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>", special_tokens=[
            ("<|im_start|>", with_specials.token_to_id("<|im_start|>")),
            ("<|im_end|>", with_specials.token_to_id("<|im_end|>"))])
    sentencepiece = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    sentencepiece.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="first")
    sentencepiece.train_from_iterator([text], tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>"], show_progress=False))
    expected = {"byte_level": ([], []), "with_specials": ([with_specials.token_to_id("<|im_start|>")],
                                                          [with_specials.token_to_id("<|im_end|>")]),
                "sentencepiece": None}
    whole = {}
    for name, raw in (("byte_level", byte_level), ("with_specials", with_specials),
                      ("sentencepiece", sentencepiece)):
        tokenizer = save_tokenizer(raw, tmp_path / name)
        assert tokenizer.piecewise == expected[name], name
        whole[name] = tokenizer.encode_documents([text.encode()])[0]
        assert list(whole[name]) == raw.encode(text).ids, name
    monkeypatch.setattr("shardtrain.data.tokenizer.PIECE_CHARS", 500)  # some 600 pieces
    # Windows line ends: cut after "\r\n" too (before, such a file was never cut)
    crlf = text.replace("\n", "\r\n")
    assert len(line_pieces(crlf, 500, partial(pre_token_starts_at, byte_level))) > 3  # 1 before
    for name in whole:
        tokenizer = HFTokenizer(tmp_path / name)
        short, long, windows = tokenizer.encode_documents([b"a short one", text.encode(), crlf.encode()])
        assert list(long) == list(whole[name]) and short == raw_ids(tmp_path / name, "a short one"), name
        assert list(windows) == raw_ids(tmp_path / name, crlf), name


def test_tokenizers_a_cut_could_change_are_encoded_whole():
    """Found by a review of the piecewise encoding: an added token that takes the whitespace before
    it (RoBERTa's ``<mask>``, lstrip) or spans a newline, and a BPE without a pre-tokenizer (it merges
    across newlines: Gemma-style conversions), pass the probes, and a cut changed their ids."""
    base = train_tokenizer(sample_texts_for_tokenizer(), vocab_size=2000)
    assert piecewise_affixes(base) == ([], [])
    masked = train_tokenizer(sample_texts_for_tokenizer(), vocab_size=2000)
    masked.add_special_tokens([tokenizers.AddedToken("<mask>", lstrip=True)])
    spanning = train_tokenizer(sample_texts_for_tokenizer(), vocab_size=2000)
    spanning.add_tokens([tokenizers.AddedToken("x\ny", special=False)])
    chars = sorted(set("".join(SPLIT_PROBES) + "{}"))
    vocab = {**{c: i for i, c in enumerate(chars)}, "\n}": len(chars)}
    unsplit = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[("\n", "}")]))
    for raw in (masked, spanning, unsplit):
        assert piecewise_affixes(raw) is None
    # a cut is made only where the pre-tokenizer starts a token (here: every lone newline)
    text = "foo bar\nbaz qux\n  indented\nend"
    assert line_pieces(text, 1, partial(pre_token_starts_at, base)) == ["foo bar\n", "baz qux\n  indented\n",
                                                                        "end"]
    assert line_pieces(text, 1, lambda text, cut: False) == [text]
    assert line_pieces("a\r\nb\r\n\r\nc\r\n", 1) == ["a\r\n", "b\r\n\r\nc\r\n"]  # a blank line is not cut


def sample_texts_for_tokenizer() -> list[str]:
    return [Path(textwrap.__file__).read_text(), *TEXTS[:50]]


def raw_ids(directory, text: str) -> list[int]:
    return tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text).ids


def test_a_tokenizer_files_truncation_and_padding_are_not_applied(tmp_path):
    """Found by review: a tokenizer.json saved after a call with truncation or padding keeps them,
    and the library applies them to every encode: each document was cut to max_length and padded.
    Found by a reading of the fix: a cache prepared with them was still found up to date."""
    raw = train_tokenizer(sample_texts_for_tokenizer())
    plain = raw.encode(TEXTS[5]).ids
    raw.enable_truncation(8)
    raw.enable_padding(length=16, pad_id=0)
    tokenizer = save_tokenizer(raw, tmp_path / "saved")
    assert tokenizer.encode(TEXTS[5]) == plain and len(plain) > 16
    assert tokenizer.encode_documents([TEXTS[5].encode()])[0] == plain
    # a preparation made before, with the cut documents, is not found up to date
    assert tokenizer_entry(tokenizer)["truncation_off"] and "truncation_off" not in tokenizer_entry(
        save_tokenizer(train_tokenizer(sample_texts_for_tokenizer()), tmp_path / "plain"))


def test_a_documents_text_spelling_a_special_token_is_read_as_text(tmp_path, monkeypatch, caplog):
    """Found by review: a document quoting ``<|endoftext|>`` (web text, model outputs) was encoded
    with that token mid-document, a boundary document masking and the model took for real. Read as
    text now (tokenizers' encode_special_tokens), short and long documents alike; the tokenizer's
    own affixes (a BOS) are still tokens, and a conversation's template markers still are too. A
    cache prepared before is not found up to date (a tokenizer without special tokens reads the
    same ids either way)."""
    raw = train_tokenizer(sample_texts_for_tokenizer())
    raw.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", raw.token_to_id("<|im_start|>"))])
    tokenizer = save_tokenizer(raw, tmp_path / "tok")
    specials = {raw.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    text = "def f(x):\n    return '<|endoftext|>' + x  # <|im_end|>\n" * 40
    short = tokenizer.encode_documents([text[:60].encode()])[0]
    assert short[0] == raw.token_to_id("<|im_start|>") and not specials & set(short[1:]), short
    assert raw.decode(short[1:]) == text[:60]
    whole = list(tokenizer.encode_documents([text.encode()])[0])
    monkeypatch.setattr("shardtrain.data.tokenizer.PIECE_CHARS", 100)  # in pieces: the same ids
    assert list(HFTokenizer(tmp_path / "tok").encode_documents([text.encode()])[0]) == whole
    assert whole[0] == raw.token_to_id("<|im_start|>") and not specials & set(whole[1:])
    # a rendered template's markers, and a prompt typed with one, are the tokens they spell
    assert raw.token_to_id("<|im_end|>") in tokenizer.encode("Hi<|im_end|>", special_tokens=False)
    assert tokenizer_entry(tokenizer)["specials_as_text"]
    assert "specials_as_text" not in tokenizer_entry(ByteTokenizer())
    # said, with the documents' keys (found by the diff review: pre-rendered chat text in a text
    # field lost its markers' tokens without a word)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "chat.txt").write_text("<|im_start|>user\nHi<|im_end|>")
    (tmp_path / "docs" / "plain.txt").write_text("nothing special")
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        prepare(PrepareOptions(inputs=[str(tmp_path / "docs")], tokenizer=str(tmp_path / "tok"),
                               val_percent=0.0), tmp_path / "docs_out", progress=False)
    assert (f"data: 1 text document(s) spell special tokens of {tmp_path / 'tok'} (chat.txt), read as text "
            "(a quoted <|endoftext|> is no end of text); a conversation belongs in records of `messages`") \
        in caplog.text


def test_a_validation_share_of_other_than_whole_hundredths_is_refused(tmp_path):
    """The split hashes a key into 10,000 buckets: --val-percent 0.001 held out 0.01% (ten times the
    share asked) without a word (found by review). Refused before anything is read."""
    (tmp_path / "a.txt").write_text("text")
    for share, held in ((0.001, "0.01%"), (0.125, "0.13%")):
        with pytest.raises(DataError, match=rf"^the validation share {share}% is not a whole number of "
                                            rf"hundredths .* would hold out {held}; give a multiple of 0.01"):
            prepare(PrepareOptions(inputs=[str(tmp_path)], val_percent=share), tmp_path / "out",
                    progress=False)
    assert not (tmp_path / "out").exists()
    prepare(PrepareOptions(inputs=[str(tmp_path)], val_percent=0.07), tmp_path / "out", progress=False)


def test_a_record_with_text_and_fine_tuning_fields_is_said_once(tmp_path, caplog):
    """Read as its text, as documented, but no longer silently (a new-user trial): once a file."""
    chat = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    source = tmp_path / "both.jsonl"
    source.write_text("".join(json.dumps({**chat, "text": f"plain {i}"}) + "\n" for i in range(3)))
    done = run_cli("prepare", str(source), "--out", str(tmp_path / "out"), "--val-percent", "0")
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "fine-tuning fields" in line]
    assert len(said) == 1, done.stderr
    assert f"{source}:1: a record with both 'text' and fine-tuning fields is read as its 'text', every " \
        "token a target" in said[0], done.stderr
    # A JSON array's records and a Parquet table's rows too (found by review: JSON Lines' only)
    (tmp_path / "mixed").mkdir()
    array, table = tmp_path / "mixed" / "both.json", tmp_path / "mixed" / "both.parquet"
    array.write_text(json.dumps([{"text": "t", "prompt": "p", "completion": "c"}] * 2))
    pq.write_table(pa.table({"text": ["t", "u"], "prompt": ["p", "q"], "completion": ["c", "d"]}), table)
    for path, where in ((array, "record 1"), (table, "row 0")):
        with caplog.at_level(logging.WARNING, logger="shardtrain"):
            caplog.clear()
            assert len(list(documents(Source(path, path.name), "text"))) == 2
        said = [r.message for r in caplog.records if "fine-tuning fields" in r.message]
        assert said == [f"{path}: {where}: a record with both 'text' and fine-tuning fields is read as its "
                        "'text', every token a target (said once a file); drop 'text' to train on the "
                        "conversation's or completion's tokens only"], caplog.text
    # A null text is a missing one: the record is its chat (found by review: an empty document)

    assert document_of({**chat, "text": None}, "text", "x") == chat
    assert not is_text_and_fine_tuning({**chat, "text": None}, "text")
    assert document_of({"text": None}, "text", "x") == b""
    # nulls of both kinds are an empty document, and a text row of such a table no mixed record
    assert document_of({"text": None, "messages": None}, "text", "x") == b""
    assert document_of({"text": None, "prompt": None, "completion": None}, "text", "x") == b""
    assert not is_text_and_fine_tuning({"text": "hi", "messages": None}, "text")
    assert document_of({"text": "hi", "prompt": None, "completion": None}, "text", "x") == b"hi"


def test_token_ids_past_the_model_are_refused_at_the_build(tmp_path):
    """Found by review: a tokenizer whose ids skip numbers counted its tokens, not its largest id
    (stored as uint16, its largest id wrapped or overflowed), and a Hugging Face model's embedding was
    never compared with the tokenizer: an IndexError deep in the first step (a device-side assert on
    one rank of a GPU)."""
    from shardtrain.config.schema import Config, ModelConfig
    from shardtrain.models.llama import Llama
    from shardtrain.tasks.language_model import LanguageModelTask

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "far": 70000}
    sparse = save_tokenizer(tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]")),
                            tmp_path / "sparse")
    assert sparse.vocab_size == 70001 and token_dtype(sparse.vocab_size) is np.uint32
    # A dataset an older shardtrain prepared with it (vocab_size 4 recorded): read where its dtype
    # holds every id, refused where it cut them
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("a b far " * 20)
    prepare(PrepareOptions(inputs=[str(tmp_path / "docs")], val_percent=0.0,
                           tokenizer=str(tmp_path / "sparse")), tmp_path / "prepared", progress=False)
    manifest_file = tmp_path / "prepared" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["tokenizer"]["vocab_size"] = 4
    manifest_file.write_text(json.dumps(manifest))
    open_prepared(tmp_path / "prepared", sparse)
    manifest_file.write_text(json.dumps({**manifest, "dtype": "uint16"}))
    with pytest.raises(DataError, match=r"prepared by an older shardtrain, which stored this tokenizer's ids "
                                        r"\(up to 70000\) as uint16: larger ones were cut; prepare it again"):
        open_prepared(tmp_path / "prepared", sparse)
    (tmp_path / "sparse" / "tokenizer_config.json").write_text("{bad")  # found by review: a traceback
    with pytest.raises(DataError, match=r"tokenizer_config.json is not readable JSON \(Expecting"):
        HFTokenizer(tmp_path / "sparse")
    task = LanguageModelTask(model=lambda: Llama(ModelConfig(vocab_size=200, dim=16, n_layers=1, n_heads=2,
                                                            max_seq_len=32)))
    task.bind(Config())  # the byte tokenizer: ids up to 255
    with pytest.raises(DataError, match=r"^the tokenizer \(bytes\) has ids up to 255 but the model's input "
                                        r"embedding has 200 rows; use the model's own tokenizer"):
        task.build_model()


def test_a_prompt_and_its_completion_are_tokenized_as_one_text(tmp_path):
    """Found by review: tokenized apart, a SentencePiece-style tokenizer (Llama 2's and Mistral's
    prepend "▁" to every text) put one before each completion: the model learnt a space the prompts
    at inference do not have. Together, the record's tokens are the text's own."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    from shardtrain.data.prepare import encode_pair

    spm = Tokenizer(models.BPE(unk_token="<unk>"))
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    words = ["four", "five", "six", "seven", "Answer", "Question"]
    spm.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")  # SentencePiece's merges:
    spm.train_from_iterator([f"Question: {a}? Answer: {b}" for a in words for b in words],
                            trainers.BpeTrainer(vocab_size=45, special_tokens=["<unk>", "<s>", "</s>"]))
    spm.pre_tokenizer = None  # within words (Llama 2's tokenizer.json has no pre-tokenizer)
    directory = tmp_path / "spm"
    directory.mkdir()
    spm.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tokenizer = HFTokenizer(directory)
    ids, mask = encode_pair(tokenizer, {"prompt": "Question: six? Answer:", "completion": " four"})
    assert ids == tokenizer.encode("Question: six? Answer: four") + [tokenizer.eos_id]
    targets = [token for token, target in zip(ids, mask) if target]
    assert [spm.id_to_token(token) for token in targets] == ["▁fou", "r", "</s>"]  # not "▁", "▁fou"
    # A tokenizer that appends the end of text itself (T5's post-processor, a Llama tokenizer saved
    # with add_eos_token) has it once after a document and after a completion, not twice, nor
    # between the prompt and its completion (found by review); its fingerprint is its own.
    before = tokenizer_entry(tokenizer)
    spm.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[
        ("<s>", spm.token_to_id("<s>")), ("</s>", spm.token_to_id("</s>"))])
    spm.save(str(directory / "tokenizer.json"))
    tokenizer = HFTokenizer(directory)
    bos, eos = tokenizer.encode("")
    _, [(document, _), (pair, mask)], _, _ = encode(tokenizer, (["train"] * 2, [b"Question: six?", {
        "prompt": "Question: six? Answer:", "completion": " four"}], ["a", "b"]))
    assert document.tolist() == tokenizer.encode("Question: six?") and document[-2] != eos
    assert pair.tolist() == tokenizer.encode("Question: six? Answer: four") and list(pair).count(eos) == 1
    assert [spm.id_to_token(token) for token, target in zip(pair, mask) if target] == ["▁fou", "r", "</s>"]
    assert pair[0] == bos and tokenizer_entry(tokenizer)["appended"] == [eos]
    assert "appended" not in before
    # a vocabulary that cannot encode the probe tells nothing appended (its BOS was taken for one)
    probe_less = SimpleNamespace(encode=lambda text, special_tokens=True: [bos, eos][:2 * special_tokens])
    assert appended_tokens(probe_less) == []


def test_parquet_fine_tuning_records_are_read(tmp_path):
    """Found by review: a Parquet file of prompt/completion or messages columns (most Hub
    fine-tuning sets) was refused for lacking a text column, the error advising a --text-field that
    then failed on the list column; its rows are now fine-tuning records, as JSON Lines' are."""
    pairs = pa.table({"prompt": [f"What is {i} + {i}? " for i in range(12)],
                      "completion": [f"{2 * i}." for i in range(12)], "source": ["x"] * 12})
    pq.write_table(pairs, tmp_path / "pairs.parquet")
    result = prepare(PrepareOptions(inputs=[str(tmp_path / "pairs.parquet")], val_percent=0.0),
                     tmp_path / "out", progress=False)
    assert "mask_file" in result.manifest["splits"]["train"]["shards"][0]
    assert result.manifest["conversations"] == 0 and result.manifest["splits"]["train"]["documents"] == 12
    # bytes another tool wrote as a string that are not UTF-8: the row, in one line (found by review)
    prompts = pa.array([b"fine", b"caf\xe9"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"prompt": prompts, "completion": ["a", "b"]}), tmp_path / "latin1.parquet")
    with pytest.raises(DataError, match=r"latin1.parquet: row 1: not UTF-8 text \(.*\); re-encode its text"):
        prepare(PrepareOptions(inputs=[str(tmp_path / "latin1.parquet")], val_percent=0.0),
                tmp_path / "never", progress=False)
    model = make_model_dir(tmp_path / "model", "llama")
    chats = pa.table({"messages": [[{"role": "user", "content": f"{i} + {i}?"},
                                    {"role": "assistant", "content": f"{2 * i}."}] for i in range(12)]})
    pq.write_table(chats, tmp_path / "chats.parquet")
    chat = prepare(PrepareOptions(inputs=[str(tmp_path / "chats.parquet")], tokenizer=str(model),
                                  val_percent=0.0), tmp_path / "chat_out", progress=False)
    assert chat.manifest["conversations"] == 12


def test_a_template_that_renders_earlier_turns_otherwise_trains_the_last_turn(tmp_path, caplog):
    """Found by review: Qwen3's template drops the reasoning of earlier assistant turns from the
    whole, so no earlier turn is a prefix of it, and every multi-turn record was refused. Such a
    conversation now trains its last assistant turn, which renders the same in both, and the
    preparation says how many."""
    model = make_model_dir(tmp_path / "model", "llama")
    config = json.loads((model / "tokenizer_config.json").read_text())
    # an earlier assistant turn is marked [old] in the whole, not in a prefix that ends with it
    config["chat_template"] = ("{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[old] "
                               "{% endif %}{{ m.content }}\n{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    chats = [{"messages": [{"role": "user", "content": f"{i} + {i}?"},
                           {"role": "assistant", "content": "Sure."},
                           {"role": "user", "content": "So?"},
                           {"role": "assistant", "content": f"{2 * i}."}]} for i in range(6)]
    tokenizer = HFTokenizer(model)
    ids, mask, last_only = encode_chat(tokenizer, chats[0]["messages"])
    targets = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert last_only and targets.strip() == "0."
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        prepare(PrepareOptions(inputs=[str(tmp_path / "chats.jsonl")], tokenizer=str(model), val_percent=0.0),
                tmp_path / "out", progress=False)
    assert "6 of 6 conversations are trained on their last assistant turn alone" in caplog.text


def test_a_token_id_past_the_vocabulary_is_named_not_an_index_error(tmp_path):
    """A damaged shard whose ids pass the tokenizer's vocabulary went to the embedding: an
    IndexError from inside torch (a device-side assertion on a GPU; found by a trial). The batch
    that reads one names the dataset, the window and the fix."""
    from shardtrain.data.batches import TokenWindows
    from shardtrain.data.prepared import open_prepared

    (tmp_path / "a.txt").write_text("plain text " * 200)
    prepare(PrepareOptions(inputs=[str(tmp_path / "a.txt")], val_percent=0.0), tmp_path / "out",
            progress=False)
    shard = next((tmp_path / "out" / "train").glob("tokens-*.npy"))
    windows = TokenWindows(open_prepared(tmp_path / "out").train, 32, "the training data")
    assert windows.batch(np.array([0, 1])).inputs.max() < 256
    tokens = np.load(shard, mmap_mode="r+")
    tokens[40] = 300  # window 1's
    tokens.flush()
    windows = TokenWindows(open_prepared(tmp_path / "out").train, 32, "the training data")
    windows.batch(np.array([0, -1]))  # window 0 and padding: no such id
    with pytest.raises(DataError, match=r"the training data: token id 300 in window 1, and the tokenizer "
                                        r"it was prepared with has 256 ids: its files are damaged"):
        windows.batch(np.array([0, 1]))
