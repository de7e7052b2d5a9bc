"""Where checkpoints live, and how to tell a complete one from anything else.

    run.dir/checkpoints/
        step-<N>/                  complete: DCP files + .metadata + trainer_state.json
            .metadata              DCP's index (written last by DCP itself)
            __<rank>_0.distcp      one shard file per rank
            rng-rank<r>.pt         every rank's RNG states
            trainer_state.json     human-readable state, written last, just before the rename
            model.safetensors      only with checkpoint.save_full=true
        .step-<N>.tmp/             a save in progress, or one that crashed: never loaded
        .step-<N>.deleting/        a checkpoint keep_last is deleting (renamed first): never loaded
        .step-<N>.tmp.deleting/    a crashed save's .tmp, being deleted at the next start
        best -> step-<N>           checkpoint.keep_best's link to the best (made as .best.link)

A save writes into ``.step-<N>.tmp`` and is renamed to ``step-<N>`` only once the DCP metadata and
``trainer_state.json`` exist, so a directory named ``step-<N>`` is complete by construction. The
checks below also verify it, so that a damaged or hand-copied directory gets a precise error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import os
import pathlib
import pickle
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.tensor import DTensor

from shardtrain.checkpoint.safetensors_files import ADAPTER_CONFIG, DCP_METADATA_FILE, INDEX_FILE, SINGLE_FILE
from shardtrain.checkpoint.state import STATE_FILE, STEP_DIR, TrainState
from shardtrain.durable import fsync_path as fsync_path  # re-exported: the checkpointer syncs through it
from shardtrain.errors import CheckpointError, CheckpointFromNewerVersion
from shardtrain.models.hf_directory import is_model_directory

METADATA_FILE = DCP_METADATA_FILE  # DCP's, named where the export check needs it too
LIGHTNING_META_FILE = "meta.pt"
TMP_DIR = re.compile(r"^\.step-(\d+)\.tmp$")
# What a crashed save or a crashed deletion leaves: never loadable, and never written by anything else.
ABANDONED_DIR = re.compile(r"^\.step-\d+\.(?:tmp|deleting|tmp\.deleting)$")
# A trainer_state.json rewritten into a committed checkpoint (TrainState.replace_in) is written
# beside the checkpoint first; one a crash left there is never read.
ABANDONED_STATE = re.compile(r"^\.step-\d+\.trainer_state\.json\.part$")


# A run.dir's checkpoints live here (checkpoint/checkpointer.py).
CHECKPOINTS_DIR = "checkpoints"
# A checkpoint's entry holding trainer.ema_decay's average of the weights (``ema.<parameter name>``).
AVERAGE_KEY = "ema"


def no_average(path: Path) -> CheckpointError:
    """What reading the weights' average from a checkpoint that has none says."""
    return CheckpointError(f"checkpoint {str(path)!r} holds no weight average ({AVERAGE_KEY}.*): its run "
                           "trained without trainer.ema_decay; read its weights (drop --ema / --key ema)")


