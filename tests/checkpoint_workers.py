"""Code that runs inside spawned ranks for the checkpoint tests."""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import logging
import os
import pathlib
import re
import resource
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml
from equivalence import case_config, small_corpus
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from shardtrain.checkpoint import checkpointer as checkpointer_module
from shardtrain.checkpoint import integrity, layout, weights
from shardtrain.checkpoint.checkpointer import agreed_base_identity, node_file_fingerprints
from shardtrain.checkpoint.weights import agreed_source_kind
from shardtrain.distributed.env import lazily_connected_gloo_group
from shardtrain.distributed.qlora import local_tensor
from shardtrain.errors import CheckpointError, CheckpointUnverifiable, TrackerError
from shardtrain.tasks.language_model import LanguageModelTask
from shardtrain.train.loop import Trainer

N = 4  # steps before the interruption; runs are 2N steps


def ckpt_config(run_dir: str, world: int, strategy: str = "FULL_SHARD", accum: int = 1,
                resume: str = "auto", interval: int = 0, async_save: bool = False, **model_extra):
    cfg = case_config(world, run_dir, strategy=strategy, accum=accum)
    cfg.trainer = dataclasses.replace(cfg.trainer, max_steps=2 * N)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, enabled=True, interval=interval,
                                         resume=resume, keep_last=3, async_save=async_save)
    if model_extra:
        cfg.model = dataclasses.replace(cfg.model, **model_extra)
    return cfg


def new_trainer(cfg) -> Trainer:
    """A trainer whose data records the global sample ids of every step it takes."""
    trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=small_corpus()))
    data, take = trainer.train_data, trainer.train_data.next_step
    trainer.consumed_ids = []

    def recording_next_step():
        trainer.consumed_ids.append(data.step_ids())
        return take()

    data.next_step = recording_next_step
    return trainer


def interrupted(trainer: Trainer, steps: int) -> None:
    """Train ``steps`` steps and save, as a preempted run does, without finishing the schedule."""
    for _ in range(steps):
        trainer.run_step()
    trainer.save_checkpoint(blocking=True)


def dump(trainer: Trainer, losses: list[float], path: Path) -> None:
    weights = trainer.full_weights()
    if trainer.env.is_main:
        ids = [i.tolist() for i in trainer.consumed_ids]
        torch.save({"losses": losses, "weights": weights, "ids": ids}, path)


@contextmanager
def fsynced_paths() -> Iterator[list[str]]:
    """The paths of the files and directories this process fsyncs inside the block."""
    paths: list[str] = []
    real = os.fsync

    def record(fd) -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    os.fsync = record
    try:
        yield paths
    finally:
        os.fsync = real


def refused_then_restarted(out: str, world: int) -> None:
    """resume=PATH from an older step of a run.dir that holds later checkpoints of another run:
    refused on every rank before anything is saved or deleted, on a restarted attempt too (torchrun
    restarts a refused attempt); a restarted attempt or requeued job whose earlier one saved later
    checkpoints goes on from the newest of them."""
    root = Path(out, "full", "checkpoints")
    before = sorted(p.name for p in root.iterdir())
    source = f"{out}/full/checkpoints/step-{N}"
    older = ckpt_config(f"{out}/full", world, resume=source)
    refusal = f"is step {N}, but {root} already holds later checkpoints (step-6, step-8)"
    for restart_count in ("0", "1"):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = restart_count
        try:
            new_trainer(older)
        except CheckpointError as exc:
            assert refusal in str(exc), exc
        else:
            raise AssertionError(f"not refused at restart count {restart_count}")
        finally:
            del os.environ["TORCHELASTIC_RESTART_COUNT"]
        assert sorted(p.name for p in root.iterdir()) == before == [f"step-{N}", "step-6", "step-8"]
    # from_async resumed from full's step-N and saved its own step-2N: a restart, or a requeued job
    # of the same command (restart count 0 again), goes on from there
    for restart_count in ("1", "0"):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = restart_count
        try:
            restarted = new_trainer(from_async_config(out, world))
        finally:
            del os.environ["TORCHELASTIC_RESTART_COUNT"]
        assert restarted.result.resumed_from == f"{out}/from_async/checkpoints/step-{2 * N}", restart_count
    # The same resume with another learning rate is a new run over from_async's later step: refused
    changed = from_async_config(out, world)
    changed.trainer = dataclasses.replace(changed.trainer, lr=changed.trainer.lr * 2)
    try:
        new_trainer(changed)
    except CheckpointError as exc:
        assert f"already holds later checkpoints (step-{2 * N})" in str(exc), exc
    else:
        raise AssertionError("the same resume with another config went on from another run's checkpoint")


