"""Checkpoints: exact resume, resharding resume, consolidation, init_from (spawned gloo ranks)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from checkpoint_workers import (
    N,
    exact_resume,
    init_from,
    resume_elsewhere,
    sample_ids_match,
    save_at_four,
)
from distributed import run_on_ranks
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from shardtrain.checkpoint import layout, staging
from shardtrain.checkpoint.checkpointer import random_streams_kept, seed_random_streams
from shardtrain.checkpoint.inspect import inspect_path
from shardtrain.checkpoint.state import STATE_FILE, TrainState
from shardtrain.checkpoint.weights import resolved_once
from shardtrain.cli.preflight import check_resume
from shardtrain.config.compose import config_hash, config_hash_within
from shardtrain.config.schema import Config, ModelConfig
from shardtrain.distributed.agreement import raise_first_error
from shardtrain.errors import CheckpointError
from shardtrain.export.consolidate import consolidate
from shardtrain.export.hf import export_hf


def test_exact_resume_is_bitwise_identical(tmp_path):
    run_on_ranks(exact_resume, 2, str(tmp_path), tmp_path=tmp_path)
    full, split = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "split.pt")
    assert len(full["losses"]) == 2 * N
    assert split["losses"] == full["losses"]  # every step, bit for bit
    for name, w in full["weights"].items():
        assert torch.equal(split["weights"][name], w), name
    from_async = torch.load(tmp_path / "from_async.pt")
    assert from_async["losses"] == full["losses"][N:]
    assert all(torch.equal(from_async["weights"][k], w) for k, w in full["weights"].items())
    # the step-N checkpoint of the uninterrupted run is complete and describes itself
    state = json.loads((tmp_path / "full/checkpoints" / f"step-{N}" / "trainer_state.json").read_text())
    assert state["step"] == N and state["world_size"] == 2 and state["strategy"] == "FULL_SHARD"
    assert state["consumed_samples"] == N * 8 and state["config_hash"]
    assert state["versions"]["torch"] == torch.__version__


@pytest.fixture(scope="module")
def four_rank_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    run_on_ranks(save_at_four, 4, str(out), tmp_path=out)
    return out


def test_checksum_work_is_split_between_ranks(four_rank_checkpoint):
    """Committing a save and verifying it for a resume read about 1/4 of the checkpoint on each of
    4 ranks (rank 0 alone hashed every file at commit, and every rank every file at resume)."""
    ckpt = four_rank_checkpoint / "first4" / "checkpoints" / f"step-{N}"
    recorded = json.loads((ckpt / "checksums.json").read_text())["files"]
    total = sum(entry["bytes"] for entry in recorded.values())
    reads = torch.load(four_rank_checkpoint / "hash_reads4.pt")  # [rank, (commit, verify)]
    for phase, per_rank in zip(("commit", "verify"), reads.T.tolist(), strict=True):
        # all of it read once between them; no rank much above its quarter (four equal shard files)
        assert sum(per_rank) >= total and max(per_rank) < 0.4 * total, (phase, per_rank, total)


def test_resume_checks_each_shard_file_on_one_rank(four_rank_checkpoint):
    """The structure check of a resume stats a rank's share of the 4 shard files (its round-robin
    part, and the files it hashes), not all 4 on every rank (1,024 x 1,024 stats at 1,024 ranks);
    between them the ranks check every one (a missing one is named: save_at_four)."""
    stated = json.loads((four_rank_checkpoint / "shard_stats4.json").read_text())
    assert all(len(names) <= 2 for names in stated), stated
    assert {name for names in stated for name in names} == {f"__{r}_0.distcp" for r in range(4)}


def test_checkpoint_group_connects_ranks_on_first_use(four_rank_checkpoint):
    """A full-mesh gloo group opens a socket to every peer when it is made (3 at 4 ranks, 1,023 at
    1,024); the checkpoint group's kind opens none of them until a collective needs a pair (both
    open one more socket of their own), and a gather connects no more pairs than the mesh holds."""
    counts = json.loads((four_rank_checkpoint / "group_sockets.json").read_text())
    for rank, ((mesh_created, mesh_used), (lazy_created, lazy_used)) in enumerate(counts):
        assert mesh_created == mesh_used, (rank, counts)
        assert mesh_created - lazy_created == 3, (rank, counts)
        assert lazy_created < lazy_used <= mesh_used, (rank, counts)


@pytest.mark.parametrize(("world", "strategy", "accum"), [(2, "SHARD_GRAD_OP", 2), (2, "NO_SHARD", 1)])
def test_resume_at_another_world_size_and_strategy(four_rank_checkpoint, world, strategy, accum):
    out = four_rank_checkpoint
    run_on_ranks(resume_elsewhere, world, str(out), strategy, accum, tmp_path=out)
    full, first = torch.load(out / "full4.pt"), torch.load(out / "first4.pt")
    resumed = torch.load(out / f"resumed{world}-{strategy}.pt")
    # Under NO_SHARD both ranks are replicas: the second reads none of the model's and optimizer's
    # tensors (found by review: every replica read them all), and resumes all the same (below); nor
    # of the weight average's, at a resume of the run's final checkpoint and read into the weights
    # as eval --ema and model.init_from read (each rank's average, and weights, then the saved
    # average: checked on the ranks)
    reads = json.loads((out / f"resumed{world}-{strategy}-reads.json").read_text())
    if strategy == "NO_SHARD":
        assert all(count > 0 for count in reads[0]) and reads[1] == [0, 0, 0], reads
    else:
        assert all(rank_reads[0] > 0 for rank_reads in reads), reads
    assert first["losses"] == full["losses"][:N]
    for got, want in zip(resumed["losses"], full["losses"][N:], strict=True):
        assert abs(got - want) / want < 1e-5  # fp32 tolerance: the reduction order changed
    for name, w in full["weights"].items():
        assert ((resumed["weights"][name] - w).norm() / w.norm()).item() < 1e-5, name
    # no sample repeated or skipped across the change of world size and batch split
    sample_ids_match([first["ids"], resumed["ids"]], full["ids"])


def test_consolidation_is_bitwise_and_init_from_loads_it(four_rank_checkpoint, tmp_path, monkeypatch):
    """One file is streamed a group of tensors at a time, as shards are (found by review: one file
    held the whole model in memory, 280 GB for a 70B); safetensors reads what it writes."""
    import shardtrain.export.consolidate as consolidation

    out = four_rank_checkpoint
    ckpt = out / "full4" / "checkpoints" / f"step-{2 * N}"
    gathered = torch.load(out / "full4.pt")["weights"]
    groups, read = [], consolidation.load_tensors
    monkeypatch.setattr(consolidation, "READ_BYTES", 8 * 2**10)
    monkeypatch.setattr(consolidation, "load_tensors", lambda path, entries, metadata: (
        groups.append(sum(m.size.numel() * m.properties.dtype.itemsize for _, _, m in entries)
                      if len(entries) > 1 else 0), read(path, entries, metadata))[1])
    single = consolidate(ckpt, tmp_path / "one" / "model.safetensors")
    assert len(groups) > 3 and max(groups) <= 8 * 2**10, groups  # (0: a tensor alone)
    monkeypatch.undo()
    assert [p.name for p in single] == ["model.safetensors"]
    weights = load_file(single[0])
    assert weights.keys() == gathered.keys()
    assert all(torch.equal(weights[k], gathered[k]) for k in gathered)
    # In the library's order (larger items first, then names), not DCP's
    raw = single[0].read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    header.pop("__metadata__")
    assert sorted(header, key=lambda name: header[name]["data_offsets"]) == sorted(header)

    files = consolidate(ckpt, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted({f for f in index["weight_map"].values()})
    assert len(shards) > 2 and shards == sorted(p.name for p in files if p.suffix == ".safetensors")
    assert all(f"-of-{len(shards):05d}" in s for s in shards)
    merged = {}
    for shard in shards:
        part = load_file(tmp_path / "sharded" / shard)
        assert all(index["weight_map"][k] == shard for k in part)
        merged.update(part)
    assert merged.keys() == gathered.keys()
    assert all(torch.equal(merged[k], gathered[k]) for k in gathered)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    # One of those files is no whole model, though it names one (found by review: exported as one)
    with pytest.raises(CheckpointError, match=r"lacks \d+ of the model's tensors .*: one file of a sharded "
                                              r"consolidation\?"):
        export_hf(tmp_path / "sharded" / shards[0], tmp_path / "one_shard")
    assert not (tmp_path / "one_shard").exists()

    bf16 = load_file(consolidate(ckpt, tmp_path / "bf16.safetensors", dtype="bf16")[0])
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())

    # Never written over or beside an earlier export's files (a reader would take theirs)
    index = (tmp_path / "sharded" / "model.safetensors.index.json").read_text()
    for out, message in ((tmp_path / "sharded", "already holds model files (model-00001-of-"),
                         (tmp_path / "one", "already holds model files (model.safetensors)"),
                         (single[0], "already exists; choose a new file name"),
                         (tmp_path / "sharded" / "model.safetensors",
                          "already holds model.safetensors.index.json"),
                         # found by the walkthrough: a checkpoint's rng-rank0.pt named "model files"
                         (ckpt, f"output directory {ckpt} is a checkpoint, whose files the export's")):
        with pytest.raises(CheckpointError, match=re.escape(message)):
            consolidate(ckpt, out, max_shard_size="20KB" if out.suffix != ".safetensors" else None)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").read_text() == index
    assert not (tmp_path / "sharded" / "model.safetensors").exists()

    # model.init_from: from the safetensors file at 2 NO_SHARD ranks (the second reads none of it,
    # found by review: every replica read the whole file), from the DCP directory at 1 rank, through
    # a link moved to an empty directory once the checkpoint was checked
    run_on_ranks(init_from, 2, str(tmp_path), str(single[0]), "NO_SHARD", tmp_path=tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "best").symlink_to(ckpt)
    run_on_ranks(init_from, 1, str(tmp_path), str(tmp_path / "best"), tmp_path=tmp_path)
    assert (tmp_path / "best").resolve() == tmp_path / "elsewhere"  # it was moved
    # a file's link (a Hugging Face snapshot's model.safetensors, a link to a hash-named blob) keeps
    # its name, which says what it is (found by review: resolved to the blob, it was "nothing")
    (tmp_path / "blob").symlink_to(single[0])
    (tmp_path / "linked.safetensors").symlink_to(tmp_path / "blob")
    assert resolved_once(tmp_path / "linked.safetensors") == tmp_path.resolve() / "linked.safetensors"
    assert resolved_once(tmp_path / "best") == (tmp_path / "elsewhere").resolve()
    for world in (2, 1):
        loaded = torch.load(tmp_path / f"init{world}.pt")
        assert all(torch.equal(loaded[k], gathered[k]) for k in gathered)


def test_a_streamed_file_holds_every_dtype_aligned(tmp_path):
    """consolidate's own safetensors writer: every dtype the format holds (torchtitan keeps a complex
    freqs_cis; float8 and unsigned weights exist), odd sizes, 0-d, empty and non-contiguous tensors,
    read back by the library; in the library's order, each offset a multiple of its item size
    (found by review: DCP's order put an fp32 after 3 bf16 values, which zero-copy readers refuse)."""
    from safetensors.torch import load_file

    from shardtrain.checkpoint.safetensors_files import DTYPES, file_order_key, write_streamed

    tensors = {"odd_bf16": torch.randn(3).bfloat16(), "scalar_bf16": torch.tensor(0.5).bfloat16(),
               "flag": torch.tensor([True]), "empty": torch.zeros(0, 4), "steps": torch.arange(3),
               "freqs": torch.polar(torch.ones(5), torch.arange(5.0)),
               "ids": torch.arange(7).to(torch.uint16), "scaled": torch.randn(6).to(torch.float8_e4m3fn),
               "columns": torch.randn(4, 6).t()}
    names = sorted(tensors, key=lambda name: file_order_key(name, tensors[name].dtype))
    target = tmp_path / "m.safetensors"
    write_streamed(target, [(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names], {"format": "pt"},
                   iter([(n, tensors[n]) for n in names]))
    read = load_file(target)
    assert read.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape, name
        assert read[name].reshape(-1).view(torch.uint8).equal(tensor.reshape(-1).view(torch.uint8)), name
    header = json.loads(target.read_bytes()[8:8 + int.from_bytes(target.read_bytes()[:8], "little")])
    for name, entry in header.items():
        if name != "__metadata__":
            assert entry["data_offsets"][0] % DTYPES[entry["dtype"]].itemsize == 0, (name, entry)
    # A write the filesystem refuses names the file (found by a trial: consolidate out of space said
    # "[Errno 28] No space left on device" and no path; here the file size limit, as real a refusal).
    import errno
    import resource
    import signal

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing us
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
        with pytest.raises(OSError) as refused:
            write_streamed(tmp_path / "big.safetensors", [("w", torch.float32, (4096,))], {"format": "pt"},
                           iter([("w", torch.zeros(4096))]))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert refused.value.errno == errno.EFBIG and refused.value.filename == str(tmp_path / "big.safetensors")
    assert not (tmp_path / "big.safetensors").exists() and not (tmp_path / "big.safetensors.tmp").exists()
    # A disk already full: the bytes stay in the buffer, and close's retry of them must not replace
    # the named error with an unnamed one (found by review); /dev/full refuses every write.
    if Path("/dev/full").exists():
        (tmp_path / "full.safetensors.tmp").symlink_to("/dev/full")
        with pytest.raises(OSError) as full:
            write_streamed(tmp_path / "full.safetensors", [("w", torch.float32, (4,))], {"format": "pt"},
                           iter([("w", torch.zeros(4))]))
        assert full.value.errno == errno.ENOSPC and full.value.filename == str(tmp_path / "full.safetensors")
    with pytest.raises(CheckpointError, match="which safetensors files cannot hold"):
        write_streamed(tmp_path / "c.safetensors", [("z", torch.complex128, (1,))], {}, iter([]))
    assert not list(tmp_path.glob("c.safetensors*"))


def lightning_checkpoint(path, layout: str, tensors: dict[str, torch.Tensor]) -> None:
    """A sharded checkpoint in Lightning's layout: DCP files + .metadata + meta.pt."""
    import torch.distributed.checkpoint as dcp

    moments = {k: {"exp_avg": torch.zeros_like(v)} for k, v in tensors.items()}
    if layout == "trainer":  # LightningModule weights under state_dict., compiled model
        state = {"state_dict": {f"model._orig_mod.{k}": v for k, v in tensors.items()},
                 "optimizer_states": {"0": {"state": moments}}}
    else:  # Fabric: the user's own keys
        state = {"model": dict(tensors), "optimizer": {"state": moments}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    torch.save({"global_step": 7, "epoch": 1, "pytorch-lightning_version": "2.5.0"}, path / "meta.pt")


@pytest.mark.parametrize(("layout", "prefix"), [("trainer", "model."), ("fabric", "")])
def test_consolidate_lightning_sharded_checkpoint(tmp_path, layout, prefix):
    from cli_utils import run_cli

    tensors = {"layer.weight": torch.randn(6, 5), "layer.bias": torch.randn(6),
               "head.weight": torch.randn(3, 6).to(torch.bfloat16),
               "norm.num_batches_tracked": torch.tensor(123456789), "ids": torch.arange(300, 310)}
    ckpt = tmp_path / "last.ckpt"
    lightning_checkpoint(ckpt, layout, tensors)
    files = consolidate(ckpt, tmp_path / "out")
    weights = load_file(files[0])
    assert set(weights) == {prefix + k for k in tensors}  # no optimizer state, no _orig_mod.
    assert all(torch.equal(weights[prefix + k], v) for k, v in tensors.items())
    # --dtype casts the floating-point tensors only; integers keep their values, and the index
    # counts each tensor's bytes in the dtype it is written in
    files = consolidate(ckpt, tmp_path / "bf16", dtype="bf16", max_shard_size="100B")
    cast = {k: v for f in files if f.suffix == ".safetensors" for k, v in load_file(f).items()}
    for name, v in tensors.items():
        written = cast[prefix + name]
        assert written.dtype == (torch.bfloat16 if v.is_floating_point() else v.dtype), name
        assert v.is_floating_point() or torch.equal(written, v), name
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in cast.values())
    # a quoted ~ is the home directory, as the path is read (found by review: "does not exist")
    report = run_cli("inspect", f"~/{ckpt.name}", env={"HOME": str(ckpt.parent)})
    assert report.returncode == 0, report.stdout + report.stderr
    assert "Lightning sharded checkpoint" in report.stdout and "global step: 7" in report.stdout


def test_metadata_that_is_not_dcps_is_a_checkpoint_error(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"not": "dcp"}))
    with pytest.raises(CheckpointError, match="holds a dict, not DCP's Metadata"):
        layout.verify(tmp_path, need_state=False)
    with pytest.raises(CheckpointError, match="holds a dict, not DCP's Metadata"):
        consolidate(tmp_path, tmp_path.parent / "out")
    report = inspect_path(tmp_path)
    assert not report.complete and "holds a dict, not DCP's Metadata" in report.render()


