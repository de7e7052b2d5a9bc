"""The checkpointer: sharded DCP saves that are complete or invisible, and exact resumes.

Saving (every rank): model and optimizer state as sharded DTensors through ``get_state_dict`` into a
temporary directory with ``dcp.save`` (or ``dcp.async_save``) on a process group of its own, plus this
rank's RNG states. When DCP's metadata exists, every rank has written its files; each rank hashes the
files it wrote and rank 0 gathers the digests (one collective on the checkpoint group), writes
``checksums.json`` and ``trainer_state.json``, renames the directory to its final name, and only
after that deletes checkpoints beyond ``keep_last``. The checkpoint group is used by nothing else, so
a save cannot deadlock with training collectives.

Loading (every rank): the directory's structure is checked and it is compared with the model before
DCP reads anything, on every rank from the same files; its checksums are verified with each rank
hashing about 1/world of the bytes and one all-gather of the verdicts, so a bad checkpoint makes every
rank raise the same error at once instead of hanging in a collective. DCP then reshards to the
current mesh.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import queue
import random
import re
import shutil
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from shardtrain import accelerator, faults
from shardtrain.checkpoint import integrity, layout, staging
from shardtrain.checkpoint.best import BestEvaluations
from shardtrain.checkpoint.dcp_errors import DCP_FAILURES, load_failed, raise_if_interrupted, save_failed
from shardtrain.checkpoint.safetensors_files import save_safetensors, shardtrain_metadata, unshared
from shardtrain.checkpoint.state import STATE_FILE, TrainState
from shardtrain.checkpoint.weights import (
    base_identity,
    check_model_compatible,
    check_same_base,
    file_fingerprints_share,
    is_dcp_source,
    source_path,
)
from shardtrain.config.compose import config_hash, config_hash_within, run_identity
from shardtrain.config.plan import ShardingPlan
from shardtrain.config.schema import Config
from shardtrain.distributed.agreement import agree, from_rank, gather_verdicts, raise_first_error, run_agreed
from shardtrain.distributed.env import lazily_connected_gloo_group
from shardtrain.distributed.parallelize import plain_float8_weights
from shardtrain.durable import written_durably
from shardtrain.errors import CheckpointError, CheckpointFromNewerVersion, CheckpointUnverifiable, first_line
from shardtrain.models.lora import is_adapter

log = logging.getLogger("shardtrain")

LOAD_FIX = ("resume another checkpoint, or check the filesystem it is on (with "
            "checkpoint.verify_checksums=true a damaged file is named before anything is read)")
# An optimizer group's settings a resume takes from the optimizer built now, not the checkpoint: its
# kernels and what the config sets besides the rate. Everything else (the rate; the running values
# some optimizers keep in their groups, Prodigy's d, schedule-free's weight sum) is the checkpoint's.
BUILT_GROUP_KEYS = ("fused", "foreach", "capturable", "differentiable", "weight_decay", "betas", "eps")


def built_group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's ``BUILT_GROUP_KEYS`` as the optimizer was built, to put back after a load."""
    return [{key: group[key] for key in BUILT_GROUP_KEYS if key in group} for group in optimizer.param_groups]


def restore_built_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    """``built_group_settings`` back in the groups a loaded state replaced, the step counts placed
    where those kernels keep them."""
    for group, built in zip(optimizer.param_groups, settings, strict=True):
        group.update(built)
    place_step_counts(optimizer)


def place_step_counts(optimizer: torch.optim.Optimizer) -> None:
    """Each parameter's ``step`` count where its group's kernel keeps it: on the parameter's device
    for fused or capturable groups, else on the CPU. torch places it by the saved group's flags; a
    resume under other kernels (``trainer.optimizer_kernel``) would otherwise hand a fused kernel a
    CPU count, or make the foreach path read a device count back twice per parameter each step."""
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, torch.Tensor):
                where = param.device if on_device else torch.device("cpu")
                if step.device != where:
                    optimizer.state[param]["step"] = step.to(where)


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors, ints, floats and strings only, so that the file loads
    with ``torch.load(weights_only=True)``: loading a checkpoint must never run code from it."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),  # (version, tuple of ints, None)
        "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
    }
    device_state = accelerator.rng_state()
    if device_state is not None:
        state["accelerator"] = device_state
    return state


def write_rng_state(file: Path) -> None:
    """This process's RNG states into ``file``, fsynced as DCP's own files are before the commit."""
    with written_durably(file) as f:
        torch.save(rng_state(), f)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    accelerator.set_rng_state(state.get("accelerator"))


def seed_random_streams(seed: int, stream: int, step: int = 0) -> None:
    """Every random stream a checkpoint restores (Python's, NumPy's, torch's on the CPU and on the
    accelerators), seeded from ``seed`` and ``stream`` (a data-parallel rank): a fresh run is
    reproduced by its seed, and its ranks draw different dropout masks. Unseeded, torch's CPU stream
    differed between two runs of one seed, and every CUDA rank started at the same default. A resume
    that cannot restore them seeds them from its ``step`` too: seeded as at step 0, each such resume
    drew step 1's dropout masks again (found by a review)."""
    entropy = [seed, stream] if step == 0 else [seed, stream, step]
    mixed = int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0])
    random.seed(mixed)
    np.random.seed(mixed % 2**32)
    torch.manual_seed(mixed)  # the CPU's and every accelerator's


@contextmanager
def random_streams_kept() -> Iterator[None]:
    """Every random stream a checkpoint restores (Python's, NumPy's, torch's, the accelerator's) as
    it was before the block: draws in it do not move the run off its saved course."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def first_sentence(exc: BaseException) -> str:
    """An exception's first sentence: torch's own advice after it (strict=False) is not ours."""
    return first_line(exc).split(". ")[0].rstrip(".")


def write_full_weights(full: dict[str, torch.Tensor], config: dict[str, Any], tokenizer: str | None,
                       file: Path) -> None:
    """``checkpoint.save_full``'s consolidated safetensors file (rank 0, which holds ``full``), as
    ``consolidate`` writes it: the run's model and data config, and its tokenizer, in its metadata."""
    if full:
        save_safetensors(unshared(full), file, shardtrain_metadata(config, tokenizer))
        layout.fsync_path(file)  # durable before the commit, as DCP's files are