def from_async_config(out: str, world: int):
    """A resume from the uninterrupted run's step N asking for another learning rate, which it does
    not follow (it keeps the checkpoint's)."""
    cfg = ckpt_config(f"{out}/from_async", world, resume=f"{out}/full/checkpoints/step-{N}")
    cfg.trainer = dataclasses.replace(cfg.trainer, lr=cfg.trainer.lr / 3)
    return cfg


def exact_resume(out: str) -> None:
    """2 ranks: uninterrupted 2N steps vs N steps, stop, resume from run.dir, N more.

    The uninterrupted run saves every N/2 steps asynchronously while it trains on, step N being its
    second async save (staged into the buffers the first one used); resuming from that checkpoint
    must also reproduce its last N steps exactly.
    """
    world = int(os.environ["WORLD_SIZE"])
    full = new_trainer(ckpt_config(f"{out}/full", world, interval=N // 2, async_save=True))
    dump(full, full.fit().losses, Path(out, "full.pt"))
    # Asked for another learning rate, the resume keeps the checkpoint's (its steps equal the
    # uninterrupted run's), and config.yaml records the rate it runs at.
    from_async = new_trainer(from_async_config(out, world))
    dump(from_async, from_async.fit().losses, Path(out, "from_async.pt"))
    recorded = yaml.safe_load(Path(out, "from_async", "config.yaml").read_text())["trainer"]["lr"]
    assert recorded == full.cfg.trainer.lr, (recorded, full.cfg.trainer.lr)

    cfg = ckpt_config(f"{out}/split", world)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, save_full=True)
    first = new_trainer(cfg)
    with fsynced_paths() as synced:
        interrupted(first, N)
    # Every file of the save, and the directory's entries, are on disk before it is renamed complete.
    tmp = Path(out, "split", "checkpoints", f".step-{N}.tmp").resolve()
    assert str(tmp / f"rng-rank{first.env.rank}.pt") in synced, synced
    if first.env.is_main:
        assert {str(tmp / "model.safetensors"), str(tmp)} <= set(synced), synced
    losses = list(first.result.losses)
    second = new_trainer(ckpt_config(f"{out}/split", world))  # resume=auto finds step-N
    assert second.step == N and second.result.resumed_from.endswith(f"step-{N}")
    losses += second.fit().losses
    dump(second, losses, Path(out, "split.pt"))
    refused_then_restarted(out, world)
    unreadable_resumes(out, world)
    failed_saves(out, full, second)
    base_copies_differ(out, world)
    compiled_resume(out, world)


def compiled_resume(out: str, world: int) -> None:
    """strategy.compile with the diagnostics on (the defaults): the resumed steps equal the
    uninterrupted run's bit for bit (found by review: the resume's first step ran eagerly for the
    dtype probe, where the uninterrupted run's was compiled, and the two differed in the last bits)."""
    def compiled(run_dir: str, resume: str = "auto"):
        cfg = ckpt_config(run_dir, world, interval=N, resume=resume)
        cfg.strategy = dataclasses.replace(cfg.strategy, compile=True)
        return new_trainer(cfg)

    full = compiled(f"{out}/compiled")
    full.fit()
    resumed = compiled(f"{out}/compiled_resumed", resume=f"{out}/compiled/checkpoints/step-{N}")
    resumed.fit()
    assert resumed.result.losses == full.result.losses[N:], (resumed.result.losses, full.result.losses)
    # each start says what its first compiled step cost (the resumed one compiles again)
    assert full.result.first_compiled_step_s > 0 and resumed.result.first_compiled_step_s > 0
    assert resumed.result.grad_norms == full.result.grad_norms[N:]


def base_copies_differ(out: str, world: int) -> None:
    """Found by review: each rank fingerprinted its own copy of a LoRA base alone, so a node whose copy
    was missing raised alone (its peers waited in the next collective) and one whose copy differed
    trained on another base. Here each rank is given its own copy."""
    rank = int(os.environ["RANK"])
    copy = Path(out, f"base-rank{rank}.safetensors")
    if not copy.exists():
        save_file({"w": torch.full((4,), float(rank > 0))}, str(copy))
    cfg = ckpt_config(f"{out}/lora", world)
    cfg.finetune = dataclasses.replace(cfg.finetune, method="lora")
    cfg.model = dataclasses.replace(cfg.model, init_from=str(copy))
    try:
        agreed_base_identity(cfg)
    except CheckpointError as exc:
        assert str(exc).startswith(f"the base weights {str(copy.resolve())!r} differ between ranks (rank 1's "
                                   "copy has other contents than rank 0's)"), exc
        assert exc.failed_rank == 1
    else:
        raise AssertionError("different copies of the base were not refused")
    missing = Path(out, "base-missing.safetensors") if rank == 1 else copy
    cfg.model = dataclasses.replace(cfg.model, init_from=str(missing))
    try:
        agreed_base_identity(cfg)
    except CheckpointError as exc:  # rank 1's own error, and on rank 0 the same, rebuilt
        assert str(exc).startswith(f"the base weights {str(Path(out, 'base-missing.safetensors'))!r} do not "
                                   "exist"), exc
        assert getattr(exc, "failed_rank", 1) == 1, exc
    else:
        raise AssertionError("a base missing on rank 1 went on")
    # One copy for every rank of a node: each reads a share of its files (found by a scale review:
    # every rank read 3 MiB of every file), and the fingerprint is the one a lone reader takes.
    shared = Path(out, "base-shared")
    if rank == 0 and not shared.exists():
        shared.mkdir()
        (shared / "config.json").write_text("{}")
        names = [f"model-{i}-of-3.safetensors" for i in range(3)]
        for index, name in enumerate(names):
            save_file({f"w{index}": torch.full((4,), float(index))}, str(shared / name))
        (shared / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {f"w{index}": name for index, name in enumerate(names)}}))
    dist.barrier()
    cfg.model = dataclasses.replace(cfg.model, init_from=str(shared))
    mine = weights.file_fingerprints_share(str(shared), rank, world)
    assert sorted(mine) == [index for index in range(3) if index % world == rank]
    assert node_file_fingerprints(cfg) == {index: weights.file_fingerprint(file) for index, file in
                                           enumerate(weights.source_files(str(shared)))}
    assert agreed_base_identity(cfg)["fingerprint"] == weights.files_fingerprint(str(shared))


