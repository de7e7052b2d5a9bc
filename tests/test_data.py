"""The corpus split and the global batch layout: deterministic and world-size invariant."""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from shardtrain.accelerator import pin_offloaded_memory
from shardtrain.checkpoint.state import TrainState
from shardtrain.config.loader import load_config
from shardtrain.config.plan import resolve_plan
from shardtrain.config.schema import DataConfig
from shardtrain.data.batches import (
    IGNORE_INDEX,
    Batch,
    BatchLayout,
    GlobalOrder,
    TokenWindows,
    TrainBatches,
    eval_batches,
    map_tensors,
)
from shardtrain.data.corpus import is_validation, load_corpus, stdlib_root
from shardtrain.errors import DataError


def test_stdlib_corpus_is_split_by_file_deterministically():
    a, b = load_corpus(DataConfig(max_bytes=3_000_000)), load_corpus(DataConfig(max_bytes=3_000_000))
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert a.train_files > 10 and a.val_files >= 1
    assert str(stdlib_root()) in a.root and "site-packages" not in a.describe()
    split = [is_validation(f"x/{i}.py", 5.0) for i in range(4000)]
    assert 0.03 < sum(split) / len(split) < 0.07


def test_the_validation_split_takes_exactly_its_share_of_buckets():
    """Found by review: 0.07 * 100 is 7.000000000000001 in floats, which let an eighth of the 10,000
    buckets in (0.07% held out 0.08%)."""
    key = next(f"k{i}" for i in range(100_000) if zlib.crc32(f"k{i}".encode()) % 10_000 == 7)
    assert not is_validation(key, 0.07) and is_validation(key, 0.08)
    assert is_validation(key, 100.0) and not is_validation(key, 0.0)


def test_an_interrupted_cache_entry_is_prepared_again(tmp_path, caplog):
    """A cache entry left without its manifest (a run killed while replacing it) is redone, not an
    error that needs the cache deleted by hand."""
    cfg = DataConfig(max_bytes=200_000, val_percent=30.0, cache_dir=str(tmp_path / "cache"))
    first = load_corpus(cfg)
    tokens = np.array(first.train)  # read now: the entry is about to be half deleted
    entry = Path(first.path)
    (entry / "manifest.json").unlink()
    shutil.rmtree(entry / "train")  # what a deletion killed half-way leaves
    again = load_corpus(cfg)
    assert "unfinished preparation" in caplog.text and np.array_equal(tokens, np.array(again.train))
    assert not list(entry.parent.glob(".*.replaced"))