def read_rng_state(file: Path) -> dict[str, Any]:
    """A rank's RNG file, unpickled with weights_only=True (no code runs), or a CheckpointError."""
    try:
        state = torch.load(file, weights_only=True, map_location="cpu")
        if not (isinstance(state, dict) and {"python", "numpy", "torch"} <= state.keys()):
            raise ValueError("not a shardtrain RNG state")
    except Exception as exc:  # unpickling damaged or foreign bytes raises many different types
        # torch's own message is a page long and suggests weights_only=False: keep only the culprit.
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        why = f"it pickles {refused.group(1)}" if refused else type(exc).__name__
        raise CheckpointError(
            f"{file} is unreadable with weights_only=True ({why}); if an older shardtrain wrote it "
            "(numpy arrays pickled), delete the checkpoint's rng-rank*.pt files to resume without RNG "
            "states, otherwise use another checkpoint"
        ) from exc
    return state


def check_scheduler_state(path: Path, state: TrainState, param_groups: int) -> None:
    """The learning-rate scheduler's saved state, before ``load_state_dict`` takes it as it is (a
    hand-edited or damaged one failed later as a traceback, or resumed at another rate): a base rate
    per parameter group and a position between 0 and the checkpoint's step (a skipped step does not
    advance it)."""
    saved = state.scheduler
    base, last, lambdas = saved.get("base_lrs"), saved.get("last_epoch"), saved.get("lr_lambdas")

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    problem = None
    if not (isinstance(base, list) and len(base) == param_groups
            and all(number(lr) and lr >= 0 for lr in base)):
        problem = (f"'base_lrs' is {json.dumps(base)[:60]}, not {param_groups} learning rates (one per "
                   "parameter group)")
    elif not (isinstance(last, int) and not isinstance(last, bool) and 0 <= last <= state.step):
        problem = (f"'last_epoch' is {json.dumps(last)[:40]}, not a step from 0 to the checkpoint's "
                   f"{state.step}")
    elif not (isinstance(lambdas, list) and len(lambdas) == param_groups
              and all(entry is None or isinstance(entry, dict) for entry in lambdas)):
        # LambdaLR's load_state_dict indexes it per group: a KeyError or TypeError traceback
        problem = (f"'lr_lambdas' is {json.dumps(lambdas)[:40]}, not one entry (null) per parameter "
                   "group")
    if problem is not None:
        raise CheckpointError(f"checkpoint {str(path)!r}: the scheduler state in {STATE_FILE} is damaged "
                              f"({problem}); use another checkpoint")


def drop_unsaved_optimizer_state(optim_state: dict[str, Any], saved_keys) -> list[str]:
    """Leave out of ``optim_state`` the parameters the checkpoint holds no optimizer state for.

    AdamW makes a parameter's state on its first gradient, so a parameter that never had one (a
    head that is not used, a frozen part) has none in the checkpoint, while torch's
    ``get_state_dict`` makes state for every parameter of a fresh optimizer. Loaded as it is, DCP
    would miss those keys; left out, the resumed optimizer is the saved one: still no state there.
    """
    state = optim_state.get("state", {})
    # DCP's flattened keys: optim.state.<parameter name>.<state name> (the state name has no dot)
    saved = {key.removeprefix("optim.state.").rpartition(".")[0] for key in saved_keys
             if key.startswith("optim.state.")}
    unsaved = [fqn for fqn in state if fqn not in saved]
    for fqn in unsaved:
        del state[fqn]
    return unsaved


@dataclass
class PendingSave:
    step: int
    tmp: Path
    future: Future
    started: float
    trainer_state: TrainState


def agreed_base_identity(cfg: Config, source: str | None = None) -> dict[str, Any]:
    """The LoRA base's identity (``base_identity``), taken on every node, since each rank reads its
    own rows of the base: a rank that cannot read its copy, or a node whose copy differs, stops every
    rank together (alone, it left its peers waiting in the next collective, or trained on another
    base). ``source``: the base's path as the run reads it (``resolved_weights_source``), in place of
    the config's."""
    if source is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=source))
    known = node_file_fingerprints(cfg)
    identity = run_agreed(lambda: base_identity(cfg.model, cfg.trainer.seed, cfg.finetune, known))
    fingerprints = agree(None, identity.get("fingerprint"), error_type=CheckpointError)
    differing = next((rank for rank, found in enumerate(fingerprints) if found != fingerprints[0]), None)
    if differing is not None:
        raise from_rank(CheckpointError(
            f"the base weights {identity['source']!r} differ between ranks (rank {differing}'s copy has "
            "other contents than rank 0's): give every node the same files"), differing)
    return identity


class BackgroundDeleter:
    """Rank 0 deletes what keep_last prunes in a thread of its own, one directory after another,
    after ``layout.prune`` renamed it: every other rank waited in the commit's broadcast while rank 0
    deleted (minutes for a large model's checkpoint on a shared filesystem; found by a scale review).
    A daemon thread: a process that fails does not wait, unwatched, for a deletion at its exit (its
    ``.step-N.deleting`` is removed at the next start)."""

    def __init__(self) -> None:
        self.queue: queue.Queue[Path] = queue.Queue()
        self.pending: set[Path] = set()
        self.done = threading.Condition()
        self.thread: threading.Thread | None = None
        DELETERS.add(self)

    def submit(self, directory: Path) -> None:
        with self.done:
            self.pending.add(directory)
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, name="shardtrain-delete", daemon=True)
            self.thread.start()
        self.queue.put(directory)

    def busy(self) -> list[Path]:
        """The directories queued or being deleted."""
        with self.done:
            return list(self.pending)

    def wait(self) -> None:
        with self.done:
            self.done.wait_for(lambda: not self.pending)

    def run(self) -> None:
        while True:
            directory = self.queue.get()
            try:
                shutil.rmtree(directory)
            except Exception as exc:  # as a failed rename is (the new checkpoint is committed); and
                # the thread goes on: ended, it left every later deletion waited for without end
                log.warning(f"checkpoint: deleting {directory} failed ({exc}); delete it by hand to free "
                            "its space")
            finally:
                with self.done:
                    self.pending.discard(directory)
                    self.done.notify_all()


# This process's deleters (weakly): a later Trainer's start in the same run.dir (a library user's,
# after a first one failed) waits for them before removing what interrupted deletions left, which
# it would otherwise delete beside them (review).
DELETERS: weakref.WeakSet[BackgroundDeleter] = weakref.WeakSet()