def as_saved_before_checksums(checkpoint: Path) -> None:
    """``checkpoint`` as a save from before checksums.json: without it, and without the trainer
    state's word that its save wrote one (a copy missing it alone is incomplete, and refused)."""
    (checkpoint / "checksums.json").unlink()
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state.pop("checksums", None)
    state.pop("sha256", None)  # no digest either before 2026-11-30
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))


def copy_on_rank0(source: Path, target: Path, change) -> None:
    """Rank 0 copies a checkpoint (or a file) and ``change``s the copy; every rank waits for it."""
    if torch.distributed.get_rank() == 0:
        (shutil.copytree if source.is_dir() else shutil.copyfile)(source, target)
        change(target)
    torch.distributed.barrier()


@contextmanager
def warnings_logged() -> Iterator[list[str]]:
    """The messages shardtrain logs at WARNING or above inside the block (on this rank)."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("shardtrain")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def unreadable_resumes(out: str, world: int) -> None:
    """A shard DCP cannot unpickle (checksums not verified): every rank raises one line naming the
    rank that failed and why, not "CheckpointException ranks:dict_keys([1])". A checkpoint without
    one rank's RNG file (saved before checksums, which would name it missing): the resume goes on,
    and rank 0 names that rank instead of it silently keeping fresh RNG states."""
    saved = Path(out, "split", "checkpoints", f"step-{N}")

    def zero_shard(copy: Path) -> None:
        shard = copy / "__1_0.distcp"
        shard.write_bytes(bytes(shard.stat().st_size))

    zeroed = Path(out, "zeroed", f"step-{N}")
    copy_on_rank0(saved, zeroed, zero_shard)
    cfg = ckpt_config(f"{out}/zeroed_run", world, resume=str(zeroed))
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, verify_checksums=False)
    try:
        new_trainer(cfg)
    except CheckpointError as exc:
        message = str(exc)
    else:
        raise AssertionError("a zeroed shard loaded")
    assert "\n" not in message and "CheckpointException" not in message, message
    # Both ranks read parts of the zeroed shard: the lowest failed rank is named.
    assert message.startswith(f"reading checkpoint {zeroed} failed on rank 0: UnpicklingError: "), message
    assert "resume another checkpoint" in message, message

    def drop_rng_of_rank1(copy: Path) -> None:
        (copy / "rng-rank1.pt").unlink()
        as_saved_before_checksums(copy)

    no_rng = Path(out, "no_rng", f"step-{N}")
    copy_on_rank0(saved, no_rng, drop_rng_of_rank1)
    with warnings_logged() as warned:
        resumed = new_trainer(ckpt_config(f"{out}/no_rng_run", world, resume=str(no_rng)))
    assert resumed.step == N
    named = [m for m in warned if "rng-rank<r>.pt for rank(s) 1:" in m]
    assert len(named) == (1 if resumed.env.is_main else 0), warned

    # Found by a scale review: an I/O error while one rank hashed its share (a stale handle, a
    # filesystem timeout; at 1,024 ranks some rank meets one) made every rank pass over a good
    # checkpoint as damaged, and a later save of its step move it aside. The run stops instead.
    copy_on_rank0(Path(out, "split", "checkpoints"), Path(out, "eio_run", "checkpoints"), lambda copy: None)
    hashed = integrity.file_sha256

    def failing_on_rank1(path):
        if torch.distributed.get_rank() == 1:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return hashed(path)

    message = unverifiable_resume(ckpt_config(f"{out}/eio_run", world), integrity, "file_sha256",
                                  failing_on_rank1, "a checkpoint one rank could not read")
    assert f"step-{2 * N}' could not be checked on rank 1 (OSError: [Errno 5]" in message, message
    assert "no sign of damage" in message and "skipping" not in message, message
    # ... and reading its checksums.json (found by review: still called damage)
    read_bytes = pathlib.Path.read_bytes

    def manifest_failing_on_rank1(self, *args, **kwargs):
        if self.name == integrity.MANIFEST_FILE and torch.distributed.get_rank() == 1:
            raise OSError(errno.ESTALE, "Stale file handle", str(self))
        return read_bytes(self, *args, **kwargs)

    message = unverifiable_resume(ckpt_config(f"{out}/eio_run", world), pathlib.Path, "read_bytes",
                                  manifest_failing_on_rank1,
                                  "a checkpoint whose checksums one rank could not read")
    assert "could not be checked on rank 1 (OSError: [Errno 116] Stale file handle" in message, message


def unverifiable_resume(cfg, owner: object, name: str, failing, what: str) -> str:
    """The CheckpointUnverifiable message of a resume with ``owner.name`` replaced by ``failing``
    (an I/O error on one rank), put back after."""
    original = getattr(owner, name)
    setattr(owner, name, failing)
    try:
        new_trainer(cfg)
    except CheckpointUnverifiable as exc:
        return str(exc)
    finally:
        setattr(owner, name, original)
    raise AssertionError(f"{what} was resumed")


@contextmanager
def file_size_limit(limit: int | None) -> Iterator[None]:
    """Writes past ``limit`` bytes fail with EFBIG in this process (``ulimit -f``; root too, where
    a read-only directory would not stop a write); None: no limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not death by SIGXFSZ
    if limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def saves_in_flight_anywhere(checkpointer) -> bool:
    """What the training step's all-reduce tells every rank: some rank's async save is unfinished."""
    flag = torch.tensor([float(checkpointer.save_in_flight())])
    torch.distributed.all_reduce(flag)
    return bool(flag.item())