class RunsCode:
    """What a tampered .metadata could hold: unpickling it runs a command."""

    def __init__(self, marker: os.PathLike) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_metadata_that_would_run_code_is_refused_unrun(tmp_path):
    checkpoint, marker = tmp_path / "checkpoint", tmp_path / "ran"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    refused = f"names {os.system.__module__}.system, which DCP's metadata does not hold"
    with pytest.raises(CheckpointError, match=refused):
        layout.verify(checkpoint, need_state=False)
    with pytest.raises(CheckpointError, match=refused):
        consolidate(checkpoint, tmp_path / "out")
    assert refused in inspect_path(checkpoint).render()
    assert not marker.exists()
    # ... nor does a non-tensor entry of a shard file (found by review: DCP's planner unpickles them
    # with weights_only=False at resume)
    tampered = io.BytesIO()
    torch.save(RunsCode(marker), tampered)
    tampered.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="system"):
        layout.WeightsOnlyLoadPlanner().load_bytes(None, tampered)
    assert not marker.exists()


def test_metadata_written_by_python_3_13_reads(tmp_path):
    """Python 3.13 pickles paths (DCP's checkpoint id) from pathlib._local (found by review: every
    checkpoint a 3.13 interpreter saved was refused)."""
    metadata = Metadata(state_dict_metadata={}, storage_meta=StorageMeta(checkpoint_id=Path("/runs/step-2")))
    written = pickle.dumps(metadata, protocol=2)  # globals as text lines, no frames to resize
    assert b"cpathlib\nPosixPath\n" in written
    as_313 = written.replace(b"cpathlib\nPosixPath\n", b"cpathlib._local\nPosixPath\n")
    read = layout.MetadataUnpickler(io.BytesIO(as_313)).load()
    assert read.storage_meta.checkpoint_id == Path("/runs/step-2")
    # A class of DCP's metadata module this torch lacks (a newer torch's) is no damage, which
    # resume=auto would skip and then move aside (found by review)
    from shardtrain.errors import CheckpointUnverifiable

    newer = written.replace(b"\nStorageMeta\n", b"\nStorageMetaV9\n")
    assert newer != written
    checkpoint = tmp_path / "newer"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_bytes(newer)
    with pytest.raises(CheckpointUnverifiable, match=r"StorageMetaV9, which this torch .* does not have: it "
                                                     r"was saved by a newer torch \(not recorded\)"):
        layout.read_dcp_metadata(checkpoint)