def wait_deletions_in(root: Path) -> None:
    """Until no deleter of this process is removing a directory in ``root``."""
    for deleter in list(DELETERS):
        if any(path.parent.resolve() == root.resolve() for path in deleter.busy()):
            deleter.wait()


def node_file_fingerprints(cfg: Config) -> dict[int, str] | None:
    """The base's file fingerprints (``files_fingerprint``'s, 3 MiB read a file) read once a node,
    each of its ranks reading a share, then all-gathered: read by every rank, a 405B base's 191 files
    were 570 MiB a rank from the shared filesystem, 570 GiB at each start of 1,024 ranks. A node
    still reads its own copy (a node-local copy that differs is found). None: nothing to share (a
    random or DCP base, a lone process)."""
    source = cfg.model.weights_source()
    if source is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    local_rank, shares = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # Read under agreement, gathered after it: a rank that cannot read its files must not leave the
    # others in the gather.
    mine = run_agreed(lambda: None if is_dcp_source(source) or shares == 1
                      else file_fingerprints_share(source, local_rank, shares))
    # The same files: a path on the same host (ranks given copies of their own read them alone).
    # Gathered on every rank, also where this one has nothing to share: a path that is a DCP
    # checkpoint on some nodes only must not split the ranks between collectives.
    here = (socket.gethostname(), str(source_path(source).resolve()))
    everyone = agree(None, (here, mine), error_type=CheckpointError)
    if mine is None:
        return None
    return {index: digest for where, share in everyone if where == here and share
            for index, digest in share.items()}


def undo_creation_step(optimizer: torch.optim.Optimizer, optim_state: dict[str, Any]) -> None:
    """torch's ``get_state_dict`` creates an empty optimizer's state by a step with zero gradients at
    learning rate 0: AdamW's moments stay zero, but its step count becomes 1, in the live optimizer
    and the checkpoint, and the first real update then took step 2's bias correction (0.735 of
    the update with betas 0.9, 0.95: a save after skipped first steps, found by review). The counts
    go back to 0: zero moments at step 0 are a fresh state."""
    for states in (optimizer.state.values(), optim_state.get("state", {}).values()):
        for state in states:
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                state["step"] = 0


