"""A prepared dataset's open files (issue 23, finding 6): a process holds a bounded number of shard
files open, whatever the number of shards, and opening a dataset opens none of them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from shardtrain.data.batches import IGNORE_INDEX, GlobalOrder, TokenWindows
from shardtrain.data.prepare import PrepareOptions, prepare
from shardtrain.data.prepared import OPEN_SHARD_FILES, open_prepared
from shardtrain.data.tokenizer import ByteTokenizer
from shardtrain.errors import DataError

SEQ_LEN = 16


def open_files_under(root: Path) -> int:
    """This process's open descriptors of files inside ``root`` (memory maps hold one each)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(f"{root}/")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return count


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def make_dataset(root: Path, documents: int) -> Path:
    """``documents`` JSON Lines records, one shard each: every third a prompt/completion pair, so
    shards with and without target masks alternate."""
    records = [{"prompt": f"Q{i}: what is {i}?", "completion": f" {i}" * (1 + i % 5)} if i % 3 == 0
               else {"text": f"document {i}: " + "word " * (5 + i % 11)} for i in range(documents)]
    source = root / f"records-{documents}.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = root / f"prepared-{documents}"
    prepare(PrepareOptions(inputs=[str(source)], val_percent=10.0, shard_tokens=8), out, progress=False)
    return out


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("handles")
    return {n: make_dataset(root, n) for n in (50, 400)}


def read_everything(path: Path) -> tuple[int, int, int]:
    """Every window of both splits, in the training order, with document masking (tokens, document
    starts and target masks all read); the most shard files and descriptors open at once, and the
    targets seen (to show the masks were read)."""
    dataset = open_prepared(path)
    most_files, most_fds, targets = 0, 0, 0
    for split in (dataset.train, dataset.val):
        windows = TokenWindows(split, SEQ_LEN, document_mask=True)
        order = GlobalOrder(windows.num_samples, seed=3).take(0, windows.num_samples)
        for ids in np.array_split(order, max(1, len(order) // 8)):
            batch = windows.batch(ids)
            targets += int((batch.targets != IGNORE_INDEX).sum())
            most_files = max(most_files, open_files_under(path))
            most_fds = max(most_fds, open_descriptors())
    return most_files, most_fds, targets


def test_open_files_do_not_grow_with_the_number_of_shards(datasets):
    """Reading every window of a 400-shard dataset (about 1,000 shard files) keeps at most
    OPEN_SHARD_FILES of them open, as a 50-shard dataset does; before, every file stayed open."""
    files = {n: len(list(path.rglob("*.npy"))) for n, path in datasets.items()}
    assert files[400] > 3 * OPEN_SHARD_FILES  # the bound is far below what there is to open
    before = open_descriptors()
    peaks = {n: read_everything(path) for n, path in datasets.items()}
    print(f"shard files open at most: {peaks[50][0]} of {files[50]} (50 shards), "
          f"{peaks[400][0]} of {files[400]} (400 shards); process descriptors {before} before, "
          f"at most {peaks[50][1]} and {peaks[400][1]}")
    for n in datasets:
        most_files, most_fds, targets = peaks[n]
        assert 0 < most_files <= OPEN_SHARD_FILES and targets > 0, (n, peaks[n])
        # The dataset's directory adds one descriptor; nothing else grows with the shards.
        assert most_fds <= before + OPEN_SHARD_FILES + 1, (n, before, peaks[n])
    # Files are closed once their dataset is dropped: nothing stays open between datasets.
    assert open_files_under(datasets[50]) == open_files_under(datasets[400]) == 0


OPENS = """
import json, sys
from shardtrain.data.prepared import open_prepared
root = sys.argv[1]
opened = []
# Shards may be opened by a path relative to the dataset's directory: match their names.
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open"
                 and str(args[0]).endswith((".npy", ".json")) else None)
dataset = open_prepared(root)
print(json.dumps({"opened": opened, "tokens": len(dataset.train) + len(dataset.val),
                  "documents": dataset.train.documents + dataset.val.documents}))
"""


def test_opening_a_dataset_opens_no_shard(datasets):
    """Start-up reads the manifest only: sizes, offsets and the dtype come from it, so a run's ranks
    do not each open every shard file on the filesystem's metadata server."""
    path = datasets[400]
    done = subprocess.run([sys.executable, "-c", OPENS, str(path)], capture_output=True, text=True,
                          check=True)
    seen = json.loads(done.stdout)
    assert seen["opened"] == [str(path / "manifest.json")], seen["opened"][:5]
    manifest = json.loads((path / "manifest.json").read_text())
    assert seen["tokens"] == sum(manifest["splits"][s]["tokens"] for s in ("train", "val"))
    assert seen["documents"] == 400


def test_shards_read_late_are_still_checked(datasets, tmp_path):
    """Offsets come from the manifest and shards are mapped only when read, so each is checked
    against the manifest then; a missing target mask is found at start-up like the other files; a
    dataset prepared again under a reader is an error, never a mix of two preparations."""
    path = shutil.copytree(datasets[50], tmp_path / "copy")
    shards = json.loads((path / "manifest.json").read_text())["splits"]["train"]["shards"]
    first, masked = shards[0]["tokens_file"], next(s["mask_file"] for s in shards if "mask_file" in s)
    np.save(path / first, np.load(path / first)[:-1])
    truncated = open_prepared(path)
    with pytest.raises(DataError, match=f"{first} holds {shards[0]['tokens'] - 1} values of uint16 but "
                                        f"manifest.json says {shards[0]['tokens']} of uint16; prepare"):
        truncated.train[0:1]
    os.remove(path / masked)
    with pytest.raises(DataError, match=f"incomplete: {masked} missing; prepare it again"):
        open_prepared(path)

    again = shutil.copytree(datasets[50], tmp_path / "again")
    reader = open_prepared(again)
    shutil.rmtree(again)
    shutil.copytree(datasets[50], again)  # the same names, other files
    with pytest.raises(DataError, match=f"{first} is gone .*prepared again while this process read it"):
        reader.train[0:1]
    assert np.array_equal(open_prepared(again).train, open_prepared(datasets[50]).train)


def test_a_tokenizer_with_another_end_of_text_is_warned_about(datasets, caplog):
    """Found by review: one tokenizer.json with two end-of-text ids (a base model's and its instruct
    model's) passed the vocabulary check in silence; the model then learns one separator and
    generation stops at the other."""
    made_with = ByteTokenizer()
    open_prepared(datasets[50], made_with)
    assert "ends its documents" not in caplog.text
    other = SimpleNamespace(name=made_with.name, vocab_size=made_with.vocab_size, eos_id=7)
    open_prepared(datasets[50], other)
    assert ("ends its documents with no end-of-text token but the model's tokenizer ends text with "
            "token 7") in caplog.text