def failed_saves(out: str, full: Trainer, split: Trainer) -> None:
    """Rank 1 cannot write its shard (a file size limit, as a full disk would): a blocking save and
    an async one (at the same poll on every rank, though rank 1 learns of it later) raise on every
    rank one line naming rank 1, the cause, the fix and the checkpoint left intact; nothing is
    committed and that checkpoint is untouched."""
    rank = torch.distributed.get_rank()
    for trainer, blocking in ((split, True), (full, False)):
        root = Path(trainer.cfg.run.dir, "checkpoints")
        last = root / f"step-{2 * N}"
        rng, shard = (last / "rng-rank1.pt").stat().st_size, (last / "__1_0.distcp").stat().st_size
        assert rng < shard, (rng, shard)
        before = {p.name: p.read_bytes() for p in last.iterdir()}
        step = 2 * N + 1
        message = (f"saving step {step} to {root / f'.step-{step}.tmp'} failed on rank 1: [Errno 27] "
                   f"File too large; raise the file size limit (ulimit -f) above a checkpoint file's "
                   f"size (step-{2 * N} is intact)")
        polls = 0
        if not blocking and rank == 1:  # rank 1 learns of the failure a second after rank 0
            trainer.checkpointer.finisher.submit(time.sleep, 1.0)
        with file_size_limit((rng + shard) // 2 if rank == 1 else None):
            try:
                trainer.checkpointer.save(step, tokens_seen=0, consumed_samples=0,
                                          global_batch=trainer.layout.global_batch, blocking=blocking)
                if not blocking:
                    assert trainer.checkpointer.pending is not None
                    while trainer.checkpointer.pending is not None:  # as the training loop polls
                        polls += 1
                        # A rank whose save is done waits while another rank's is not.
                        trainer.checkpointer.poll(in_flight_anywhere=True)
                        assert trainer.checkpointer.pending is not None
                        trainer.checkpointer.poll(saves_in_flight_anywhere(trainer.checkpointer))
                        time.sleep(0.05)
            except CheckpointError as exc:
                assert str(exc) == message, (blocking, str(exc))
            else:
                raise AssertionError(f"a save that could not be written succeeded (blocking={blocking})")
        if not blocking:  # every rank raised at the same poll, as it would at the same step
            counts = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(counts, polls)
            assert len(set(counts)) == 1 and counts[0] > 1, counts  # more than one: it waited
        assert not (root / f"step-{step}").exists()
        assert {p.name: p.read_bytes() for p in last.iterdir()} == before
    # Rank 1 cannot stage an async save (its host out of memory for the copy, before any of DCP's
    # collectives): every rank raises its one line at the save (found by review: rank 1 alone did,
    # rank 0 trained on into the next step's collectives), and nothing is left in flight.
    class HostFull(DefaultStager):
        def stage(self, state_dict, **kwargs):
            raise MemoryError("cannot allocate host memory")

    root, step = Path(full.cfg.run.dir, "checkpoints"), 2 * N + 1
    reused = full.checkpointer.async_stager
    if rank == 1:
        full.checkpointer.async_stager = lambda: HostFull(StagingOptions(False, False, False, False))
    try:
        full.checkpointer.save(step, tokens_seen=0, consumed_samples=0,
                               global_batch=full.layout.global_batch, blocking=False)
    except CheckpointError as exc:
        assert str(exc) == (f"saving step {step} to {root / f'.step-{step}.tmp'} failed on rank 1: "
                            "MemoryError: cannot allocate host memory; free host memory (an async save "
                            "copies this rank's model and optimizer state into it; checkpoint.async=false "
                            f"saves without that copy) (step-{2 * N} is intact)"), str(exc)
    else:
        raise AssertionError("an async save that one rank could not stage went on")
    finally:
        full.checkpointer.async_stager = reused
    assert full.checkpointer.pending is None and not (root / f"step-{step}").exists()
    # Rank 0 cannot make the directory to save into (a file holds its name): every rank raises its
    # error, rather than rank 1 waiting for it until the checkpoint group's timeout.
    root, step = Path(split.cfg.run.dir, "checkpoints"), 2 * N + 2
    blocked = root / f".step-{step}.tmp"
    copy_on_rank0(root / f"step-{2 * N}" / "trainer_state.json", blocked, lambda _: None)
    try:
        split.checkpointer.save(step, tokens_seen=0, consumed_samples=0,
                                global_batch=split.layout.global_batch, blocking=True)
    except CheckpointError as exc:
        assert str(exc).startswith(f"saving step {step} to {blocked} failed on rank 0: [Errno 20] Not a "
                                   "directory"), str(exc)
        assert str(exc).endswith(f"check run.dir's filesystem (free space, permissions, what is in "
                                 f"its checkpoints directory) (step-{2 * N} is intact)"), str(exc)
    else:
        raise AssertionError("saved into a file")
    # Rank 1 cannot write its RNG file, then rank 0 its consolidated weights (checkpoint.save_full):
    # both before DCP's collectives, which the other rank went on into alone; now every rank raises
    # the failed rank's one line.
    checkpointer = split.checkpointer
    checkpointer.ckpt = dataclasses.replace(checkpointer.ckpt, save_full=True)
    rng = (root / f"step-{2 * N}" / "rng-rank0.pt").stat().st_size
    weights = 4 * sum(p.numel() for p in split.model.parameters())
    assert rng < weights, (rng, weights)
    for failing, step, limit in ((1, 2 * N + 3, 16), (0, 2 * N + 4, (rng + weights) // 2)):
        with file_size_limit(limit if rank == failing else None):
            try:
                checkpointer.save(step, tokens_seen=0, consumed_samples=0,
                                  global_batch=split.layout.global_batch, blocking=True)
            except CheckpointError as exc:
                assert str(exc).startswith(f"saving step {step} to {root / f'.step-{step}.tmp'} failed on "
                                           f"rank {failing}: [Errno 27] File too large"), str(exc)
            else:
                raise AssertionError(f"rank {failing} could not write, yet the save succeeded")
    # Syncing the checkpoints directory fails after the rename (found by review: reported as a failed
    # save, "step-N is intact", though the step was complete and would be resumed): the line says so.
    from shardtrain.checkpoint import layout

    checkpointer.ckpt = dataclasses.replace(checkpointer.ckpt, save_full=False)
    step, synced = 2 * N + 5, layout.fsync_path

    def failing_on_root(path: Path) -> None:
        if Path(path).resolve() == root.resolve():
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        synced(path)

    layout.fsync_path = failing_on_root
    try:
        checkpointer.save(step, tokens_seen=0, consumed_samples=0, global_batch=split.layout.global_batch,
                          blocking=True)
    except CheckpointError as exc:
        assert re.fullmatch(f"step {step} is saved as .*step-{step}, but syncing .*checkpoints failed "
                            r"\(Input/output error\): a power loss may undo the rename; check the "
                            "filesystem", str(exc)), exc
    else:
        raise AssertionError("a failed sync of the checkpoints directory went unsaid")
    finally:
        layout.fsync_path = synced
    assert (root / f"step-{step}" / "trainer_state.json").is_file()
    # A weights source seen as one kind on rank 0 and another on rank 1 (a path that exists on some
    # nodes only: each kind reads with other collectives) stops both ranks, naming what each saw.
    seen = str(root / f"step-{2 * N}") if rank == 0 else str(root / "nowhere")
    try:
        agreed_source_kind(seen)
    except CheckpointError as exc:
        assert str(exc) == (f"{seen} is a checkpoint directory on rank 0 but nothing on rank 1; put it "
                            "on a filesystem every node mounts"), str(exc)
    else:
        raise AssertionError("ranks that see different things at one path went on")
    # A tracker that cannot start (they start on rank 0 only): every rank stops at start-up with its
    # one line, rather than the others waiting in the first step (a step left to train: a finished
    # run has nothing to do and starts no tracker).
    run = split.cfg.run
    split.cfg = dataclasses.replace(split.cfg, run=dataclasses.replace(
        run, trackers=["mlflow"], mlflow=dataclasses.replace(run.mlflow, tracking_uri="http://127.0.0.1:1")),
        trainer=dataclasses.replace(split.cfg.trainer, max_steps=split.step + 1))
    try:
        split.fit()
    except TrackerError as exc:
        assert "the MLflow tracking server http://127.0.0.1:1 cannot be reached" in str(exc), str(exc)
    else:
        raise AssertionError("a tracker that cannot start did not stop the run")


def bytes_read() -> int:
    """Bytes this process has read through read() calls so far (the kernel's count, any file)."""
    return int(re.search(r"^rchar: (\d+)$", Path("/proc/self/io").read_text(), re.M).group(1))


def save_at_four(out: str) -> None:
    """4 ranks FULL_SHARD: the uninterrupted reference, and a run stopped and saved at step N.

    Also the bytes each rank reads to commit that save (hashing for the manifest) and to verify it
    as a resume does: each rank its own share, not rank 0 (or every rank) all of it.
    """
    full = new_trainer(ckpt_config(f"{out}/full4", 4))
    dump(full, full.fit().losses, Path(out, "full4.pt"))
    first = new_trainer(ckpt_config(f"{out}/first4", 4))
    for _ in range(N):
        first.run_step()
    before_save = bytes_read()
    first.save_checkpoint(blocking=True)
    before_verify = bytes_read()
    first.checkpointer.verify_agreed(Path(out, "first4", "checkpoints", f"step-{N}"))
    reads = torch.tensor([before_verify - before_save, bytes_read() - before_verify])
    gathered = [torch.zeros_like(reads) for _ in range(4)]
    torch.distributed.all_gather(gathered, reads)
    dump(first, first.result.losses, Path(out, "first4.pt"))
    if first.env.is_main:
        torch.save(torch.stack(gathered), Path(out, "hash_reads4.pt"))
    shard_checks_split(out, first)
    sockets_of_groups(out)


@contextmanager
def stated_shard_files() -> Iterator[set[str]]:
    """The names of the .distcp files this process stats inside the block (``is_file`` stats too)."""
    names: set[str] = set()
    real = pathlib.Path.stat

    def stat(self, *args, **kwargs):
        if self.suffix == ".distcp":
            names.add(self.name)
        return real(self, *args, **kwargs)

    pathlib.Path.stat = stat
    try:
        yield names
    finally:
        pathlib.Path.stat = real


def shard_checks_split(out: str, trainer: Trainer) -> None:
    """A resume's structure check stats each shard file on one rank, not every file on every rank
    (a million stats at 1,024 ranks); a missing shard is still named on every rank, with or
    without checksums recorded."""
    saved = Path(out, "first4", "checkpoints", f"step-{N}")
    with stated_shard_files() as names:
        trainer.checkpointer.verify_agreed(saved)
    stated = [None] * 4
    torch.distributed.all_gather_object(stated, sorted(names))
    if trainer.env.is_main:
        Path(out, "shard_stats4.json").write_text(json.dumps(stated))
    for manifest in (True, False):
        def drop_shard(copy: Path, manifest: bool = manifest) -> None:
            (copy / "__3_0.distcp").unlink()
            if not manifest:
                as_saved_before_checksums(copy)

        copy = Path(out, f"missing_shard_{manifest}", f"step-{N}")
        copy_on_rank0(saved, copy, drop_shard)
        try:
            trainer.checkpointer.verify_agreed(copy)
        except CheckpointError as exc:
            assert "__3_0.distcp" in str(exc) and "missing" in str(exc), str(exc)
        else:
            raise AssertionError(f"a missing shard passed (manifest: {manifest})")


def open_sockets() -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


def sockets_of_groups(out: str) -> None:
    """Sockets a rank opens for a full-mesh gloo group and for a lazily connected one (the
    checkpoint group's kind), at creation and after one gather to rank 0."""
    timeout = datetime.timedelta(seconds=60)
    counts = []
    for make in (lambda: torch.distributed.new_group(backend="gloo", timeout=timeout),
                 lambda: lazily_connected_gloo_group(timeout)):
        before = open_sockets()
        group = make()
        created = open_sockets() - before
        torch.distributed.barrier()  # no rank connects for the gather before every rank counted
        torch.distributed.gather_object(1, [None] * 4 if torch.distributed.get_rank() == 0 else None,
                                        dst=0, group=group)
        counts.append([created, open_sockets() - before])
    gathered = [None] * 4
    torch.distributed.all_gather_object(gathered, counts)
    if torch.distributed.get_rank() == 0:
        Path(out, "group_sockets.json").write_text(json.dumps(gathered))


def resume_elsewhere(out: str, strategy: str, accum: int) -> None:
    """Resume the 4-rank checkpoint at this world size, with another strategy and batch split (and
    at 2 ranks with the embedding table gathered, where the 4 ranks exchanged its rows: the same
    DTensor layout, so the same checkpoint)."""
    world = int(os.environ["WORLD_SIZE"])
    source = f"{out}/first4/checkpoints/step-{N}"
    cfg = ckpt_config(f"{out}/resumed{world}-{strategy}", world, strategy=strategy, accum=accum,
                      resume=source)
    if world == 2:
        cfg.strategy = dataclasses.replace(cfg.strategy, embedding_lookup="gather")
    if strategy == "NO_SHARD":  # its final checkpoint holds a weight average for the read below
        cfg.trainer = dataclasses.replace(cfg.trainer, ema_decay=0.9)
    # What each rank reads: under NO_SHARD every rank is a replica, and the second takes the
    # model's and optimizer's tensors from the first (ReplicaLoadPlanner) instead of the files.
    with replica_reads() as planned:
        trainer = new_trainer(cfg)
    assert trainer.step == N
    dump(trainer, trainer.fit().losses, Path(out, f"resumed{world}-{strategy}.pt"))
    if strategy == "NO_SHARD":
        # A resume of the final checkpoint, which holds the average: its tensors too from the first
        final = Path(cfg.run.dir, "checkpoints", f"step-{2 * N}")
        elsewhere = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=f"{cfg.run.dir}-again"),
                                        checkpoint=dataclasses.replace(cfg.checkpoint, resume=str(final)))
        with replica_reads() as planned_again:
            again = new_trainer(elsewhere)
        pairs = zip(again.average.averages, trainer.average.averages, strict=True)
        assert again.checkpointer.average_restored and all(
            torch.equal(local_tensor(mine), local_tensor(saved)) for mine, saved in pairs), again.env.rank
        del again
        with replica_reads() as planned_average:
            averaged = average_read_into_the_weights(trainer)
        planned.extend(planned_again + planned_average)
        assert averaged, f"rank {trainer.env.rank}: the weights read are not the average saved"
    reads = [None] * world
    torch.distributed.all_gather_object(reads, planned)
    if trainer.env.is_main:
        Path(out, f"resumed{world}-{strategy}-reads.json").write_text(json.dumps(reads))


@contextmanager
def replica_reads() -> Iterator[list[int]]:
    """The DTensors each ``ReplicaLoadPlanner`` of this rank planned to read inside the block."""
    planned, plan_reads = [], layout.ReplicaLoadPlanner.create_local_plan

    def recorded(planner):
        plan = plan_reads(planner)
        targets = [planner.state_dict[item.dest_index.fqn] for item in plan.items]
        planned.append(sum(isinstance(target, DTensor) for target in targets))
        return plan

    layout.ReplicaLoadPlanner.create_local_plan = recorded
    try:
        yield planned
    finally:
        layout.ReplicaLoadPlanner.create_local_plan = plan_reads


def average_read_into_the_weights(trainer: Trainer) -> bool:
    """The final checkpoint's weight average read into the weights (as ``eval --ema`` and
    ``model.init_from`` read): whether every weight of this rank is then the average it saved. The
    weights are NaN before, so a replica that neither read nor received one fails."""
    saved = Path(trainer.cfg.run.dir) / "checkpoints" / f"step-{2 * N}"
    averages = [local_tensor(average).clone() for average in trainer.average.averages]
    held = [local_tensor(param) for param in trainer.average.parameters]
    with torch.no_grad():
        for weight in held:
            weight.fill_(float("nan"))
    weights.load_model_weights(trainer.model, str(saved), average=True)
    return all(torch.equal(weight, average.to(weight.dtype)) for weight, average in zip(held, averages,
                                                                                       strict=True))


def init_from(out: str, source: str, strategy: str = "FULL_SHARD") -> None:
    """model.init_from: weights only, from a checkpoint directory or a safetensors file. Under
    NO_SHARD the second replica reads none of the file's tensors, and holds every one all the same
    (each rank's own copy compared with the file: the gathered weights are the first's)."""
    world = int(os.environ["WORLD_SIZE"])
    cfg = ckpt_config(f"{out}/init{world}", world, strategy=strategy)
    cfg.model = dataclasses.replace(cfg.model, init_from=source)
    linked = Path(source).resolve() if Path(source).is_symlink() else None
    reads, read, verify = [], weights.read_own_rows, weights.verify_shared
    weights.read_own_rows = lambda param, part: (reads.append(param), read(param, part))[1]

    def verified_then_moved(path, *args):
        # A link such as another run's checkpoints/best, moved by that run once this one has checked
        # it: the weights are read from the checkpoint checked (found by review: from the link anew)
        metadata = verify(path, *args)
        if Path(source).is_symlink():
            Path(source).unlink()
            Path(source).symlink_to(Path(out, "elsewhere"))
        return metadata

    weights.verify_shared = verified_then_moved
    try:
        trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=small_corpus()))
    finally:
        weights.read_own_rows, weights.verify_shared = read, verify
    assert trainer.step == 0  # a new run: no optimizer state, no step
    if strategy == "NO_SHARD":
        rank, stored = trainer.env.rank, load_file(source)
        assert (len(reads) > 0) == (rank == 0), (rank, len(reads))
        for name, param in trainer.model.named_parameters():
            assert torch.equal(param.to_local(), stored[name]), (rank, name)
    gathered = trainer.full_weights()
    if trainer.env.is_main:
        torch.save(gathered, Path(out, f"init{world}.pt"))
    if linked is not None:
        lora_base_through_moving_link(out, cfg, source, linked)
        # A library caller's run.dir inside a checkpoint (the command line refuses it before launch):
        # keep_last would delete it with that checkpoint
        inside = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=f"{linked}/inner"))
        try:
            Trainer.create(inside, task=LanguageModelTask(corpus=small_corpus()))
        except CheckpointError as exc:
            assert f"is inside the checkpoint {str(linked)!r}" in str(exc), exc
            assert not Path(inside.run.dir).exists()  # nothing written into the checkpoint
        else:
            raise AssertionError("a run.dir inside a checkpoint was taken")