def test_files_source_errors_are_clear(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(DataConfig(source="files", paths=[str(tmp_path / "missing")]))
    (tmp_path / "only.txt").write_text("hello")
    with pytest.raises(DataError, match="has no files matching '\\*.py'"):
        load_corpus(DataConfig(source="files", paths=[str(tmp_path)], cache_dir=str(tmp_path / "c")))
    with pytest.raises(DataError, match="validation documents"):
        load_corpus(DataConfig(source="files", paths=[str(tmp_path)], val_percent=0.0, file_glob="*",
                               cache_dir=str(tmp_path / "c")))
    with pytest.raises(DataError, match="trainer.seq_len"):
        TokenWindows(np.zeros(10, dtype=np.uint8), seq_len=64)


def global_step_ids(world: int, micro: int, accum: int, steps: int) -> list[list[int]]:
    """The sample ids each step consumes, gathered over all ranks (as rows of inputs)."""
    tokens = np.arange(2000, dtype=np.int64) % 256
    windows = TokenWindows(tokens.astype(np.uint8), seq_len=8)
    layout = BatchLayout(micro, accum, world)
    loaders = [TrainBatches(windows, layout, rank, seed=3) for rank in range(world)]
    per_step = []
    for _ in range(steps):
        ids = []
        for loader in loaders:
            micro_batches = loader.next_step()
            assert len(micro_batches) == accum  # the same count on every rank, by construction
            # window start / 8
            ids += [int(row[0]) // 8 for batch in micro_batches for row in batch.inputs]
        per_step.append(sorted(ids))
    return per_step


def test_global_batch_is_the_same_set_at_any_split():
    reference = global_step_ids(world=1, micro=8, accum=1, steps=30)
    for world, micro, accum in [(2, 4, 1), (2, 2, 2), (4, 1, 2), (4, 2, 1)]:
        assert global_step_ids(world, micro, accum, steps=30) == reference


def test_global_order_covers_every_sample_each_epoch():
    order = GlobalOrder(num_samples=37, seed=1)
    first, second = order.take(0, 37), order.take(37, 37)
    assert sorted(first) == list(range(37)) == sorted(second)
    assert not np.array_equal(first, second)
    assert np.array_equal(order.take(30, 14), np.concatenate([first[30:], second[:7]]))


def test_eval_batches_pad_with_ignored_rows():
    windows = TokenWindows(np.arange(500, dtype=np.int64).astype(np.uint8), seq_len=10)
    one = eval_batches(windows, 13, micro_batch_size=4, dp_world_size=1, rank=0)
    three = [eval_batches(windows, 13, micro_batch_size=4, dp_world_size=3, rank=r) for r in range(3)]
    assert len({len(b) for b in three}) == 1  # every rank runs as many forwards
    count = lambda batches: sum(int((b.targets != IGNORE_INDEX).sum()) * w for b, w in batches)  # noqa: E731
    assert count(one) == 13 * 10 == sum(count(b) for b in three)
    # the third rank's second batch is only padding: it runs its forward and weighs nothing
    assert [w for _, w in three[2]] == [1.0, 0.0]
    # Collated when read (a large validation set is not held collated for the whole run), but the
    # first at once, so that a data error shows at start-up; reading twice gives the same batches.
    calls = []
    counted = SimpleNamespace(num_samples=windows.num_samples,
                              batch=lambda ids: calls.append(len(ids)) or windows.batch(ids))
    lazy = eval_batches(counted, 13, micro_batch_size=4, dp_world_size=1, rank=0)
    assert len(lazy) == 4 and calls == [4]
    again = [(b.inputs.clone(), w) for b, w in lazy]
    assert len(calls) == 5
    assert all(x.equal(b.inputs) and w == v for (x, w), (b, v) in zip(again, one, strict=True))


def test_global_order_is_a_permutation_per_epoch_without_storing_one():
    """Every epoch visits each sample once, in a seeded order that changes per epoch and seed; the
    id at any position of a billion-sample order is computed directly (nothing is stored)."""
    for n in (1, 2, 3, 7, 100, 4097):
        order = GlobalOrder(n, seed=5)
        epochs = [order.take(e * n, n) for e in range(3)]
        assert all(sorted(ids.tolist()) == list(range(n)) for ids in epochs)
        if n > 10:
            assert not np.array_equal(epochs[0], epochs[1])
            assert not np.array_equal(epochs[0], GlobalOrder(n, seed=6).take(0, n))
        if n >= 2:  # the end of one epoch and the start of the next
            across = order.take(n - 2, 4)
            assert across.tolist() == epochs[0][-2:].tolist() + epochs[1][:2].tolist()
    huge = GlobalOrder(10**9, seed=1)
    assert huge.take(123_456_789, 3).tolist() == [huge.take(123_456_789 + k, 1)[0] for k in range(3)]
    assert ((huge.take(0, 1000) >= 0) & (huge.take(0, 1000) < 10**9)).all()
    # The order itself, pinned: every saved run's position means these ids (the epochs' keys computed
    # in one pass since 2026-11-30, found by review 200x faster over thousands of epochs a step,
    # gave the same ids as one pass an epoch)
    assert GlobalOrder(10, seed=5).take(0, 25).tolist() == [0, 5, 2, 8, 6, 4, 7, 1, 3, 9, 0, 1, 7, 4, 2, 9,
                                                            8, 3, 5, 6, 5, 4, 3, 2, 1]
    assert huge.take(10**12, 4).tolist() == [322899586, 464504087, 866015343, 691194761]


def test_prefetched_batches_are_the_positions_batches():
    """Batches made ahead in the background are exactly those of their position, also after the
    position is set from a checkpoint (what was made ahead for another position is discarded)."""
    windows = TokenWindows((np.arange(5000, dtype=np.int64) % 251).astype(np.uint16), seq_len=16)
    layout = BatchLayout(2, 2, 2)
    ahead, plain = (TrainBatches(windows, layout, 1, seed=3, prefetch=p) for p in (True, False))
    for _ in range(3):
        for a, p in zip(ahead.next_step(), plain.next_step(), strict=True):
            assert torch.equal(a.inputs, p.inputs) and torch.equal(a.targets, p.targets)
    ahead.consumed_samples = plain.consumed_samples = 40  # a resume elsewhere
    for a, p in zip(ahead.next_step(), plain.next_step(), strict=True):
        assert torch.equal(a.inputs, p.inputs) and torch.equal(a.targets, p.targets)
    assert ahead.wait_s >= 0 and ahead.consumed_samples == 48
    ahead.close()
    assert len(ahead.next_step()) == 2  # still works, without prefetching


def test_batches_are_pinned_in_the_data_thread_only_for_accelerators():
    """Pinning (so the step's non_blocking copies are asynchronous on CUDA) maps every tensor of any
    batch structure and keeps its types; a CPU run pins nothing (pinning needs an accelerator)."""
    batch = {"x": (torch.zeros(2), [torch.ones(1), 3]), "lm": Batch(torch.zeros(1, 2), torch.ones(1, 2))}
    mapped = map_tensors(batch, lambda t: t + 1)
    assert isinstance(mapped["lm"], Batch) and torch.equal(mapped["lm"].inputs, torch.ones(1, 2))
    assert mapped["lm"].positions is None and mapped["x"][1][1] == 3 and isinstance(mapped["x"], tuple)
    assert torch.equal(mapped["x"][0], torch.ones(2))
    assert pin_offloaded_memory("cuda") and not pin_offloaded_memory("cpu")
    windows = TokenWindows((np.arange(5000, dtype=np.int64) % 251).astype(np.uint16), seq_len=16)
    pinned = TrainBatches(windows, BatchLayout(2, 1, 1), 0, seed=3, pin_memory=True)
    if torch.accelerator.is_available():  # never true on this project's CI machines
        assert all(t.is_pinned() for t in pinned.next_step()[0][:2])
    else:
        with pytest.raises(RuntimeError, match="accelerator"):  # torch refuses, as the trainer knows
            pinned.next_step()


def test_a_resume_names_the_settings_that_change_the_data_order(tmp_path):
    """The saved position means the same samples only under the same order: a resume compares the
    settings that decide it (and only those: the batch split and document masking do not)."""
    saved = load_config([])
    state = TrainState.capture(saved, resolve_plan(saved.strategy, 1, 1), requested_hash="", step=3,
                               tokens_seen=0, consumed_samples=48, global_batch=16, scheduler={},
                               world_size=1)
    same_order = load_config(["trainer.micro_batch_size=4", "trainer.grad_accum_steps=4",
                              "data.document_mask=true"])
    assert state.data_order_changes(same_order) == []
    # The same settings over changed data (found by review: no word, and the order was another)
    state.train_samples = 1000
    assert state.data_order_changes(same_order, 1000) == []
    assert state.data_order_changes(same_order, 1200) == [
        "training samples 1000 -> 1200 (the data changed since the save)"]
    # ... but a changed window length explains a new count (a new-user trial was told the data changed)
    other = load_config(["trainer.seq_len=256", "data.max_bytes=1000"])
    assert state.data_order_changes(other, 500) == ["trainer.seq_len 128 -> 256", "data.max_bytes 0 -> 1000",
                                                    "training samples 1000 -> 500 (from the settings above)"]
    # data.packing as it resolved: auto is records for fine-tuning data, no change; a checkpoint
    # from before the key cut every dataset as a stream (found by the diff review: raw values
    # compared, auto -> records was a change, and an old run's stream -> records none)
    assert state.data_order_changes(same_order, 1000, "records") == []  # saved auto
    # ... auto as it resolved then, where the checkpoint records it (found by a trial: auto ->
    # records on plain text was "the data changed since the save")
    state.train_packing = "stream"
    assert state.data_order_changes(same_order, 1300, "records") == [
        "data.packing stream -> records (windows of whole records now)",
        "training samples 1000 -> 1300 (from the settings above)"]
    assert state.data_order_changes(same_order, 1000, "stream") == []
    state.train_packing = None
    state.config["data"]["packing"] = "stream"
    assert state.data_order_changes(same_order, 1000, "stream") == []
    del state.config["data"]["packing"]
    assert state.data_order_changes(same_order, 1400, "records") == [
        "data.packing stream -> records (windows of whole records now; runs saved before data.packing "
        "cut a stream: set data.packing=stream to go on as it trained)",
        "training samples 1000 -> 1400 (from the settings above)"]
    # A mixture's datasets each: two may change with their sum the same (found by review: no word)
    state.train_part_samples = [600, 400]
    assert state.data_order_changes(same_order, 1000, None, [600, 400]) == []
    assert state.data_order_changes(same_order, 1000, None, [700, 300]) == [
        "training samples of each dataset [600, 400] -> [700, 300] (the data changed since the save)"]
    assert state.data_order_changes(same_order, 1000, None, None) == []  # no longer a mixture: its keys say
    state.train_part_samples = None  # one dataset, or a checkpoint from before the counts were kept
    assert state.data_order_changes(same_order, 1000, None, [700, 300]) == []
    state.train_samples = None  # a checkpoint from before the count was kept
    assert state.data_order_changes(same_order, 1200) == []
    assert state.data_order_changes(other) == ["trainer.seq_len 128 -> 256", "data.max_bytes 0 -> 1000"]
    # A prepared dataset is read as it is: the preparing settings no longer matter.
    prepared = load_config(["data.source=prepared", f"data.paths=[{tmp_path}]", "data.weights=[1.0]"])
    prepared.data.max_bytes = 1000  # as a preset may set it (given as an override, it is refused)
    del state.config["data"]["weights"]  # a checkpoint from before the key existed
    assert state.data_order_changes(prepared) == ["data.source 'stdlib' -> 'prepared'",
                                                  f"data.paths [] -> [{str(tmp_path)!r}]"]
    # A task's options are named one by one, as they are set (found by a user trial: both whole
    # dictionaries, in different key orders); those that may shape the model name a misfit too.
    state.config["task"] = {"path": "tabreg:Regression", "options": {"hidden": 64, "train_samples": 2048}}
    task = load_config([])
    task.task.path, task.task.options = "tabreg:Regression", {"train_samples": 1024, "hidden": 32}
    assert state.data_order_changes(task) == ["task.hidden 64 -> 32", "task.train_samples 2048 -> 1024"]
    task.model.dim = 128
    task.finetune.rank = 8  # a LoRA run's adapters are shaped by it (found by a review of the fix)
    assert state.model_changes(task) == ("; it was saved with other settings: model.dim 256 -> 128, "
                                         "finetune.rank 16 -> 8, task.hidden 64 -> 32, "
                                         "task.train_samples 2048 -> 1024")
    del state.config["task"]
    assert state.model_changes(load_config(["model.init_from=/elsewhere"])) == ""  # shapes nothing