def config_resumed_from(resume: str) -> dict:
    """A saved config (``TrainState.config``) of a run started with ``checkpoint.resume=resume``."""
    config = OmegaConf.to_container(OmegaConf.structured(Config()))
    return {**config, "checkpoint": {**config["checkpoint"], "resume": resume}}


def test_later_checkpoints_are_this_runs_only_with_the_same_resume_and_config(tmp_path):
    """A requeued job of resume=PATH goes on from the later checkpoints it saved, also once its keep_last
    pruned PATH (the launcher asked PATH to exist first, and refused the requeue); the same resume
    with other settings, or later steps of another start, are not its own."""
    chosen = tmp_path / "other" / "step-2"
    root = tmp_path / "run" / "checkpoints"

    def saved(directory, step, resume, digest="abc"):
        directory.mkdir(parents=True)
        TrainState(step=step, tokens_seen=0, consumed_samples=0, global_batch=2, scheduler={},
                   world_size=1, strategy="FULL_SHARD", mesh_shape=[1], mesh_dim_names=["dp_shard"],
                   mixed_precision="fp32", config=config_resumed_from(resume), config_hash=digest,
                   versions={}, saved_at="now").write(directory)

    saved(chosen, 2, "auto")
    saved(root / "step-4", 4, str(chosen))
    saved(root / "step-6", 6, str(chosen))
    assert layout.saved_by_same_resume(root, str(chosen), hashed("abc"))
    assert not layout.saved_by_same_resume(root, str(chosen), hashed("another config"))
    # a checkpoint from before 2026-11-30 holds the resolved config's hash, which is also compared
    assert layout.saved_by_same_resume(root, str(chosen), hashed("another config", "abc"))
    assert not layout.saved_by_same_resume(root, str(tmp_path / "elsewhere" / "step-2"))
    cfg = Config()
    cfg.run.dir, cfg.checkpoint.resume = str(tmp_path / "run"), str(chosen)
    check_resume(cfg)  # the ranks compare the configs
    shutil.rmtree(chosen)  # pruned by the first job's keep_last: the requeue still goes on
    assert layout.saved_by_same_resume(root, str(chosen), hashed("abc"))
    check_resume(cfg)
    saved(root / "step-8", 8, "auto")  # another start's later step: not this run's
    with pytest.raises(CheckpointError, match="does not exist"):
        check_resume(cfg)
    # resume=another run's checkpoints/best, which that run moves on to a step later than this run's
    # own: a restart still goes on from its own checkpoints, not from the link's new target.
    link, mine = tmp_path / "other" / "best", tmp_path / "mine" / "checkpoints"
    saved(tmp_path / "other" / "step-3", 3, "auto")
    link.symlink_to("step-3")
    saved(mine / "step-4", 4, str(link))
    saved(mine / "step-6", 6, str(link))
    saved(tmp_path / "other" / "step-10", 10, "auto")
    link.unlink()
    link.symlink_to("step-10")
    assert layout.saved_by_same_resume(mine, str(link), hashed("abc"))
    # resume=none restarted (torchrun's --max-restarts): its own checkpoints go on, another run's do
    # not (found by review: any checkpoint counted, and an attempt that had refused another run's
    # took them over at its restart)
    from types import SimpleNamespace

    from shardtrain.checkpoint.checkpointer import Checkpointer

    fresh = tmp_path / "fresh" / "checkpoints"
    saved(fresh / "step-2", 2, "none")
    for root_dir, own in ((fresh, True), (mine, False)):
        attempt = SimpleNamespace(root=root_dir, same_config=hashed("abc"))
        assert Checkpointer.saved_by_earlier_attempt(attempt, "none", restarted=True) is own
        assert Checkpointer.saved_by_earlier_attempt(attempt, "none", restarted=False) is False
    # A config saved before a key joined the schema was hashed without it: compared over the keys it
    # has (found by a review: every added key changed every run's hash, and a job requeued across
    # an upgrade was refused its own checkpoints)
    now = Config()
    before = OmegaConf.to_container(OmegaConf.structured(now))
    del before["data"]["packing"]
    old_hash = hashlib.sha256(OmegaConf.to_yaml(OmegaConf.create(before)).encode()).hexdigest()[:16]
    assert config_hash(now) != old_hash and config_hash_within(now, before) == old_hash
    assert config_hash_within(now, OmegaConf.to_container(OmegaConf.structured(now))) == config_hash(now)


def hashed(*digests: str):
    """``saved_by_same_resume``'s judge of a checkpoint's config: its hash one of ``digests``."""
    return lambda state: state.config_hash in digests