def lora_base_through_moving_link(out: str, cfg, link: str, base: Path) -> None:
    """A LoRA run's base through a link moved after the base's identity was taken, before the base
    was read: the identity recorded is the base read (found by review: the two resolved the link
    apart, and the read found the moved link's empty directory)."""
    Path(link).unlink()
    Path(link).symlink_to(base)
    identify = checkpointer_module.base_identity

    def identified_then_moved(*args, **kwargs):
        identity = identify(*args, **kwargs)
        Path(link).unlink()
        Path(link).symlink_to(Path(out, "elsewhere"))
        return identity

    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=f"{out}/lora_init"),
                              finetune=dataclasses.replace(cfg.finetune, method="lora"))
    checkpointer_module.base_identity = identified_then_moved
    try:
        trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=small_corpus()))
    finally:
        checkpointer_module.base_identity = identify
    assert trainer.checkpointer.base["source"] == str(base), trainer.checkpointer.base
    assert trainer.weights_source == str(base)


def sample_ids_match(parts: list[list[list[int]]], reference: list[list[int]]) -> None:
    joined = [step for part in parts for step in part]
    assert len(joined) == len(reference)
    for step, (got, want) in enumerate(zip(joined, reference, strict=True)):
        assert sorted(got) == sorted(want), f"step {step + 1}: samples differ"
    flat = np.concatenate([np.array(s) for s in joined])
    assert len(flat) == len(set(flat.tolist())), "a sample was repeated"