class Checkpointer:
    """Saves and restores model, optimizer, scheduler and RNG; the run's counters travel in
    ``TrainState``."""

    def __init__(self, cfg: Config, plan: ShardingPlan, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 rank: int, world_size: int, requested_hash: str,
                 average: dict[str, torch.Tensor] | None = None, best: BestEvaluations | None = None,
                 stop_margin_s: float = 0.0, base_source: str | None = None) -> None:
        self.cfg = cfg
        # run_identity_hash of the config before start-up resolved it (TrainState.config_hash): what
        # tells a requeue of this run, at any world size, from another run.
        self.requested_hash = requested_hash
        self.plan = plan
        self.ckpt = cfg.checkpoint
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.rank = rank
        self.world_size = world_size
        self.root = Path(cfg.run.dir) / layout.CHECKPOINTS_DIR
        self.pending: PendingSave | None = None
        # (path, DCP metadata) of the checkpoint resume_path checked, so load does not read it again.
        self.verified_metadata: tuple[Path, Any] | None = None
        # Checkpoints whose checksums failed at resume: a save of their step moves them aside, and
        # keep_last neither counts nor deletes them.
        self.damaged: set[Path] = set()
        # Checkpoint collectives get their own gloo group: an async save's thread can then never
        # interleave with a training collective on the default group (a known deadlock).
        # Its timeout is the save's bound, not the step's: a large save may take longer than a step;
        # plus ``stop_margin_s``, the longest the watchdog's stop takes, so that a rank stuck in a
        # save is stopped by its watchdog (status 124, its stacks) before a peer's gloo timeout names
        # the peer and the filesystem (found by review: equal bounds, and the peer won the race).
        # Its pairs of ranks connect on first use: not a second full mesh of sockets.
        self.group = lazily_connected_gloo_group(datetime.timedelta(
            seconds=max(cfg.dist.timeout_s, cfg.checkpoint.save_timeout_s) + stop_margin_s))
        # Finishing an async save (waiting for its files, hashing this rank's, then on rank 0 writing
        # the manifest and trainer state, renaming and pruning) runs here, off the training thread.
        self.finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardtrain-ckpt")
        # Rank 0 deletes what keep_last prunes here, after renaming it: every other rank waits in the
        # commit's broadcast for rank 0, and deleting a large model's checkpoint (terabytes, thousands
        # of files on a shared filesystem) took minutes of every GPU's time at each save.
        self.deleter = BackgroundDeleter()
        # Made at the first async save (a run that never saves asynchronously holds no buffers).
        self.stager: DefaultStager | None = None
        self.stager_checked = False
        # finetune=lora: only the adapters (the trainable parameters) and their optimizer state are
        # saved; the frozen base is read again from where it came from, which this identifies.
        self.adapters_only = cfg.finetune.method != "none"
        self.base = agreed_base_identity(cfg, base_source) if self.adapters_only else None
        # trainer.ema_decay: the weights' average, saved as ``ema.<name>`` and loaded in place; whether
        # the last load found one (a checkpoint saved without it leaves it to the caller).
        self.average = average
        self.average_restored = False
        # trainer.monitor's judge (checkpoint.keep_best, trainer.early_stop_patience): its record goes
        # into every save's trainer state, and the prune after the commit keeps the steps it ranks.
        self.best = best
        self.best_link_warned = False

    # ---- finding what to resume ----------------------------------------------------------

    def resume_path(self) -> Path | None:
        """The checkpoint ``checkpoint.resume`` selects, or None to start fresh; then rank 0 deletes
        what crashed saves and deletions left in the run's checkpoints (``remove_abandoned``)."""
        path = self.choose_resume()
        # A dry run changes no file of the run: started beside a live run of the same run.dir, it
        # deleted the .tmp of the save that run was writing.
        if self.rank == 0 and not self.cfg.diagnostics.dry_run:
            self.remove_abandoned(path)
        return path

    def steps_held(self, path: Path) -> set[int] | None:
        """The steps of this run's complete checkpoints when ``path`` lies among them (the resumed
        checkpoint's ranking names only those), else None: another run's. As rank 0 sees it, so
        every rank gets the same answer (relative paths or mounts that differ between nodes cannot
        split them)."""
        verdict: list[set[int] | None] = [None]
        if self.rank == 0 and path.resolve().parent == self.root.resolve():
            verdict[0] = {step for step, _ in layout.candidates(self.root).complete}
        dist.broadcast_object_list(verdict, src=0, group=self.group)
        return verdict[0]

    def remove_abandoned(self, resumed: Path | None) -> None:
        """Rank 0 only, once the ranks agreed on what to resume (the others read nothing of these
        directories after that). A failure is a warning: the run can go on without the space."""
        wait_deletions_in(self.root)
        try:
            removed = layout.remove_abandoned(self.root, keep=resumed, delete_later=self.deleter.submit)
        except OSError as exc:
            log.warning(f"checkpoint: deleting what an interrupted save or deletion left in {self.root} "
                        f"failed ({exc}); delete its .step-*.tmp and .step-*.deleting directories by hand")
            return
        if removed:
            log.info(f"checkpoint: deleting {', '.join(p.name for p in removed)} in {self.root} (left by "
                     "an interrupted save or deletion; never loadable)")

    def choose_resume(self) -> Path | None:
        """The checkpoint ``checkpoint.resume`` selects, or None to start fresh."""
        choice, complete = self.resume_candidates()
        if choice == "none":
            return None
        if choice != "auto":
            path = Path(choice).expanduser()
            # fails rather than falls back
            self.verified_metadata = (path, self.verify_agreed(path, refuse_newer=True))
            return path
        # Newest first, reading .metadata and hashing only until one passes: not every checkpoint of
        # the run on every start, on every rank.
        for step, path in reversed(complete):
            try:
                self.verified_metadata = (path, self.verify_agreed(path))
            except CheckpointUnverifiable:
                raise  # not the checkpoint's fault: never skipped (and later moved aside) for it
            except CheckpointError as exc:
                self.info(f"resume: skipping {path}: {exc}")
                self.damaged.add(path)
                continue
            self.info(f"resume: newest complete checkpoint is {path} (step {step})")
            return path
        if complete:  # starting fresh would bury the run's progress under new checkpoints
            raise CheckpointError(
                f"every checkpoint in {self.root} fails its checks (see the lines above); where they "
                "failed their checksums and you accept the damage, resume the newest with "
                "checkpoint.verify_checksums=false (an older one: move the later ones out of the "
                "directory first), or start fresh in a new run.dir"
            )
        return None

    def resume_candidates(self) -> tuple[str, list[tuple[int, Path]]]:
        """What ``checkpoint.resume`` comes to on every rank alike: ``none``, a path, or ``auto`` with
        the run's complete checkpoints, oldest first. Rank 0 reads the directory (every rank's own
        listing could differ on a network filesystem's cache, and a rank that found nothing would
        skip the verification the others wait in); a restart is one where any rank's attempt
        counter says so (torchrun counts a node's own failures only: a healthy node restarted for
        another node's failure keeps 0)."""
        restarts = agree(None, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), self.group,
                         error_type=CheckpointError)
        decision, error = None, None
        if self.rank == 0:
            try:
                decision = self.decide_resume(restarted=max(restarts) > 0)
            except (CheckpointError, OSError) as exc:  # OSError: the directory cannot be listed
                error = str(exc) or type(exc).__name__
        return agree(error, decision, self.group, error_type=CheckpointError)[0]

    def decide_resume(self, restarted: bool) -> tuple[str, list[tuple[int, Path]]]:
        """Rank 0: ``resume_candidates`` from the run's checkpoint directory."""
        choice = self.ckpt.resume
        if choice != "auto" and self.saved_by_earlier_attempt(choice, restarted):
            # A restarted attempt or a requeued job goes on from this run's newest checkpoint, not
            # from the start's choice (which would repeat or refuse the steps it saved before).
            self.info(f"resume: this run's checkpoints after resume={choice} were saved by an earlier "
                      "attempt or job of it: going on from the newest")
            choice = "auto"
        if choice == "none":
            layout.refuse_fresh_start(self.root)
        if choice != "auto":
            # Resolved once, here, for every rank: a link another run moves (its checkpoints/best),
            # read through by each rank at its own time, could give ranks different steps.
            return ("none" if choice == "none" else str(Path(choice).expanduser().resolve())), []
        found = layout.candidates(self.root)
        for path, why in found.skipped:
            self.info(f"resume: skipping {path}: {why}")
        return choice, found.complete

    def saved_by_earlier_attempt(self, choice: str, restarted: bool) -> bool:
        """Whether the run's checkpoints after the one ``choice`` names were saved by an earlier
        attempt (a torchrun restart) or job (a Slurm requeue) of this run, not left by another run
        (whose later steps are refused: going on from them would undo that refusal). The attempts
        share their ``checkpoint.resume``, recorded in each checkpoint's config; every rank reads
        the same files. ``resume=none`` started only where there were no checkpoints: a restart, or
        a requeued Slurm job (``SLURM_RESTART_COUNT``), goes on from its own checkpoints, all saved
        under its config; a new job, or a restart of one that refused another run's, refuses them
        (``refuse_fresh_start``)."""
        if choice == "none":
            # A restarted attempt's or requeued job's checkpoints are this run's when each was saved
            # with resume=none under the same config: any checkpoint counted for a restart, and an
            # attempt that had refused another run's checkpoints took them over at its restart
            # (found by review).
            return (restarted or layout.slurm_requeued()) and layout.saved_by_same_resume(
                self.root, choice, self.same_config)
        # The same config too: the same resume with another learning rate is a new run, not a requeue.
        # Checkpoints saved before 2026-11-30 hold the hash of the config as resolved (a requeue at
        # the same world size still matches it).
        return layout.saved_by_same_resume(self.root, choice, self.same_config)

    def same_config(self, state: TrainState) -> bool:
        """Whether a checkpoint was saved under this run's config, wherever it ran (the hash of the
        config without its devices and nodes), or as resolved (checkpoints saved before 2026-11-30);
        a checkpoint saved before a key joined the schema is compared over the keys it has."""
        hashes = {self.requested_hash, config_hash(self.cfg)}
        if state.config_hash in hashes:
            return True
        return state.config_hash in {config_hash_within(run_identity(self.cfg), state.config),
                                     config_hash_within(self.cfg, state.config)}

    def verify_agreed(self, path: Path, refuse_newer: bool = False) -> Any:
        """DCP's metadata of the checkpoint at ``path``, checked by every rank and agreed on.

        Each rank runs the structure checks (of the shard files, its 1/world of them) and hashes
        its share of the recorded files (about 1/world of the bytes); one all-gather of the verdicts
        (the path each rank checked and any error included) makes every rank return, or raise the
        same error, together: no rank goes on alone to a later collective or to another checkpoint.
        ``refuse_newer`` (a resume from a path given by hand) also refuses a run directory that holds
        later checkpoints than it.
        """
        # Why a check failed other than by damage: "io" (the filesystem or the host), "newer" (a
        # newer shardtrain's format); neither is skipped (and later moved aside) as damage.
        metadata, files, unverifiable = None, None, None
        try:
            # This rank's part of the shard files only: the all-gather below shares the verdicts.
            metadata = layout.verify(path, share=(self.rank, self.world_size))
            if refuse_newer:
                layout.refuse_newer_checkpoints(self.root, path)
            files = integrity.read_manifest(path) if self.ckpt.verify_checksums else None
            share = [] if files is None else integrity.verification_share(files, self.rank, self.world_size)
            error, damaged = None, {} if files is None else integrity.damaged_files(path, files, share)
        except CheckpointFromNewerVersion as exc:
            error, damaged, unverifiable = str(exc), {}, "newer"
        except (CheckpointError, FileNotFoundError) as exc:  # a file gone since: as a missing one
            error, damaged = str(exc), {}
        except (OSError, MemoryError) as exc:  # an I/O error, a stale handle, the host's memory
            error, damaged, unverifiable = f"{type(exc).__name__}: {exc}", {}, "io"
        verdicts = gather_verdicts(error, (str(path), damaged, unverifiable), self.group)
        seen = [checked for _, (checked, _, _) in verdicts]
        if differing := [rank for rank, checked in enumerate(seen) if checked != seen[0]]:
            raise CheckpointError(
                f"ranks chose different checkpoints to resume ({seen[0]} on rank 0, "
                f"{seen[differing[0]]} on rank {differing[0]}); every rank must see the same "
                "run.dir: put it on a filesystem every node mounts")
        if newer := next((error for error, (_, _, unchecked) in verdicts if unchecked == "newer"), None):
            raise CheckpointFromNewerVersion(newer)
        if failed := next(((rank, error) for rank, (error, (_, _, unchecked)) in enumerate(verdicts)
                           if unchecked), None):
            raise CheckpointUnverifiable(
                f"checkpoint {str(path)!r} could not be checked on rank {failed[0]} ({failed[1]}): the "
                "filesystem or the host failed, which is no sign of damage, so the run stops rather "
                "than pass over a checkpoint that may be good; start it again once the filesystem "
                "answers (a requeued job retries)")
        raise_first_error(verdicts, CheckpointError)
        if damaged := {name: why for _, (_, part, _) in verdicts for name, why in part.items()}:
            raise integrity.damage_error(path, damaged)
        if self.ckpt.verify_checksums and files is None and self.rank == 0:
            integrity.warn_unrecorded(path)
        return metadata

    # ---- saving --------------------------------------------------------------------------

    def training_state(self) -> dict[str, Any]:
        created = not self.optimizer.state  # no update yet (every step so far skipped)
        model_state, optim_state = get_state_dict(
            self.model, self.optimizer, options=StateDictOptions(ignore_frozen_params=self.adapters_only))
        if created:
            undo_creation_step(self.optimizer, optim_state)
        if self.adapters_only:  # DCP keeps a frozen tied head (Qwen2's lm_head): a whole embedding
            model_state = {name: value for name, value in model_state.items() if is_adapter(name)}
        # torchao's float8 weights as plain tensors: readable without torchao imported
        state = {"model": plain_float8_weights(model_state), "optim": plain_float8_weights(optim_state)}
        if self.average is not None:
            state[layout.AVERAGE_KEY] = self.average
        return state

    def save(self, step: int, *, tokens_seen: int, consumed_samples: int, global_batch: int,
             blocking: bool = False, evaluation_due: bool = False,
             train_samples: int | None = None, train_part_samples: list[int] | None = None,
             train_packing: str | None = None, tokenizer: str | None = None,
             logged_since: dict[str, Any] | None = None, started: float | None = None) -> float:
        """Start (async) or do (sync) a save; returns the seconds training was blocked since
        ``started`` (a ``time.perf_counter()``; default now), the wait for a save still in flight
        included. ``evaluation_due``: the evaluation due at this step has not run (a preemption's
        save)."""
        start = time.perf_counter() if started is None else started
        self.wait()  # one save in flight at a time
        final, tmp = layout.step_dir(self.root, step), layout.tmp_dir(self.root, step)
        prepared: list[str | None] = [None]
        if self.rank == 0:
            try:
                with self.save_errors(step, tmp):  # an OSError of these checks too: one line
                    if final.exists() and final not in self.damaged and layout.is_complete(final):
                        raise CheckpointError(f"{final} already exists; refusing to overwrite a checkpoint")
                    self.prepare(final, tmp)
            except CheckpointError as exc:
                prepared[0] = str(exc)
        # Every rank waits for the directory, and learns whether rank 0 could make it (or refused to
        # overwrite a checkpoint): all raise its error together rather than the others waiting in
        # DCP's collectives until the timeout.
        dist.broadcast_object_list(prepared, src=0, group=self.group)
        if prepared[0] is not None:
            raise CheckpointError(prepared[0])
        # This rank's own files: a full disk is said in one line, and on every rank together (the
        # others would go on into DCP's collectives, or the full weights' gather, without it).
        rng = layout.rng_file(self.rank)
        run_agreed(lambda: self.write_file(step, tmp, write_rng_state, rng), self.group)
        faults.inject("save", self.rank, step)
        state = self.training_state()
        trainer_state = TrainState.capture(
            self.cfg, self.plan, requested_hash=self.requested_hash, step=step, tokens_seen=tokens_seen,
            consumed_samples=consumed_samples,
            global_batch=global_batch, scheduler=self.scheduler.state_dict(), world_size=self.world_size,
            base_weights=self.base, best=None if self.best is None else self.best.state(),
            evaluation_due=evaluation_due, train_samples=train_samples,
            train_part_samples=train_part_samples, train_packing=train_packing, tokenizer=tokenizer,
            logged_since=logged_since,
        )
        if self.ckpt.save_full:
            full = get_model_state_dict(  # a collective; rank 0 holds the whole model
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if self.rank != 0:
                full = {}
            write = partial(write_full_weights, full, trainer_state.config, trainer_state.tokenizer)
            run_agreed(lambda: self.write_file(step, tmp, write, "model.safetensors"), self.group)
        if self.ckpt.async_save and not blocking:
            # Staging copies the state before this returns (agreed by every rank); the write and the
            # commit run behind.
            stager = staging.AgreedStager(self.async_stager(), self.group,
                                          partial(self.save_errors, step, tmp))
            written = None
            try:
                with self.save_errors(step, tmp):
                    written = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group,
                                             async_stager=stager)
            finally:
                stager.release_after(written)
            finished = self.finisher.submit(self.finish_async, written, step, tmp, trainer_state)
            self.pending = PendingSave(step, tmp, finished, time.perf_counter(), trainer_state)
            blocked = time.perf_counter() - start
            self.info(f"checkpoint step {step}: async save started, training blocked {blocked:.3f}s")
            return blocked
        # DCP's own collectives make every rank raise its failure together (the same one).
        with self.save_errors(step, tmp):
            dcp.save(state, checkpoint_id=str(tmp), process_group=self.group)
        # The others wait for rank 0's commit (writing two small files, renaming, pruning) in it,
        # under the save's bound, rather than in the next step's first collective under the step's.
        self.commit(step, tmp, trainer_state)
        blocked = time.perf_counter() - start
        self.info(f"checkpoint step {step}: saved to {final} in {blocked:.3f}s")
        return blocked

    def prepare(self, final: Path, tmp: Path) -> None:
        """Rank 0: an empty ``tmp`` to save into; a damaged ``final`` of the same step moved aside."""
        if final.exists():  # damaged (resume skipped it): keep it aside for inspection
            aside = final.with_name(f"{final.name}.damaged-{int(time.time())}")
            final.rename(aside)
            self.damaged.discard(final)  # the new step-N that replaces it is counted again
            self.info(f"checkpoint: moved damaged {final.name} to {aside.name}")
        if tmp.exists():  # left by a crashed save of this step
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    @contextmanager
    def save_errors(self, step: int, tmp: Path) -> Iterator[None]:
        """A failure of the save of ``step`` (DCP's gathered ``CheckpointException``, which derives
        from BaseException, or an OSError of a file written here) as one CheckpointError naming the
        rank, the cause and the fix, and the checkpoint the failure left intact."""
        try:
            yield
        except CheckpointError:
            raise
        except DCP_FAILURES as exc:
            raise_if_interrupted(exc)
            raise CheckpointError(save_failed(step, tmp, exc, self.newest_intact(step), self.rank)) from exc

    def newest_intact(self, step: int) -> str | None:
        """The name of the newest complete checkpoint before ``step`` (a failed save never touches
        it), or None."""
        kept = [path for saved, path in layout.candidates(self.root).complete
                if saved < step and path not in self.damaged]
        return kept[-1].name if kept else None

    def async_stager(self) -> DefaultStager | None:
        """The run's stager with reused host buffers (``checkpoint.reuse_staging``), or None for
        DCP's fresh copy per save. Buffers are reused only after the previous save has been written:
        ``save`` waits for it first."""
        if not self.stager_checked and self.ckpt.reuse_staging:
            device = next(iter(self.model.parameters())).device
            self.stager = staging.reused_stager(device)
        self.stager_checked = True
        return self.stager

    def close(self, wait_deletions: bool = True) -> None:
        """Release the staging buffers once no save is in flight (the finisher thread ends with the
        process), and let the deletions finish, unless not ``wait_deletions``: a preempted run's exit
        does not wait minutes for a pruned checkpoint's deletion on a shared filesystem, past the
        grace its scheduler gives (found by review); its ``.step-N.deleting`` goes at the next start.
        A later async save stages into a fresh copy."""
        self.wait()
        if wait_deletions:
            self.deleter.wait()
        elif left := self.deleter.busy():
            self.info(f"checkpoint: the preempted run leaves {', '.join(map(str, left))} to the next start "
                      "to delete")
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def write_file(self, step: int, tmp: Path, write: Callable[[Path], None], name: str) -> None:
        """``write(tmp / name)``, its failure said as ``save_errors`` says it."""
        with self.save_errors(step, tmp):
            write(tmp / name)

    def commit(self, step: int, tmp: Path, trainer_state: TrainState) -> None:
        """Every rank hashes the files it wrote (their pages are still cached), rank 0 gathers the
        digests, records them and makes the checkpoint visible under its final name; then every
        rank learns how that went, so all of them raise the same error or none does (one failing
        alone would leave the others waiting in a later collective until its timeout)."""
        failure: str | None = None
        try:
            # This rank's files by name, no listing: rank 0 hashes anything else (.metadata,
            # model.safetensors) when it writes the manifest.
            with self.save_errors(step, tmp):
                if not (tmp / layout.rng_file(self.rank)).is_file():
                    raise CheckpointError(
                        f"save of step {step}: rank {self.rank}'s {layout.rng_file(self.rank)} is gone from "
                        f"{tmp} since it was written: something else removed files of this save (another "
                        "shardtrain started in this run.dir?); the save is abandoned, earlier checkpoints "
                        "stay as they were")
                entries: dict[str, Any] | str = integrity.hash_entries(
                    tmp, integrity.files_of_rank(tmp, self.rank))
        except CheckpointError as exc:
            entries = str(exc)  # goes to rank 0 in place of the digests
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(entries, gathered, dst=0, group=self.group)
        if self.rank == 0:
            try:
                self.finalize(step, tmp, trainer_state, gathered)
            except CheckpointError as exc:
                failure = str(exc)
        outcome = [failure]
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        if outcome[0] is not None:
            raise CheckpointError(outcome[0])

    def finalize(self, step: int, tmp: Path, trainer_state: TrainState, gathered: list[Any]) -> None:
        """Rank 0: the manifest from every rank's digests, the trainer state, the rename, the prune."""
        if errors := [part for part in gathered if isinstance(part, str)]:
            raise CheckpointError(errors[0])  # a rank could not read back what it wrote
        if not (tmp / layout.METADATA_FILE).is_file():
            raise CheckpointError(f"save of step {step} produced no DCP metadata in {tmp}")
        with self.save_errors(step, tmp):
            integrity.write_manifest(tmp, {name: e for part in gathered for name, e in part.items()})
            trainer_state.write(tmp)  # stays the last file written
            # The files' names in the directory must be on disk before it is renamed complete: a
            # crash must not leave a step-N whose entries were lost.
            layout.fsync_path(tmp)
            tmp.rename(final := layout.step_dir(self.root, step))
        try:
            layout.fsync_path(self.root)
        except OSError as exc:  # after the rename: the save is complete, its durability is not
            raise CheckpointError(f"step {step} is saved as {final}, but syncing {self.root} failed "
                                  f"({exc.strerror or type(exc).__name__}): a power loss may undo the "
                                  "rename; check the filesystem") from exc
        # The link first: its target, this step or a ranked one, is never pruned, while the one
        # it named before may be.
        self.point_best(trainer_state)
        self.prune(step, trainer_state.best_steps())

    def finish_async(self, written: Future, step: int, tmp: Path, trainer_state: TrainState) -> None:
        # DCP's failure reaches the next poll (or close) as the same one line a blocking save gives.
        with self.save_errors(step, tmp):
            written.result()
        faults.inject("commit", self.rank, step)
        # On every rank in the same order after DCP's own collectives of this save, and before the
        # next save (which waits for this one): the group sees one sequence of collectives.
        self.commit(step, tmp, trainer_state)

    def prune(self, committed: int, best: set[int]) -> None:
        """Checkpoints beyond ``keep_last`` up to the step just committed but the ``best`` steps
        (checkpoint.keep_best's ranking as the committed one recorded it); never the committed one,
        nor a later step, nor one whose checksums failed at resume. A deletion that fails is a
        warning: the new checkpoint is committed, and stopping the run would not free the space
        either."""
        kept = f"checkpoint.keep_last={self.ckpt.keep_last}"
        if self.ckpt.keep_best:
            kept += f", not among the {self.ckpt.keep_best} best by {self.cfg.trainer.monitor}"
        # A step-N saved again (after a resume from an earlier step) and pruned would be renamed onto
        # the .step-N.deleting still being removed: then, and only then, the deletions are waited for
        # (every other rank waits in the commit meanwhile).
        if any((self.root / layout.deleted_name(path)).is_dir() for path in self.deleter.busy()):
            self.deleter.wait()
        try:
            for path in layout.prune(self.root, committed, self.ckpt.keep_last, self.damaged, best,
                                     delete=self.deleter.submit):
                self.info(f"checkpoint: deleting {path.name} in the background ({kept})")
        except OSError as exc:
            log.warning(f"checkpoint: step {committed} is saved, but deleting an older checkpoint "
                        f"failed ({exc}); delete it by hand to free its space")

    def point_best(self, trainer_state: TrainState) -> None:
        """Rank 0: ``checkpoints/best`` to the best checkpoint the committed one's ranking names. A
        link that cannot be made is a warning, once a run, as a failed deletion is: the checkpoint
        is saved."""
        ranking = (trainer_state.best or {}).get("ranking")  # empty without checkpoint.keep_best
        self.point_best_at(ranking[0][0] if ranking else None, f"step {trainer_state.step} is saved")

    def mark_evaluated(self, path: Path) -> None:
        """Rank 0: the resumed checkpoint ``path`` records that the evaluation its preemption skipped
        has run, and the ranking after it: a preemption at the last step left it due, so each re-run
        of the finished command evaluated, sampled and logged that step again. Only this run's own
        checkpoints: another run's is left as that run saved it. A failure is a warning: the next
        re-run evaluates once more, nothing worse."""
        if path.parent.resolve() != self.root.resolve():
            return
        try:
            saved = TrainState.read(path)
            best = None if self.best is None else self.best.state()
            dataclasses.replace(saved, evaluation_due=False, best=best).replace_in(path)
        except (OSError, CheckpointError) as exc:
            log.warning(f"checkpoint: the evaluation of {path} ran, but recording it there failed ({exc}); "
                        "a re-run from it evaluates it again")

    def point_best_at(self, step: int | None, context: str) -> None:
        """Rank 0: ``checkpoints/best`` to ``step``'s checkpoint (None: removed); ``context`` begins
        the warning when the link cannot be made."""
        try:
            layout.point_best(self.root, step)
        except (OSError, CheckpointError) as exc:
            if not self.best_link_warned:
                self.best_link_warned = True
                log.warning(f"checkpoint: {context}, but the link to the best checkpoint could not be "
                            f"made: {exc}")

    def save_in_flight(self) -> bool:
        """This rank's async save is still being written or committed."""
        return self.pending is not None and not self.pending.future.done()

    def poll(self, in_flight_anywhere: bool) -> None:
        """Non-blocking: report a finished async save (and raise its error, if it failed) once no
        rank has it in flight. ``in_flight_anywhere`` must be the same on every rank (the training
        step reduces ``save_in_flight()``): ranks that finished at different times then report, or
        raise, at the same step, instead of one stopping while the others go on into the next
        step's collectives."""
        if self.pending is not None and not in_flight_anywhere:
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is written and finalized."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pending.future.result()
        self.info(f"checkpoint step {pending.step}: async save complete after "
                  f"{time.perf_counter() - pending.started:.3f}s")

    # ---- loading -------------------------------------------------------------------------

    def load(self, path: Path) -> TrainState:
        """Restore model, optimizer, scheduler and RNG from ``path``; return its trainer state."""
        # Taken, not kept: a large model's metadata is GiBs of Python objects at 1,024 ranks.
        known, self.verified_metadata = self.verified_metadata, None
        metadata = known[1] if known is not None and known[0] == path else layout.verify(path)
        trainer_state = TrainState.read(path)
        faults.inject("resume", self.rank, trainer_state.step)
        if self.adapters_only:
            check_same_base(path, trainer_state.base_weights, self.base)
        elif trainer_state.base_weights is not None:
            raise CheckpointError(f"checkpoint {str(path)!r} holds LoRA adapters only; resume it with "
                                  "finetune.method=lora and the settings it was trained with")
        # Its model is another task's. By class name: one module imported under another name (run
        # from another directory) is still the same task.
        if trainer_state.task_path.rpartition(":")[2] != self.cfg.task.path.rpartition(":")[2]:
            raise CheckpointError(f"checkpoint {str(path)!r} was trained with "
                                  f"task={trainer_state.task_path}, this run is task={self.cfg.task.path}; "
                                  "resume it with the same task=")
        saved_factory, factory = trainer_state.model_factory, self.cfg.task.model_factory
        if (saved_factory or "").rpartition(":")[2] != (factory or "").rpartition(":")[2]:
            def built(name: str | None) -> str:
                return f"by {name} (LanguageModelTask(model=...))" if name else "from model.*"

            raise CheckpointError(f"checkpoint {str(path)!r} holds a model built {built(saved_factory)}, "
                                  f"this run's is built {built(factory)}; resume it with the same model")
        # Each rank's streams are its data-parallel index's (tensor-parallel peers share one): restored
        # where the world and the tensor-parallel degree are the saved ones, so that rank r is the
        # same data-parallel rank; else seeded afresh (checkpointer.seed_random_streams).
        saved_tp = dict(zip(trainer_state.mesh_dim_names, trainer_state.mesh_shape)).get("tp", 1)
        same_world = (trainer_state.world_size == self.world_size
                      and saved_tp == self.plan.tensor_parallel)
        rng, without_rng = self.read_rng_state_agreed(path) if same_world else (None, [])
        state = self.training_state()
        saved_with = trainer_state.model_changes(self.cfg)
        check_model_compatible(path, metadata, state["model"], adapters_only=self.adapters_only,
                               saved_with=saved_with)
        if not any(k.startswith("optim.") for k in metadata.state_dict_metadata):
            raise CheckpointError(f"checkpoint {str(path)!r} has no optimizer state; use it as "
                                  "model.init_from to start a new run from its weights")
        unsaved = drop_unsaved_optimizer_state(state["optim"], metadata.state_dict_metadata)
        average = f"{layout.AVERAGE_KEY}."
        self.average_restored = any(k.startswith(average) for k in metadata.state_dict_metadata)
        if layout.AVERAGE_KEY in state and not self.average_restored:
            # saved without trainer.ema_decay: the caller starts it from the weights
            del state[layout.AVERAGE_KEY]
        planner = layout.ReplicaLoadPlanner()  # the first data-parallel replica reads for them all
        try:
            dcp.load(state, storage_reader=layout.KnownMetadataReader(path, metadata),
                     planner=planner, process_group=self.group)
        except DCP_FAILURES as exc:  # DCP's CheckpointException is a BaseException: named here
            raise_if_interrupted(exc)
            raise CheckpointError(load_failed(path, exc, LOAD_FIX, self.rank)) from exc
        layout.broadcast_replicated(planner.replicated)
        # Loading an optimizer's state replaces its groups' settings with the saved ones: the kernel
        # flags too (a checkpoint saved with foreach AdamW made the fused one built now take the
        # foreach path, which failed at the next step) and the decay, betas and eps the config now
        # sets. Only the rate is the checkpoint's (the schedule takes it from there).
        built_settings = built_group_settings(self.optimizer)
        # Not strict only to let the parameters without saved optimizer state stay without; the model
        # state is this model's own keys, all read from the checkpoint.
        try:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"],
                           options=StateDictOptions(strict=not (unsaved or self.adapters_only),
                                                    ignore_frozen_params=self.adapters_only))
        except (RuntimeError, KeyError) as exc:  # the same tensors, grouped otherwise (tied weights)
            if accelerator.is_out_of_memory(exc) or isinstance(exc, dist.DistError):
                raise  # not a mismatch: memory, or a peer (their own errors say so)
            raise CheckpointError(
                f"checkpoint {str(path)!r} does not fit this model's parameters "
                f"({first_sentence(exc)}){saved_with}; use the settings it was saved with (see its "
                "trainer_state.json; model.tie_embeddings, for one), or start from its weights alone "
                "with model.init_from") from exc
        restore_built_settings(self.optimizer, built_settings)
        # After the optimizer's state: a run with other parameter groups is named there, not here.
        check_scheduler_state(path, trainer_state, len(self.optimizer.param_groups))
        self.scheduler.load_state_dict(trainer_state.scheduler)
        if rng is None or "accelerator" not in rng:
            # From the step too: seeded as at step 0, each such resume drew step 1's draws again. A
            # checkpoint saved on a host without an accelerator restores the others below and leaves
            # the accelerator's stream so seeded (found by review: at its step-0 seed).
            data_parallel_rank = self.rank // self.plan.tensor_parallel  # tensor-parallel peers share one
            seed_random_streams(self.cfg.trainer.seed, data_parallel_rank, trainer_state.step)
            if rng is not None and accelerator.rng_state() is not None and self.rank == 0:
                log.warning(f"resume: {path} holds no accelerator RNG state (saved on a host without "
                            "one): that stream is seeded from the seed, the data-parallel rank and the "
                            "step, the others restored")
        if rng is not None:
            set_rng_state(rng)
        if not same_world:
            self.info("resume: world size or tensor parallelism changed; RNG states are seeded afresh from "
                      "the seed, the data-parallel rank and the step, not restored (the data order is "
                      "global and does not depend on them)")
        elif without_rng and self.rank == 0:
            shown = ", ".join(map(str, without_rng[:8])) + (
                f" (+{len(without_rng) - 8} more)" if len(without_rng) > 8 else "")
            log.warning(f"resume: {path} has no rng-rank<r>.pt for rank(s) {shown}: their RNG states are "
                        "not restored (the data order is global and does not depend on them; dropout "
                        "and other random draws on those ranks differ from an uninterrupted run)")
        return trainer_state

    def read_rng_state_agreed(self, path: Path) -> tuple[dict[str, Any] | None, list[int]]:
        """This rank's saved RNG state (None where its file is missing) and the ranks without one,
        agreed in one all-gather: a rank without its file is named on rank 0 rather than going on
        silently, and an unreadable file stops every rank with its error, not one rank alone while
        the others wait in DCP's load."""
        rng_file = path / layout.rng_file(self.rank)
        rng, error = None, None
        try:
            rng = read_rng_state(rng_file) if rng_file.is_file() else None
        except CheckpointError as exc:
            error = str(exc)
        found = agree(error, rng is not None, self.group, error_type=CheckpointError)
        return rng, [rank for rank, has_rng in enumerate(found) if not has_rng]

    def info(self, message: str) -> None:
        if self.rank == 0:
            log.info(message)