def test_trainer_state_fields_are_type_checked(tmp_path):
    config = config_resumed_from("auto")
    fields = dict(step=6, tokens_seen=96, consumed_samples=12, global_batch=2,
                  scheduler={"last_epoch": 6}, world_size=1, strategy="FULL_SHARD", mesh_shape=[1],
                  mesh_dim_names=["dp_shard"], mixed_precision="fp32", config=config, config_hash="abc",
                  versions={"torch": "2", "shardtrain": "9.1"}, saved_at="now")
    TrainState(**fields).write(tmp_path)
    assert TrainState.read(tmp_path) == TrainState(**fields)
    raw = json.loads((tmp_path / STATE_FILE).read_text())
    # A value changed since the save that still has its type (a flipped digit of the step) is told
    # by the file's own sha256 (checksums.json, written before it, cannot cover it); without that
    # line, as an edit made on purpose, it reads
    (tmp_path / STATE_FILE).write_text(json.dumps({**raw, "step": 7}))
    with pytest.raises(CheckpointError, match=r"trainer_state.json changed since its save \(the sha256 of "
                                              r"its fields differs from its 'sha256'\): damaged, or edited "
                                              r"by hand; .* delete its 'sha256' line"):
        TrainState.read(tmp_path)
    del raw["sha256"]
    (tmp_path / STATE_FILE).write_text(json.dumps({**raw, "step": 7}))
    assert TrainState.read(tmp_path).step == 7
    for name, value, expected in (("step", "6", "int"), ("step", True, "int"),
                                  ("scheduler", None, "dict"), ("mesh_shape", [1, "2"], "list[int]"),
                                  ("base_weights", [1], "dict[str, Any] | None")):
        (tmp_path / STATE_FILE).write_text(json.dumps({**raw, name: value}))
        message = rf"field '{name}' is .*, not of type {re.escape(expected)}"
        with pytest.raises(CheckpointError, match=message):
            TrainState.read(tmp_path)
    best = {"monitor": "val_loss", "mode": "min", "ranking": [[6, 2.5], [4, 3]], "best": [6, 2.5], "stale": 0}
    (tmp_path / STATE_FILE).write_text(json.dumps({**raw, "best": best}))
    assert TrainState.read(tmp_path).best_steps() == {4, 6}
    for damaged in ({**best, "ranking": [[6]]}, {**best, "mode": "lowest"},
                    {**best, "ranking": [["6", 1.0]]}, {**best, "stale": -1}, {**best, "best": 2.5}):
        (tmp_path / STATE_FILE).write_text(json.dumps({**raw, "best": damaged}))
        with pytest.raises(CheckpointError, match="field 'best' is .*, not a record of the best evaluations"):
            TrainState.read(tmp_path)
    # The saved config, which readers rebuild (found by review: tracebacks, and on one rank of a
    # resume an AttributeError its peers waited on for the checkpoint group's timeout).
    # Settings a newer shardtrain saved: the file reads (a resume compares settings key by key and
    # goes on), the model's config is one line naming them and the version, not a TypeError.
    (tmp_path / STATE_FILE).write_text(json.dumps({**raw, "config": {**config, "model": {
        **config["model"], "experts": 8}}}))
    with pytest.raises(CheckpointError, match=r"saved settings shardtrain .* does not know "
                                              r"\(model.experts\), written by shardtrain 9.1: read them"):
        TrainState.read(tmp_path).model_config()
    for damaged, message in (({k: v for k, v in config.items() if k != "model"},
                              "its config's 'model' section is missing, not a mapping"),
                             ({**config, "task": "x"}, "its config's 'task' section is \"x\", not a mapping"),
                             ({**config, "task": {"path": 3}}, "its config's task.path is not a string"),
                             ({**config, "checkpoint": []},
                              "its config's 'checkpoint' section is \\[\\], not")):
        (tmp_path / STATE_FILE).write_text(json.dumps({**raw, "config": damaged}))
        with pytest.raises(CheckpointError, match=message):
            TrainState.read(tmp_path)


def test_a_damaged_scheduler_state_is_named_before_it_is_loaded(tmp_path):
    """A base rate per parameter group and a position up to the checkpoint's step: anything else in
    trainer_state.json's scheduler failed later as a traceback, or resumed at another rate."""
    from shardtrain.checkpoint.checkpointer import check_scheduler_state

    fields = dict(step=6, tokens_seen=96, consumed_samples=12, global_batch=2, world_size=1,
                  strategy="FULL_SHARD", mesh_shape=[1], mesh_dim_names=["dp_shard"], mixed_precision="fp32",
                  config={}, config_hash="abc", versions={"torch": "2"}, saved_at="now")
    good = {"base_lrs": [0.003, 0.003], "last_epoch": 5, "_step_count": 6, "lr_lambdas": [None, None]}
    check_scheduler_state(tmp_path, TrainState(scheduler=good, **fields), 2)
    for scheduler, message in (({**good, "base_lrs": [0.003]}, "'base_lrs' is [0.003], not 2 learning rates"),
                               ({**good, "base_lrs": [0.003, "x"]}, "'base_lrs' is"),
                               ({**good, "base_lrs": [0.003, float("nan")]}, "'base_lrs' is"),
                               ({**good, "last_epoch": 7},
                                "'last_epoch' is 7, not a step from 0 to the checkpoint's 6"),
                               ({"last_epoch": 5}, "'base_lrs' is null"),
                               # found by review: a KeyError traceback in load_state_dict
                               ({k: v for k, v in good.items() if k != "lr_lambdas"}, "'lr_lambdas' is null"),
                               ({**good, "lr_lambdas": [None]}, "'lr_lambdas' is [null], not one entry")):
        with pytest.raises(CheckpointError, match=re.escape(message)):
            check_scheduler_state(tmp_path, TrainState(scheduler=scheduler, **fields), 2)