def rng_file(rank: int) -> str:
    """The name of rank ``rank``'s RNG states in a checkpoint."""
    return f"rng-rank{rank}.pt"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f".step-{step}.tmp"


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, its non-tensor entries (the optimizer's settings, ...) unpickled with
    ``torch.load(weights_only=True)``: DCP's own loads them with ``weights_only=False``, which runs
    whatever a tampered shard file holds. What the safe load gives is pickled again (plain values
    only) for DCP's placement of it."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        safe = io.BytesIO()
        torch.save(torch.load(value, weights_only=True), safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


REPLICATE_DIM = "dp_replicate"  # the mesh dimension of HSDP's replica groups (NO_SHARD's ranks)


class ReplicaLoadPlanner(WeightsOnlyLoadPlanner):
    """``WeightsOnlyLoadPlanner`` that reads each of the model's, optimizer's and weight average's
    DTensors replicated along the mesh's data-parallel replica dimension (HSDP's replica groups,
    NO_SHARD's ranks) on the first replica only: the others take it from there
    (``broadcast_replicated``; ``replicated`` holds each such tensor's local part, its replica group
    and the mesh's device type, in state-dict order, the same on every rank). Every replica read its
    shard's bytes: 128 times the checkpoint from the filesystem at 1,024 ranks in groups of 8 (found
    by review), at a resume, at ``model.init_from`` and at inference. The small entries (step
    counts, settings) are read by every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.replicated: list[tuple[torch.Tensor, object, str]] = []

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        skipped = set()
        read_once = ("model.", "optim.", f"{AVERAGE_KEY}.")
        for key, value in self.state_dict.items():
            if not key.startswith(read_once) or (found := replica_of(value)) is None:
                continue
            local, group, device_type, first = found
            self.replicated.append((local, group, device_type))
            if not first:
                skipped.add(key)
        return dataclasses.replace(plan, items=[item for item in plan.items
                                                if item.dest_index.fqn not in skipped])


def replica_of(value: object) -> tuple[torch.Tensor, object, str, bool] | None:
    """Where ``value`` is a DTensor replicated along its mesh's data-parallel replica dimension over
    more than one replica: its local part, that replica group, the mesh's device type, and whether
    this rank is the group's first (which reads for the others); else None."""
    names = value.device_mesh.mesh_dim_names or () if isinstance(value, DTensor) else ()
    if REPLICATE_DIM not in names:
        return None
    mesh, dim = value.device_mesh, names.index(REPLICATE_DIM)
    if mesh.size(dim) == 1 or not value.placements[dim].is_replicate():
        return None
    with torch.no_grad():
        return value.to_local(), mesh.get_group(dim), mesh.device_type, mesh.get_local_rank(dim) == 0


def broadcast_replicated(replicated: list[tuple[torch.Tensor, object, str]]) -> None:
    """Each tensor ``ReplicaLoadPlanner`` left to the first replica, from there to the others of its
    group; through the mesh's device where it is held elsewhere (CPU offload's host shards, a NCCL
    group)."""
    with torch.no_grad():  # into the parameters' own storage, as DCP's reads went
        for local, group, device_type in replicated:
            sent = local if local.device.type == device_type else local.to(device_type)
            torch.distributed.broadcast(sent, group=group, group_src=0)
            if sent is not local:
                local.copy_(sent)


class KnownMetadataReader(FileSystemReader):
    """DCP's file reader with the metadata already read (and checked): DCP's load would read and
    unpickle ``.metadata`` once more on every rank (hundreds of MiB, several GiB of Python objects,
    for a 405B model at 1,024 ranks), and the exporter once more per output shard."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self.known_metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self.known_metadata


@contextlib.contextmanager
def reading_alone() -> Iterator[None]:
    """Around a ``dcp.load`` that may run without a process group (consolidate, the exports): DCP
    then warns, at every load, that it reads in one process, which is what was meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def free_memory() -> int:
    """Bytes of memory free on this host (0 where the system does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


# A checkpoint id that is a path (DCP's writer keeps the directory it saved to).
PATH_CLASSES = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
# What DCP's .metadata may name besides the classes of torch's metadata module: its per-entry storage
# record, the values of tensor properties, and a checkpoint id that is a path.
METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(("builtins", name) for name in ("set", "frozenset", "bytearray", "complex", "slice")),
}


class RefusedGlobal(pickle.UnpicklingError):
    """A name in ``.metadata`` that DCP's metadata does not hold."""


class UnknownMetadataClass(RefusedGlobal):
    """A name in DCP's metadata module that this torch lacks: a newer torch's, not damage."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` without running code from the file: a pickle may call any
    importable function, so only the names DCP's metadata is made of are found: the dataclasses and
    enums of ``torch.distributed.checkpoint.metadata`` (any of them: a later torch may add one), the
    storage record, dtypes, layouts, memory formats and ``torch.Size``. The checkpoint's other
    pickles (the RNG files) load with ``torch.load(weights_only=True)`` for the same reason."""

    def find_class(self, module: str, name: str):
        if module == dcp_metadata.__name__:
            found = getattr(dcp_metadata, name, None)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
            if found is None:
                raise UnknownMetadataClass(f"{module}.{name}")
        elif module == "torch" and isinstance(getattr(torch, name, None),
                                              torch.dtype | torch.layout | torch.memory_format):
            return getattr(torch, name)
        elif module.split(".")[0] == "pathlib" and name in PATH_CLASSES:
            # By name: Python 3.13 pickles them from pathlib._local, which 3.11 does not have.
            return getattr(pathlib, name)
        elif (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        raise RefusedGlobal(f"{module}.{name}")


def saved_torch_version(path: Path) -> str:
    """The torch a shardtrain checkpoint was saved with, as its trainer state records it."""
    try:
        return TrainState.read(path).versions.get("torch", "not recorded")
    except CheckpointError:
        return "not recorded"


def missing(path: Path, what: str = "checkpoint") -> CheckpointError:
    """The error for a ``path`` that does not exist; a link (``checkpoints/best``) whose target is
    gone names the target, and the newest complete checkpoint beside it (found by review: "does not
    exist" of a link that was there)."""
    if not path.is_symlink():
        return CheckpointError(f"{what} {str(path)!r} does not exist".lstrip())
    found = candidates(path.parent)
    newest = f"; the newest complete checkpoint there is {found.complete[-1][1]}" if found.complete else ""
    return CheckpointError(f"{what} {str(path)!r} is a link to {os.readlink(path)}, which does not exist"
                           .lstrip() + newest)


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's metadata, or a CheckpointError that says what is wrong with ``path``."""
    if not path.exists():
        raise missing(path)
    if not path.is_dir():
        weights_only = path.suffix == ".safetensors"
        raise CheckpointError(
            f"checkpoint {str(path)!r} is a file, not a checkpoint directory; pass the directory "
            "that holds .metadata and the *.distcp files"
            + ("; a .safetensors file holds weights alone: start a run from it with model.init_from"
               if weights_only else "")
        )
    meta_file = path / METADATA_FILE
    if not meta_file.is_file():
        if not any(path.iterdir()):
            raise CheckpointError(f"checkpoint directory {str(path)!r} is empty")
        if (path / ADAPTER_CONFIG).is_file():
            raise CheckpointError(f"{str(path)!r} is a PEFT adapter directory (export-peft writes these), "
                                  "not a checkpoint: PEFT loads it onto its base model; shardtrain trains "
                                  f"from it with finetune=lora model.adapter={path}")
        if (kind := directory_of_checkpoints(path)) is not None:
            raise CheckpointError(f"{str(path)!r} is {kind}")
        if is_model_directory(path):  # export-hf's output among them: its weights carry no run config
            raise CheckpointError(f"{str(path)!r} is a Hugging Face model directory, not a checkpoint: "
                                  "generate and eval read it as it is; train from it with model.name=hf "
                                  f"model.path={path} (or, a Llama, model.init_from=hf:{path})")
        consolidated = not any(path.glob("*.distcp"))  # a save_full checkpoint holds a model.safetensors too
        if consolidated and (path / SINGLE_FILE).is_file():
            raise CheckpointError(f"{str(path)!r} holds consolidated weights, not a checkpoint: generate, "
                                  f"eval, export-hf and model.init_from take its file, "
                                  f"{str(path / SINGLE_FILE)!r}; consolidate and checkpoint.resume the "
                                  "checkpoint it was made from")
        if consolidated and (path / INDEX_FILE).is_file():
            raise CheckpointError(f"{str(path)!r} holds consolidated weights in shards (--max-shard-size), "
                                  "which shardtrain does not read back (transformers does, with a "
                                  "config.json: `shardtrain export-hf` writes such a directory); pass the "
                                  "checkpoint itself, or consolidate it into one .safetensors file")
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no .metadata: the save did not finish (or this is not a DCP "
            "checkpoint); use an earlier complete checkpoint"
        )
    try:
        with open(meta_file, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except OSError:
        raise  # the filesystem failed, not the file: no sign of damage
    except UnknownMetadataClass as exc:
        # Not the checkpoint's damage: resume=auto neither skips it nor moves it aside (found by review)
        raise CheckpointFromNewerVersion(
            f"checkpoint {str(path)!r}: .metadata names {exc}, which this torch ({torch.__version__}) "
            f"does not have: it was saved by a newer torch ({saved_torch_version(path)}); read it with "
            "that torch or a later one") from exc
    except RefusedGlobal as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: .metadata names {exc}, which DCP's metadata does "
                              "not hold; it is not loaded, since unpickling it could run code from the "
                              "file (a tampered file, or not a DCP checkpoint): use a checkpoint whose "
                              "origin you know") from exc
    except MemoryError as exc:
        # A flipped bit in a pickle frame's length asks for a huge allocation: damage. A real
        # shortage comes with a file that is a good share of the free memory (its objects take
        # some 7 times its bytes).
        if meta_file.stat().st_size * 16 >= free_memory():
            raise
        raise CheckpointError(f"checkpoint {str(path)!r}: .metadata is unreadable (it asks for far more "
                              "memory than its size accounts for: damaged)") from exc
    except Exception as exc:  # a truncated or foreign pickle raises many different types
        raise CheckpointError(f"checkpoint {str(path)!r}: .metadata is unreadable ({exc})") from exc
    if not isinstance(metadata, Metadata):  # every reader after this takes DCP's attributes for granted
        raise CheckpointError(
            f"checkpoint {str(path)!r}: .metadata holds a {type(metadata).__name__}, not DCP's "
            "Metadata (this is not a DCP checkpoint, or the file was replaced); use another checkpoint"
        )
    return metadata


def directory_of_checkpoints(path: Path) -> str | None:
    """What a directory that holds checkpoints is, with its newest complete one (a run.dir, or its
    checkpoints directory, given where a checkpoint was asked for), else None."""
    for root, kind in ((path / CHECKPOINTS_DIR, "a run directory"), (path, "a run's checkpoints directory")):
        if not root.is_dir():
            continue
        found = candidates(root)
        if found.complete:
            return f"{kind}, not a checkpoint; its newest complete checkpoint is {found.complete[-1][1]}"
        if found.skipped or root != path:
            return f"{kind}, not a checkpoint, and holds no complete checkpoint yet"
    return None


def check_shard_files(path: Path, metadata, share: tuple[int, int] | None = None) -> None:
    """Every byte range the metadata points at must exist (catches missing and truncated shards).

    ``share=(rank, world)``: only every world-th shard file from the rank-th, for ranks that each
    check their part and agree on the verdicts (a checkpoint saved at 1,024 ranks has 1,024 shard
    files: every rank stating all of them is a million stats at a resume)."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    files = sorted(needed.items())
    if share is not None:
        rank, world = share
        files = files[rank::world]
    for name, size in files:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is missing shard file {name}")
        actual = file.stat().st_size
        if actual < size:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: shard file {name} is truncated ({actual} bytes, the "
                f"metadata needs {size}); the checkpoint is damaged, use another one"
            )


def unfinished_save(path: Path) -> str | None:
    """Why ``path`` is no checkpoint to read, where it is what a save or a deletion that did not
    finish leaves (``.step-N.tmp``, ``.step-N.deleting``); None otherwise."""
    if not (ABANDONED_DIR.match(path.name) and path.is_dir()):
        return None
    step = path.name.removeprefix(".").split(".")[0]
    if path.name.endswith(".tmp"):
        # It may lack files, or hold a save a rank could not read back: its files look whole.
        return (f"{str(path)!r} is a save that did not finish (its commit, the rename to {step}, never "
                "happened); use a complete checkpoint")
    return f"{str(path)!r} is a checkpoint whose deletion did not finish ({step}); use a complete checkpoint"


def verify(path: Path, need_state: bool = True, share: tuple[int, int] | None = None):
    """Metadata of a complete checkpoint at ``path``; raises CheckpointError naming the problem.
    ``share``: of the shard files, only this rank's part (``check_shard_files``)."""
    if reason := unfinished_save(path):
        raise CheckpointError(reason)
    metadata = read_dcp_metadata(path)
    check_shard_files(path, metadata, share)
    if need_state:
        TrainState.read(path)
    return metadata


def is_complete(path: Path) -> bool:
    try:
        verify(path)
    except CheckpointError:
        return False
    return True


@dataclass
class Found:
    complete: list[tuple[int, Path]]
    skipped: list[tuple[Path, str]]  # (path, why it is not usable)


def candidates(root: Path) -> Found:
    """Checkpoints by name (oldest first), with a stat each and nothing read: a ``step-N`` directory
    is complete by construction once ``trainer_state.json`` is in it. The caller verifies the one it
    uses (``verify``), newest first, so a start reads one checkpoint's metadata, not every one's."""
    complete, skipped = [], []
    if not root.is_dir():
        return Found(complete, skipped)
    for entry in sorted(root.iterdir()):
        if TMP_DIR.match(entry.name):
            skipped.append((entry, "incomplete: the save did not finish (interrupted or crashed)"))
        elif match := STEP_DIR.match(entry.name):
            if (entry / STATE_FILE).is_file():
                complete.append((int(match.group(1)), entry))
            else:
                skipped.append((entry, f"incomplete: it has no {STATE_FILE}"))
    complete.sort()
    return Found(complete, skipped)


def newer_checkpoints(root: Path, step: int) -> list[Path]:
    """The complete checkpoints in ``root`` saved at a later step than ``step``, oldest first."""
    return [path for saved, path in candidates(root).complete if saved > step]


def saved_by_same_resume(root: Path, choice: str,
                         same_config: Callable[[TrainState], bool] | None = None) -> bool:
    """Whether ``root`` holds checkpoints saved by runs started with ``checkpoint.resume=choice``
    (and, given ``same_config``, under the same config: it says so of a checkpoint's trainer state),
    and none saved by another
    run after the first of them: a restarted attempt or a requeued job of this run, which goes on
    from them, not from ``choice`` again (it would repeat the steps and collide with its own saves).
    Later checkpoints of any other run, or of the same resume with other settings, are refused
    (``refuse_newer_checkpoints``). Judged from ``root``'s own checkpoints, not from the step
    ``choice`` names now: that may be a link another run moves on (``checkpoints/best``), or a
    checkpoint this run's saves pruned."""
    def same_run(path: Path) -> bool:
        try:
            state = TrainState.read(path)
        except CheckpointError:
            return False
        return (state.config.get("checkpoint", {}).get("resume") == choice
                and (same_config is None or same_config(state)))

    saved = candidates(root).complete
    first = next((step for step, path in saved if same_run(path)), None)
    return first is not None and all(same_run(path) for step, path in saved if step > first)


def slurm_requeued() -> bool:
    """Whether this job is a requeued Slurm job (after a preemption, or ``scontrol requeue``): the
    same command started again, which goes on from its own checkpoints."""
    count = os.environ.get("SLURM_RESTART_COUNT", "0")
    return count.isdigit() and int(count) > 0


def refuse_newer_checkpoints(root: Path, resumed: Path) -> None:
    """``checkpoint.resume=PATH`` must not go on in a ``root`` that already holds later steps: its
    saves would count them for ``keep_last`` and stop at the first step that exists, and a later
    ``resume=auto`` would go back to them."""
    step = TrainState.read(resumed).step
    if newer := newer_checkpoints(root, step):
        names = ", ".join(path.name for path in newer)
        raise CheckpointError(
            f"checkpoint.resume={resumed} is step {step}, but {root} already holds later checkpoints "
            f"({names}) that this run would collide with; to go on from the newest of them (this run, "
            "started again with other settings: a raised trainer.max_steps), use checkpoint.resume=auto; "
            f"else move them out of {root} or choose a new run.dir"
        )


def deleted_name(deleting: Path) -> str:
    """``step-N`` for ``.step-N.deleting`` (what ``prune`` renames a checkpoint to)."""
    return deleting.name.removeprefix(".").removesuffix(".deleting")


def prune(root: Path, committed: int, keep_last: int, exclude: set[Path],
          best: set[int] = frozenset(), delete: Callable[[Path], None] = shutil.rmtree) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last`` up to step ``committed`` (the one
    just saved), but those of the steps in ``best`` (checkpoint.keep_best's); returns the deleted
    ones. Later steps and ``exclude`` are neither counted nor deleted: the checkpoint just committed
    is always kept. Each is renamed ``.step-N.deleting`` here, then ``delete``d (the checkpointer
    deletes in a thread of its own: removing terabytes from a shared filesystem takes minutes)."""
    # Names only: a step-N directory is complete by construction (renamed after its last file),
    # and reading every kept checkpoint's metadata after each save would cost a storm of reads.
    kept = [(step, path) for step, path in candidates(root).complete
            if step <= committed and path not in exclude]
    doomed = [path for step, path in kept[: max(0, len(kept) - max(1, keep_last))] if step not in best]
    for path in doomed:
        # Rename first: a crash while deleting must not leave a half directory named step-N.
        deleting = path.with_name(f".{path.name}.deleting")
        if deleting.is_dir() and not deleting.is_symlink():
            # Left by a deletion of an earlier step-N that crashed: the rename onto it would fail
            # (ENOTEMPTY) after the new checkpoint committed.
            shutil.rmtree(deleting)
        path.rename(deleting)
        fsync_path(root)  # the rename reaches the disk before any of the deletion does
        delete(deleting)
    return doomed


# checkpoint.keep_best: a link in the checkpoints directory to the best checkpoint, which every
# command that reads one takes as a path (``runs/x/checkpoints/best``).
BEST_LINK = "best"


def point_best(root: Path, step: int | None) -> None:
    """``root/best`` -> ``step-N`` (a relative link, replaced in one rename), or no link when there
    is no best (checkpoint.keep_best off: nothing keeps a target it would name from the prune). Only
    a link of ours is replaced or removed: a ``best`` that is anything else is a CheckpointError,
    and stays as it is."""
    link = root / BEST_LINK
    ours = link.is_symlink() and STEP_DIR.match(os.readlink(link)) is not None
    if step is None:
        if ours:
            link.unlink()
        return
    if (link.exists() or link.is_symlink()) and not ours:
        raise CheckpointError(f"{link} is not shardtrain's link to a step-N: the best checkpoint is not "
                              "linked (move it away to have the link)")
    staged = root / f".{BEST_LINK}.link"
    if staged.is_symlink():
        staged.unlink()
    staged.symlink_to(f"step-{step}", target_is_directory=True)
    try:
        os.replace(staged, link)
    except OSError:
        staged.unlink()
        raise


def remove_abandoned(root: Path, keep: Path | None = None,
                     delete_later: Callable[[Path], None] | None = None) -> list[Path]:
    """Delete the ``.step-N.tmp`` (a save that never finished) and ``.step-N.deleting`` (a deletion
    that never finished) directories in ``root``, and the ``.step-N.trainer_state.json.part`` files
    of a rewrite of a checkpoint's state that never finished, but never ``keep`` (a checkpoint resumed from by
    hand); returns the deleted ones. No resume loads them, and a save removes only the ``.tmp`` of
    its own step: one left at a step never saved again (a preemption's) kept its full size forever.
    Only real directories named so by shardtrain, only in ``root``: nothing else is touched.
    ``delete_later``: takes the ``.deleting`` ones (a pruned checkpoint a preempted run left: minutes
    to delete on a shared filesystem, which every rank waited for at start-up) to delete while
    training goes on, and each ``.tmp`` renamed ``.step-N.tmp.deleting`` first (a save of its step
    writes to ``.step-N.tmp``; the rename is one metadata operation where the deletion of a large
    model's half-written save was minutes every rank waited for: found by review)."""
    if not root.is_dir():
        return []
    kept = keep.resolve() if keep is not None else None
    removed = []
    for entry in sorted(root.iterdir()):
        if (ABANDONED_DIR.match(entry.name) and entry.is_dir() and not entry.is_symlink()
                and entry.resolve() != kept):
            aside = entry.with_name(f"{entry.name}.deleting")
            if delete_later is None or entry.name.endswith(".tmp") and aside.exists():
                shutil.rmtree(entry)  # (a .tmp beside its own .tmp.deleting: rare, a crash between)
            elif entry.name.endswith(".tmp"):
                entry.rename(aside)
                fsync_path(root)  # renamed on disk before any of the deletion: never a half .tmp
                delete_later(aside)
            else:
                delete_later(entry)
            removed.append(entry)
        elif ABANDONED_STATE.match(entry.name) and entry.is_file() and not entry.is_symlink():
            entry.unlink()
            removed.append(entry)
    return removed


def detect_format(path: Path) -> str:
    """'shardtrain' (ours), 'lightning' (Lightning's sharded FSDP layout) or 'dcp' (anything else)."""
    if (path / STATE_FILE).is_file():
        return "shardtrain"
    if (path / LIGHTNING_META_FILE).is_file():
        return "lightning"
    return "dcp"


def refuse_run_inside_checkpoint(run_dir: Path) -> None:
    """A run.dir inside a checkpoint, which keep_last deletes whole, the run with it (the command line
    refuses it before launch, in cli/paths.py; this is a library caller's ``Trainer.create``)."""
    for above in run_dir.expanduser().resolve().parents:
        if (above / METADATA_FILE).is_file():
            raise CheckpointError(f"run.dir {str(run_dir)!r} is inside the checkpoint {str(above)!r}, which "
                                  "is never written to (and keep_last deletes it whole); choose a path "
                                  "outside it")


def refuse_checkpointless_start(root: Path) -> None:
    """``checkpoint.enabled=false`` must not start another run in a run.dir whose run saved
    checkpoints: its config.yaml would be the new run's, its metrics.jsonl both runs' (found by
    review: accepted, where resume=none is refused)."""
    found = candidates(root)
    if found.complete:
        raise CheckpointError(
            f"{root} holds a run's checkpoints ({found.complete[-1][1].name} is the newest), and "
            "checkpoint.enabled=false would start another run in its directory, over its config.yaml "
            "and into its metrics.jsonl; resume it (without checkpoint.enabled=false) or choose a new "
            "run.dir"
        )


def refuse_fresh_start(root: Path) -> None:
    """``checkpoint.resume=none`` must not write new checkpoints over a run's existing ones."""
    found = candidates(root)
    if found.complete:
        raise CheckpointError(
            f"{root} already holds checkpoints ({found.complete[-1][1].name} is the newest) and "
            "checkpoint.resume=none would overwrite them; resume (checkpoint.resume=auto) or choose a "
            "new run.dir"
        )