def test_prune_keeps_the_checkpoint_just_saved(tmp_path):
    """keep_last counts the steps up to the one just committed, never a later one (left by another
    run in the same directory), nor one whose checksums failed: it deleted the new checkpoint."""
    for step in (2, 4, 5, 8, 10):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / STATE_FILE).write_text("{}")
    damaged = {tmp_path / "step-2"}
    # renamed first, then handed to the deleter (the checkpointer's thread: found by a scale review,
    # rank 0 deleted while every other rank waited)
    handed: list[Path] = []
    assert layout.prune(tmp_path, 5, 1, damaged, delete=handed.append) == [tmp_path / "step-4"]
    assert handed == [tmp_path / ".step-4.deleting"] and (handed[0] / STATE_FILE).is_file()
    assert [step for step, _ in layout.candidates(tmp_path).complete] == [2, 5, 8, 10]
    shutil.rmtree(handed[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-2", "step-5", "step-8"]
    # checkpoint.keep_best's steps are kept beside the newest keep_last, the best one linked
    assert layout.prune(tmp_path, 10, 1, set(), best={5, 7}) == [tmp_path / "step-2", tmp_path / "step-8"]
    layout.point_best(tmp_path, 10)
    layout.point_best(tmp_path, 5)  # replaced, not stacked
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "step-10", "step-5"]
    assert (tmp_path / "best").resolve() == (tmp_path / "step-5").resolve()
    assert [step for step, _ in layout.candidates(tmp_path).complete] == [5, 10]  # not a checkpoint
    layout.point_best(tmp_path, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-5"]
    (tmp_path / "best").mkdir()  # the user's own: never replaced, nor removed
    with pytest.raises(CheckpointError, match="is not shardtrain's link to a step-N"):
        layout.point_best(tmp_path, 10)
    layout.point_best(tmp_path, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "step-10", "step-5"]


def test_the_best_evaluations():
    """The kept best by a value's least (or most); NaN never ranks nor improves; the evaluations
    since the best improved by more than min_delta are counted; a resume takes the record only when
    it judged the same value the same way, and another run's ranking never."""
    from shardtrain.checkpoint.best import BestEvaluations
    from shardtrain.config.schema import TrainerConfig

    best = BestEvaluations(TrainerConfig(early_stop_min_delta=0.1), keep=2)
    ranked = [step for step, value in ((2, 3.0), (4, float("nan")), (6, 2.0), (8, 1.95), (10, 2.6), (12, 1.0))
              if best.judge(step, value)]
    assert ranked == [2, 6, 8, 12] and best.ranking == [(12, 1.0), (8, 1.95)]
    assert (best.best, best.stale) == ((12, 1.0), 0)
    best.judge(14, 0.95)  # better, by less than min_delta: ranks, yet counts as no improvement
    assert best.ranking == [(14, 0.95), (12, 1.0)] and (best.best, best.stale) == ((12, 1.0), 1)
    most = BestEvaluations(TrainerConfig(monitor="val_accuracy", monitor_mode="max"), keep=1)
    assert most.restore(best.state(), {12, 14}).startswith(
        "the resumed checkpoint judged its evaluations by val_loss")
    assert most.ranking == [] and most.best is None
    assert most.judge(4, 0.5) and not most.judge(6, 0.4) and most.stale == 1
    assert not most.judge(8, float("inf")) and most.stale == 2
    again = BestEvaluations(TrainerConfig(), keep=1)
    assert again.restore(best.state(), {12, 14}) is None and again.ranking == [(14, 0.95)]
    assert (again.best, again.stale) == ((12, 1.0), 1)
    assert "records no best evaluation" in again.restore(None, set())
    # Rolled back to a checkpoint whose ranking names a step a later commit pruned: ranked without it.
    rolled = BestEvaluations(TrainerConfig(), keep=2)
    assert rolled.restore(best.state(), {12, 16}) == ("the resumed checkpoint ranked step-14 among the best, "
                                                     "which this run's checkpoints no longer hold: ranked "
                                                     "without them")
    assert rolled.ranking == [(12, 1.0)]
    assert rolled.judge(18, 1.5) and rolled.ranking == [(12, 1.0), (18, 1.5)]
    elsewhere = BestEvaluations(TrainerConfig(), keep=1)  # resumed from another run.dir's checkpoint
    assert "another run's" in elsewhere.restore(best.state(), held=None)
    assert elsewhere.ranking == [] and (elsewhere.best, elsewhere.stale) == ((12, 1.0), 1)
    stopping = BestEvaluations(TrainerConfig(), keep=0)  # early stopping alone: nothing ranks
    assert not stopping.judge(2, 1.0) and stopping.best == (2, 1.0)
    stopping.stopped_at = 2
    assert BestEvaluations(TrainerConfig(), keep=0).restore(stopping.state(), {2}) is None
    older = {key: value for key, value in best.state().items() if key in ("monitor", "mode", "ranking")}
    taken = BestEvaluations(TrainerConfig(), keep=2)  # a record without its best: the ranking's first
    assert taken.restore(older, {12, 14}) is None
    assert (taken.best, taken.stale, taken.stopped_at) == ((14, 0.95), 0, None)
    # Values over another validation set do not compare (found by review: ranked against them).
    on_128 = BestEvaluations(TrainerConfig(), keep=2, evaluated=128)
    on_128.judge(4, 1.0)
    on_64 = BestEvaluations(TrainerConfig(), keep=2, evaluated=64)
    assert "judged evaluations of 128 validation samples, this run evaluates 64" in on_64.restore(
        on_128.state(), {4})
    assert on_64.ranking == [] and on_64.best is None
    again = BestEvaluations(TrainerConfig(), keep=2, evaluated=128)
    assert again.restore(on_128.state(), {4}) is None and again.ranking == [(4, 1.0)]
    # ... nor over as many windows of another length (found by review: a resume at another
    # trainer.seq_len ranked 8-token windows' losses against 64-token ones')
    windows = {"seq_len": 64, "document_mask": False, "windows": 1066}
    long = BestEvaluations(TrainerConfig(), keep=2, evaluated=8, validation=windows)
    long.judge(4, 1.0)
    short = BestEvaluations(TrainerConfig(), keep=2, evaluated=8, validation={**windows, "seq_len": 8})
    assert "other validation windows (seq_len 64 -> 8)" in short.restore(long.state(), {4})
    assert short.ranking == [] and short.best is None
    same = BestEvaluations(TrainerConfig(), keep=2, evaluated=8, validation=dict(windows))
    assert same.restore(long.state(), {4}) is None and same.ranking == [(4, 1.0)]
    # A checkpoint saved before a key joined the record goes on ranking: the keys both record compare
    # (a key the record lacks restarted every older run's ranking, pruning its best checkpoints)
    upgraded = BestEvaluations(TrainerConfig(), keep=2, evaluated=8,
                               validation={**windows, "packing": "stream"})
    assert upgraded.restore(long.state(), {4}) is None and upgraded.ranking == [(4, 1.0)]


def test_a_directory_of_consolidated_weights_is_named_for_what_it_is(tmp_path):
    """Found by review: consolidate's output directory given as a checkpoint was "a save that did not
    finish"; the one-file kind names the file to pass, the sharded kind the way to one file."""
    (tmp_path / "one").mkdir()
    file = tmp_path / "one" / "model.safetensors"
    file.write_bytes(b"")
    named = (f"holds consolidated weights, not a checkpoint: generate, eval, export-hf and model.init_from "
             f"take its file, '{file}'; consolidate and checkpoint.resume the checkpoint it was made from")
    with pytest.raises(CheckpointError, match=re.escape(named)):
        layout.read_dcp_metadata(tmp_path / "one")
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="consolidate it into one .safetensors file"):
        layout.read_dcp_metadata(tmp_path / "shards")
    # With a config.json, a Hugging Face model (export-hf's output): not passed on to its weights
    # file, which carries no run config (found by review: the advice failed when followed).
    (tmp_path / "shards" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=re.escape(
            f"'{tmp_path / 'shards'}' is a Hugging Face model directory, not a checkpoint: generate and "
            f"eval read it as it is; train from it with model.name=hf model.path={tmp_path / 'shards'}")):
        layout.read_dcp_metadata(tmp_path / "shards")


def test_inspect_refuses_a_directory_that_is_no_checkpoint(tmp_path):
    """Found by review: an empty directory or one of text files was inspected as a checkpoint whose
    save did not finish (exit 1, read as damage); what holds no checkpoint file is refused (exit 2)."""
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("text")
    for directory in (tmp_path / "texts", tmp_path / "texts" / "empty"):
        directory.mkdir(exist_ok=True)
        with pytest.raises(CheckpointError, match="is no checkpoint: it holds no .metadata and no"):
            inspect_path(directory)
    abandoned = tmp_path / ".step-4.tmp"  # an interrupted save: reported, not refused
    abandoned.mkdir()
    assert "did not finish" in inspect_path(abandoned).render()
    # A best link whose target is gone (a copy of the newest step alone): the link and its target
    # named, with the newest complete checkpoint (found by review: "does not exist" of the link)
    root = tmp_path / "copied" / "checkpoints"
    (root / "step-4").mkdir(parents=True)
    (root / "step-4" / STATE_FILE).write_text("{}")
    (root / "best").symlink_to("step-2")
    said = f"'{root / 'best'}' is a link to step-2, which does not exist; the newest complete checkpoint " \
           f"there is {root / 'step-4'}"
    with pytest.raises(CheckpointError, match="^" + re.escape(said) + "$"):
        inspect_path(root / "best")
    with pytest.raises(CheckpointError, match="^checkpoint " + re.escape(said) + "$"):
        layout.read_dcp_metadata(root / "best")
    with pytest.raises(CheckpointError, match=f"^'{re.escape(str(root / 'step-2'))}' does not exist$"):
        inspect_path(root / "step-2")


def test_the_background_deleter_removes_in_order_and_is_waited_for(tmp_path, caplog):
    """keep_last's deletions run in a daemon thread of rank 0's own (the others waited in the commit
    while rank 0 deleted; found by a scale review); ``busy`` names what is still to go, ``wait``
    waits for all of it, and a deletion that fails is a warning."""
    from shardtrain.checkpoint.checkpointer import BackgroundDeleter

    deleter = BackgroundDeleter()
    doomed = []
    for step in (2, 4):
        (tmp_path / f".step-{step}.deleting" / "sub").mkdir(parents=True)
        (tmp_path / f".step-{step}.deleting" / "sub" / "__0_0.distcp").write_bytes(b"x" * 1000)
        doomed.append(tmp_path / f".step-{step}.deleting")
    for directory in doomed:
        deleter.submit(directory)
    assert set(deleter.busy()) <= set(doomed)
    assert [layout.deleted_name(path) for path in doomed] == ["step-2", "step-4"]
    deleter.wait()
    assert deleter.busy() == [] and not any(path.exists() for path in doomed)
    assert deleter.thread.daemon  # a failing process does not wait for it, unwatched, at its exit
    deleter.submit(tmp_path / ".step-9.deleting")  # gone already: said, not raised
    deleter.wait()
    assert "deleting " in caplog.text and ".step-9.deleting failed" in caplog.text
    # any other failure too, and the thread goes on with the next (ended, it left them waited for
    # without end)
    deleter.submit(None)  # a TypeError in rmtree
    (tmp_path / ".step-11.deleting").mkdir()
    deleter.submit(tmp_path / ".step-11.deleting")
    deleter.wait()
    assert not (tmp_path / ".step-11.deleting").exists() and deleter.thread.is_alive()


def test_a_later_start_waits_for_this_process_s_deletions_in_its_directory(tmp_path, monkeypatch):
    """A second Trainer in one process (a library user's, after a first one failed) removed what
    interrupted deletions left while the first's deleter was still removing it (review): it waits
    for this process's deleters in its directory first, and for none elsewhere."""
    import time

    from shardtrain.checkpoint import checkpointer

    removed, rmtree = [], shutil.rmtree

    def slow_rmtree(path):
        time.sleep(0.3)
        rmtree(path)
        removed.append(path.name)

    monkeypatch.setattr(checkpointer.shutil, "rmtree", slow_rmtree)
    deleter = checkpointer.BackgroundDeleter()
    (tmp_path / "run" / ".step-4.deleting").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    deleter.submit(tmp_path / "run" / ".step-4.deleting")
    checkpointer.wait_deletions_in(tmp_path / "other")  # not its directory: no wait
    assert removed == []
    checkpointer.wait_deletions_in(tmp_path / "run")
    assert removed == [".step-4.deleting"] and deleter.busy() == []


def test_abandoned_saves_and_deletions_are_removed(tmp_path):
    """A deletion that crashed left .step-4.deleting: pruning a step-4 saved again renamed onto it
    and failed (ENOTEMPTY) after the new checkpoint had committed. remove_abandoned deletes what
    crashed saves (.step-N.tmp) and deletions left, and nothing else."""
    for step in (4, 6):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / STATE_FILE).write_text("{}")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    for directory in (".step-4.deleting", ".step-37.tmp", ".step-2.deleting", ".step-9.tmp",
                      ".step-5.damaged-1700000000", ".step-x.tmp", ".step-3.tmp.bak", outside):
        (tmp_path / directory).mkdir()
        (tmp_path / directory / "__0_0.distcp").write_bytes(b"shard")
    (tmp_path / ".step-8.tmp").write_text("a file, not a save")
    (tmp_path / ".step-7.tmp").symlink_to(outside, target_is_directory=True)
    # a rewrite of step-6's trainer_state.json a crash cut short (found by review: never removed)
    (tmp_path / ".step-6.trainer_state.json.part").write_text("{")

    assert layout.prune(tmp_path, 6, 1, set()) == [tmp_path / "step-4"]
    # .step-9.tmp: complete but never renamed, and resumed from by hand
    assert layout.remove_abandoned(tmp_path, keep=tmp_path / ".step-9.tmp") == [
        tmp_path / ".step-2.deleting", tmp_path / ".step-37.tmp",
        tmp_path / ".step-6.trainer_state.json.part"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".step-3.tmp.bak", ".step-5.damaged-1700000000", ".step-7.tmp", ".step-8.tmp", ".step-9.tmp",
        ".step-x.tmp", "step-6"]
    assert (outside / "__0_0.distcp").is_file()
    assert layout.remove_abandoned(tmp_path / "none") == []
    # A pruned checkpoint's .deleting (a preempted run's exit leaves it) goes to the background
    # deleter, while training goes on: every rank waited for its deletion at start-up (found by
    # review), and so does a .tmp, renamed first (a save of its step writes there; its deletion was
    # every rank's wait too); beside a .tmp.deleting of its own (a crash between), deleted at once
    for name in (".step-10.deleting", ".step-12.tmp", ".step-14.tmp", ".step-14.tmp.deleting"):
        (tmp_path / name).mkdir()
    handed: list[Path] = []
    assert layout.remove_abandoned(tmp_path, delete_later=handed.append) == [
        tmp_path / ".step-10.deleting", tmp_path / ".step-12.tmp", tmp_path / ".step-14.tmp",
        tmp_path / ".step-14.tmp.deleting", tmp_path / ".step-9.tmp"]
    assert handed == [tmp_path / ".step-10.deleting", tmp_path / ".step-12.tmp.deleting",
                      tmp_path / ".step-14.tmp.deleting", tmp_path / ".step-9.tmp.deleting"]
    assert all(path.is_dir() for path in handed)
    assert not any((tmp_path / name).exists() for name in (".step-12.tmp", ".step-14.tmp", ".step-9.tmp"))
    assert "did not finish" in layout.unfinished_save(tmp_path / ".step-12.tmp.deleting")


def linear_base(directory, layer=None):
    """A DCP checkpoint of an 8 MiB linear layer's weights (``layer``'s, or new ones), saved without
    a process group."""
    import torch.distributed.checkpoint as dcp

    layer = layer or torch.nn.Linear(2048, 1024)
    dcp.save({"model": layer.state_dict()}, checkpoint_id=str(directory), no_dist=True)
    return layer


def test_dcp_base_fingerprint_reads_its_metadata_only(tmp_path):
    """A LoRA base saved as a DCP checkpoint is identified by its .metadata (DCP draws an id for each
    save) and manifest, not by 3 MiB of every shard file read on every rank (3 GiB per rank for a
    base saved at 1,024 ranks); a copy is the same base, another save is not, and an identity
    recorded the old way (before this) is still accepted for the same base."""
    import dataclasses

    from checkpoint_workers import bytes_read

    from shardtrain.checkpoint import weights

    def identity(directory):
        return weights.base_identity(dataclasses.replace(Config().model, init_from=str(directory)), 0)

    base, other = tmp_path / "base", tmp_path / "other"
    linear_base(other, linear_base(base))  # the same weights, saved again
    before = bytes_read()
    current = identity(base)
    assert bytes_read() - before < (base / ".metadata").stat().st_size + (64 << 10)
    shutil.copytree(base, tmp_path / "copy")
    assert identity(tmp_path / "copy")["fingerprint"] == current["fingerprint"]
    ckpt = tmp_path / "adapters"
    weights.check_same_base(ckpt, identity(tmp_path / "copy"), current)
    with pytest.raises(CheckpointError, match="trained on base"):
        weights.check_same_base(ckpt, identity(other), current)
    recorded_before = {"source": current["source"], "fingerprint": weights.files_fingerprint(str(base))}
    weights.check_same_base(ckpt, recorded_before, current)
    with pytest.raises(CheckpointError, match="trained on base"):
        weights.check_same_base(ckpt, recorded_before, identity(other))
    # A random base is its seed and the built-in model's init_std (found by review: a resume with
    # another init_std trained on another base, silently); one saved without init_std is taken.
    random_base = weights.base_identity(ModelConfig(), 7)
    assert random_base == {"source": "random", "seed": 7, "init_std": 0.02}
    with pytest.raises(CheckpointError, match=r"trained on base random \(seed 7, model.init_std 0.02\), not "
                                              r"on this run's random \(seed 7, model.init_std 0.5\)"):
        weights.check_same_base(ckpt, random_base, weights.base_identity(ModelConfig(init_std=0.5), 7))
    weights.check_same_base(ckpt, {"source": "random", "seed": 7}, random_base)


def test_a_hugging_face_base_is_its_weights_and_its_config(tmp_path):
    """Found by review: a LoRA checkpoint's base was its weight files alone, and an edited config.json
    (rms_norm_eps) gave eval, merges and resumes another model without a word. A re-save of the same
    config by transformers (its defaults added, rope_scaling renamed) is no change (found by the
    diff's review of a digest of every key); an identity recorded before configs were is taken."""
    from shardtrain.checkpoint import weights

    base = tmp_path / "base"
    base.mkdir()
    save_file({"w": torch.ones(4)}, str(base / "model.safetensors"))
    written = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
               "num_key_value_heads": 4, "rms_norm_eps": 1e-05, "rope_scaling": None, "vocab_size": 256,
               "torch_dtype": "float16", "transformers_version": "4.31.0"}
    (base / "config.json").write_text(json.dumps(written))
    cfg = ModelConfig(name="hf", path=str(base))
    saved = weights.base_identity(cfg, 0)
    transformers.AutoConfig.from_pretrained(base).save_pretrained(base)
    assert json.loads((base / "config.json").read_text()) != written  # rewritten
    ckpt = tmp_path / "adapters"
    weights.check_same_base(ckpt, saved, weights.base_identity(cfg, 0))
    (base / "config.json").write_text(json.dumps({**written, "rms_norm_eps": 0.5}))
    with pytest.raises(CheckpointError, match=r"was trained on base .* with another config.json "
                                              r"\(rms_norm_eps 1e-05 -> 0.5\): resume it on the base as it"):
        weights.check_same_base(ckpt, saved, weights.base_identity(cfg, 0))
    weights.check_same_base(ckpt, {key: value for key, value in saved.items() if key != "config"},
                            weights.base_identity(cfg, 0))


def test_dcp_read_failure_is_one_line_naming_the_cause(tmp_path):
    """DCP gathers a read's failures into a CheckpointException, a BaseException whose text named
    only the ranks: model.init_from of an unreadable shard says the rank, the cause and the fix."""
    from shardtrain.checkpoint.weights import load_model_weights

    base = tmp_path / "base"
    linear_base(base)
    shard = base / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    with pytest.raises(CheckpointError) as caught:
        load_model_weights(torch.nn.Linear(2048, 1024), str(base))
    message = str(caught.value)
    assert message.startswith(f"reading checkpoint {base} failed on rank 0: UnpicklingError: "), message
    assert "\n" not in message and "CheckpointException" not in message, message


def test_ctrl_c_inside_dcp_is_an_interruption_not_a_failed_save(tmp_path):
    """Found by a trial: Ctrl-C during a save's dcp.save was gathered by DCP into a
    CheckpointException and reported as a failed save ("check run.dir's filesystem", exit 2, a
    failure record); raised as the KeyboardInterrupt it is (exit 130), other failures left alone."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    from shardtrain.checkpoint.dcp_errors import DCP_FAILURES, raise_if_interrupted

    def gathered(failure: BaseException) -> BaseException:
        class Failing(FileSystemWriter):
            def write_data(self, plan, planner):
                raise failure

        try:
            with layout.reading_alone():
                dcp.save({"w": torch.ones(2)}, storage_writer=Failing(str(tmp_path / "s")), no_dist=True)
        except DCP_FAILURES as exc:
            return exc
        raise AssertionError("the save did not fail")

    interrupted = gathered(KeyboardInterrupt())
    assert isinstance(interrupted, CheckpointException)
    with pytest.raises(KeyboardInterrupt):
        raise_if_interrupted(interrupted)
    with pytest.raises(KeyboardInterrupt):  # nested, as a gathered failure of a gathered one
        raise_if_interrupted(CheckpointException("outer", {1: (interrupted, [])}))
    raise_if_interrupted(gathered(OSError(28, "No space left on device")))  # a failure stays one


def test_async_staging_reuses_its_buffers_and_copies_new_values():
    """The run's stager copies each save into the buffers of the first (no fresh host copy per
    save), and a later save's copy holds the state as it is then, not the first save's."""
    stager = staging.reused_stager(torch.device("cpu"))
    assert stager is not None, "torch 2.13 reuses DCP's staging buffers"
    model = torch.nn.Linear(4, 4)
    first = {k: v for k, v in stager.stage(model.state_dict()).items()}
    first_values = {k: v.clone() for k, v in first.items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    second = stager.stage(model.state_dict())
    for name, tensor in second.items():
        assert tensor.untyped_storage().data_ptr() == first[name].untyped_storage().data_ptr(), name
        assert torch.equal(tensor, model.state_dict()[name]), name
    assert not torch.equal(second["weight"], first_values["weight"])
    stager.close()


def test_an_error_without_a_message_still_stops_every_rank():
    """``str(OSError())`` is empty: the agreed verdicts took it for no error (found by review), so a
    rank's failed RNG read became 'resumed without RNG state'."""
    with pytest.raises(CheckpointError, match="a check failed on rank 1 without saying why"):
        raise_first_error([(None, "fine"), (str(OSError()), None)], CheckpointError)
    raise_first_error([(None, "fine"), (None, "fine")], CheckpointError)


def test_the_consolidated_average_takes_buffers_and_frozen_weights_from_the_model(tmp_path):
    """trainer.ema_decay averages the trained parameters: `consolidate --key ema` writes them from
    ``ema.*`` and the rest (a norm's running statistics, a frozen table) from ``model.*``."""
    import torch.distributed.checkpoint as dcp

    weight, average = torch.ones(3, 2), torch.full((3, 2), 0.5)
    stats, frozen = torch.arange(3.0), torch.arange(1.0, 5.0)  # not zeros: a zero-filled one would pass
    dcp.save({"model": {"linear.weight": weight, "bn.running_mean": stats, "table": frozen},
              "ema": {"linear.weight": average}}, checkpoint_id=str(tmp_path / "ckpt"))
    (out,) = consolidate(tmp_path / "ckpt", tmp_path / "ema.safetensors", key="ema", verify=False)
    written = load_file(str(out))
    assert set(written) == {"linear.weight", "bn.running_mean", "table"}
    assert torch.equal(written["linear.weight"], average) and torch.equal(written["bn.running_mean"], stats)
    assert torch.equal(written["table"], frozen)


def test_random_streams_kept_leaves_every_stream_a_checkpoint_restores_as_it_was():
    """The evaluation that looks for trainer.monitor before the first step runs under it: a task
    drawing from Python's, NumPy's or torch's streams there must not move a resumed run off the
    uninterrupted run's draws (found by a review: torch's alone were forked)."""
    def seeded_draws() -> tuple:
        return torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random()

    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    expected = seeded_draws()
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    with random_streams_kept():
        torch.randn(5), np.random.rand(4), random.random()
    assert seeded_draws() == expected
    # A fresh run seeds them from trainer.seed and its data-parallel rank (found by review: torch's
    # CPU stream differed between two runs of one seed; on CUDA every rank started at one default,
    # so every rank drew the same dropout masks).
    draws = {}
    for seed, rank in ((1, 0), (1, 1), (2, 0), (1, 0)):
        seed_random_streams(seed, rank)
        draws.setdefault((seed, rank), []).append(seeded_draws())
    assert draws[1, 0][0] == draws[1, 0][1]
    assert len({str(d[0]) for d in draws.values()}) == 3  # each (seed, rank) its own
    # a resume that cannot restore them seeds them from its step too (seeded as at step 0, each
    # resume at another world size drew step 1's dropout masks again; found by a review)
    seed_random_streams(1, 0, 5)
    resumed = seeded_draws()
    seed_random_streams(1, 0, 5)
    assert seeded_draws() == resumed != draws[1, 0][0]


def test_a_flipped_bit_in_metadata_is_damage_not_lack_of_memory(tmp_path):
    """Found by review: a flipped bit in a pickle frame's length makes unpickling raise MemoryError,
    which the resume had come to take for the host's shortage (stop, "no sign of damage") instead of
    damage (skip it, resume the previous checkpoint). A small file asking for terabytes is damage."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path), no_dist=True)
    metadata = tmp_path / ".metadata"
    data = bytearray(metadata.read_bytes())
    assert data[2] == pickle.FRAME[0]  # protocol 4+: PROTO, then FRAME and its 8-byte length
    data[8] ^= 0x40  # the length's bit 46: 64 TiB
    metadata.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="far more memory than its size accounts for: damaged"):
        layout.read_dcp_metadata(tmp_path)


def test_the_run_lock_is_shared_within_a_process_and_refused_to_another(tmp_path):
    """A process's own trainers of one run.dir share its hold (tests/init_workers.py resumes a
    trainer's save with a second one); another process is refused while any hold is left."""
    import subprocess
    import sys

    from shardtrain.checkpoint.run_lock import HELD, take_run_lock

    other = [sys.executable, "-c", "import sys; from pathlib import Path; "
             "from shardtrain.checkpoint.run_lock import take_run_lock; take_run_lock(Path(sys.argv[1]))",
             str(tmp_path)]
    (tmp_path.parent / f"{tmp_path.name}-alias").symlink_to(tmp_path)  # one directory, two names
    first, second = take_run_lock(tmp_path), take_run_lock(tmp_path.parent / f"{tmp_path.name}-alias")
    second.release()
    refused = subprocess.run(other, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "another training holds" in refused.stderr, refused.stderr
    first.release()
    assert not HELD
    assert subprocess.run(other, capture_output=True, timeout=60).returncode == 0


def test_a_requeued_job_waits_for_its_own_earlier_runs_lock(tmp_path, monkeypatch):
    """Found by a Slurm review: on a network filesystem the lock of a run whose node failed outlives
    it (an NFSv4 lease, a Lustre eviction), and the job Slurm requeued after that failure was refused
    its own run.dir. The same job's later incarnation waits for the lock; another training, or a
    second step of the same job, is refused at once."""
    import subprocess
    import sys
    import time

    from shardtrain.checkpoint import run_lock
    from shardtrain.errors import RunDirectoryBusy

    def hold(seconds: float, restart: int) -> subprocess.Popen:
        code = ("import sys, time; from pathlib import Path; "
                "from shardtrain.checkpoint.run_lock import take_run_lock; take_run_lock(Path(sys.argv[1])); "
                "print('held', flush=True); time.sleep(float(sys.argv[2]))")
        env = {**os.environ, "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": str(restart)}
        holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(seconds)], env=env,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        return holder

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    holder = hold(2.0, restart=0)  # released 2 s in, as the failed node's lease ends
    try:
        start = time.monotonic()
        lock = run_lock.take_run_lock(tmp_path)
        assert time.monotonic() - start >= 1.0  # it waited for it
        lock.release()
    finally:
        holder.wait(timeout=60)
    monkeypatch.setattr(run_lock, "REQUEUE_WAIT_S", 0.5)
    for restart, said in ((0, "it is this Slurm job's run before its requeue"), (1, None)):
        holder = hold(30.0, restart=restart)
        try:
            with pytest.raises(RunDirectoryBusy, match="another training holds") as refused:
                run_lock.take_run_lock(tmp_path)
            assert (said in str(refused.value)) if said else "before its requeue" not in str(refused.value)
        finally:
            holder.kill()
            holder.wait(timeout=60)


def test_a_lustre_mount_with_node_local_flock_is_found():
    """Found by a scale review: on Lustre mounted with localflock the run lock holds on one node only,
    so a second training whose rank 0 is on another node was not refused: said at start-up. The
    innermost mount holding the path decides; escaped mount points are read."""
    from shardtrain.checkpoint.run_lock import node_local_flock

    mountinfo = "\n".join([
        "22 1 0:21 / / rw,relatime - ext4 /dev/sda1 rw",
        "40 22 0:50 / /lustre rw,relatime - lustre 10.0.0.1@o2ib:/fs rw,localflock,lazystatfs",
        "41 40 0:51 / /lustre/proj rw,relatime - lustre 10.0.0.1@o2ib:/proj rw,flock",
        "42 22 0:52 / /scratch\\040space rw,relatime - lustre 10.0.0.1@o2ib:/s rw,localflock",
        "43 22 0:53 / /nfs rw,relatime - nfs4 server:/x rw,vers=4.2",
        # NFS whose locks are the client's alone (found by review)
        "44 22 0:54 / /nfs3 rw,relatime - nfs server:/y rw,vers=3,nolock,local_lock=all",
        "45 22 0:55 / /nfsflock rw,relatime - nfs server:/z rw,vers=3,local_lock=flock",
        "46 22 0:56 / /nfsnone rw,relatime - nfs server:/w rw,vers=3,local_lock=none"])
    for path, expected in (("/lustre/runs/a/.shardtrain-run.lock", "/lustre"),
                           ("/lustre/proj/runs/.shardtrain-run.lock", None),  # cluster-wide flock
                           ("/lustreX/runs/.lock", None), ("/scratch space/r/.lock", "/scratch space"),
                           ("/nfs/r/.lock", None), ("/home/r/.lock", None), ("/nfs3/r/.lock", "/nfs3"),
                           ("/nfsflock/r/.lock", "/nfsflock"), ("/nfsnone/r/.lock", None)):
        found = node_local_flock(Path(path), mountinfo)
        assert (found and found[0]) == expected, path
    assert node_local_flock(Path("/nfs3/r"), mountinfo)[1:] == (
        "NFS mounted with local_lock=all", "mount it with local_lock=none and locks")
    assert node_local_flock(Path("/tmp/x"), "garbage\n") is None


def test_a_full_disk_beneath_torchs_writer_error_is_named():
    """Found by review: DCP's writer reports a full disk as torch's "[enforce fail at
    inline_container.cc] unexpected pos", the ENOSPC only in its context, and the message gave the
    generic advice; the OSError beneath is named, with its fix."""
    import errno

    from shardtrain.checkpoint.dcp_errors import save_failed

    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    torch_error.__context__ = OSError(errno.ENOSPC, "No space left on device")  # as raised inside its handler
    message = save_failed(2, "/r/.step-2.tmp", torch_error, "step-1")
    assert message == ("saving step 2 to /r/.step-2.tmp failed: [Errno 28] No space left on device; "
                       "free space on run.dir's filesystem (or raise its quota) (step-1 is intact)")
    # A value the checkpoint cannot hold is not the filesystem's fault (found by a trial: a task's
    # Enum option was "check run.dir's filesystem").
    unrecordable = TypeError("Object of type Act is not JSON serializable")
    message = save_failed(2, "/r/.step-2.tmp", unrecordable, "step-1")
    assert message == ("saving step 2 to /r/.step-2.tmp failed: TypeError: Object of type Act is not JSON "
                       "serializable; this is no filesystem failure but a value the checkpoint cannot hold, "
                       "or a defect (in the task's code or shardtrain's): report it (step-1 is intact)")


def test_a_preempted_runs_close_does_not_wait_for_deletions(monkeypatch, tmp_path):
    """Found by review: a preempted run's exit waited for keep_last's deletion of a pruned checkpoint
    (minutes on a shared filesystem), past the grace its scheduler gives; it says what it leaves to
    the next start instead, and a finished run's close still waits."""
    import threading
    from types import SimpleNamespace

    from shardtrain.checkpoint import checkpointer

    release = threading.Event()
    monkeypatch.setattr(checkpointer.shutil, "rmtree", lambda directory: release.wait(30))
    deleter = checkpointer.BackgroundDeleter()
    deleter.submit(tmp_path / ".step-2.deleting")
    said: list[str] = []
    closing = SimpleNamespace(wait=lambda: None, deleter=deleter, stager=None, info=said.append)
    checkpointer.Checkpointer.close(closing, wait_deletions=False)  # returns with the deletion going on
    assert said == [f"checkpoint: the preempted run leaves {tmp_path / '.step-2.deleting'} to the next "
                    "start to delete"]
    release.set()
    checkpointer.Checkpointer.close(closing)
    assert deleter.busy() == []
