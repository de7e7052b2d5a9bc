"""Weights only, in every format shardtrain reads, streamed into a (sharded) model tensor by tensor.

``model.init_from`` and inference accept a shardtrain or plain DCP checkpoint directory, a
consolidated ``.safetensors`` file, or ``hf:<dir>``, a local Hugging Face Llama directory (never
downloaded) imported into the built-in model. ``model.name=hf`` models read their own Hugging Face
directory (``load_hf_model_into``). Each rank keeps only its own slice of every tensor it reads.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Collection, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardtrain.checkpoint import integrity, layout
from shardtrain.checkpoint.dcp_errors import DCP_FAILURES, load_failed, raise_if_interrupted
from shardtrain.checkpoint.integrity import MANIFEST_FILE, file_sha256
from shardtrain.checkpoint.safetensors_files import (
    DATA_CONFIG_KEY,
    EVAL_SETTINGS_KEY,
    MODEL_CONFIG_KEY,
    TASK_CONFIG_KEY,
    TOKENIZER_KEY,
    eval_settings,
    file_metadata,
    open_safetensors,
    weight_files,
)
from shardtrain.checkpoint.state import (
    STATE_FILE,
    TrainState,
    as_packed_then,
    language_model_refusal,
    rebuild_config,
)
from shardtrain.config.schema import LANGUAGE_MODEL_TASK, DataConfig, FinetuneConfig, ModelConfig
from shardtrain.data.documents import resolved_keeping_file_name
from shardtrain.distributed.agreement import agree, run_agreed
from shardtrain.distributed.qlora import NF4_DESCRIPTION
from shardtrain.distributed.sharded_model import first_row, local_box, shard_like
from shardtrain.errors import CheckpointError
from shardtrain.models.hf_directory import CONFIG_FILE as HF_CONFIG_FILE
from shardtrain.models.hf_directory import is_model_directory
from shardtrain.models.llama_hf_adapter import (
    config_mismatches,
    from_hf_name,
    hf_rows,
    model_config_from_hf,
    rotary_heads,
    unrepresentable,
)
from shardtrain.models.lora import base_name, is_adapter

HF_PREFIX = "hf:"


def expected_shapes(state: dict[str, Any], prefix: str) -> dict[str, tuple[int, ...]]:
    """Flattened DCP keys of the tensors in ``state`` (global shapes for DTensors)."""
    return {f"{prefix}.{k}": tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def check_model_compatible(path: Path, metadata, model_state: dict[str, Any],
                           adapters_only: bool = False, saved_with: str = "") -> None:
    """Name missing keys, unexpected keys and shape mismatches between checkpoint and model;
    ``adapters_only``: of the LoRA adapters alone (checkpoints of the first LoRA release also hold a
    tied head, which no reader of them needs); ``saved_with``: the settings the checkpoint was saved
    with where this run differs, when known (``TrainState.model_changes``)."""
    saved = {
        k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size") and (is_adapter(k) or not adapters_only)
    }
    wanted = expected_shapes(model_state, "model")
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(set(saved) - set(wanted))
    mismatched = sorted(
        f"{k}: checkpoint {list(saved[k])} vs model {list(wanted[k])}"
        for k in set(saved) & set(wanted) if saved[k] != wanted[k]
    )
    if not (missing or unexpected or mismatched):
        return

    def show(items: list[str]) -> str:
        return ", ".join(items[:6]) + (f" (+{len(items) - 6} more)" if len(items) > 6 else "")

    problems = []
    if missing:
        problems.append(f"missing keys: {show(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {show(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {show(mismatched)}")
    raise CheckpointError(
        f"checkpoint {str(path)!r} does not fit this model ({'; '.join(problems)}){saved_with}; "
        "use the settings it was saved with (see its trainer_state.json)"
    )


def model_config_of(path: Path) -> ModelConfig:
    """The model config saved with a shardtrain checkpoint or consolidated safetensors file."""
    if path.is_file() and path.suffix == ".safetensors":
        metadata = file_metadata(path)
        task = json.loads(metadata.get(TASK_CONFIG_KEY, "{}"))
        if (refusal := language_model_refusal(task.get("path"), task.get("model_factory"))) is not None:
            raise CheckpointError(f"{path} {refusal}")
        raw = metadata.get(MODEL_CONFIG_KEY)
        if raw is None:
            raise CheckpointError(f"{path} carries no shardtrain model config (it was not written by "
                                  "shardtrain consolidate from a shardtrain checkpoint)")
        return rebuild_config(ModelConfig, json.loads(raw), "model", f"the shardtrain that wrote {path}")
    layout.verify(path)
    state = TrainState.read(path)
    refuse_adapters_only(path, state)
    return state.model_config()


def tokenizer_of(path: Path) -> str | None:
    """The tokenizer a shardtrain checkpoint or consolidated file records its model's text was read
    with (``TrainState.tokenizer``); None where it records none (an older one, another task's)."""
    if path.is_file():
        return file_metadata(path).get(TOKENIZER_KEY) if path.suffix == ".safetensors" else None
    return TrainState.read(path).tokenizer if (path / STATE_FILE).is_file() else None


def data_config_of(path: Path) -> DataConfig | None:
    """The training data's config saved with a shardtrain checkpoint or consolidated file; None
    where it was not saved (a file consolidated by an older shardtrain)."""
    if path.is_file():
        raw = file_metadata(path).get(DATA_CONFIG_KEY) if path.suffix == ".safetensors" else None
        if raw is None:
            return None
        saved = json.loads(raw)
        return as_packed_then(rebuild_config(DataConfig, saved, "data", f"the shardtrain that wrote {path}"),
                              saved)
    return TrainState.read(path).data_config()


def eval_settings_of(path: Path) -> dict[str, int]:
    """The windows the run's evaluations scored (``seq_len``, ``eval_samples``), saved with a
    shardtrain checkpoint or consolidated file; empty where they were not saved (a file consolidated
    by an older shardtrain, or not by shardtrain)."""
    if path.is_file():
        raw = file_metadata(path).get(EVAL_SETTINGS_KEY) if path.suffix == ".safetensors" else None
        if raw is None:
            return {}
        try:
            saved = json.loads(raw)
        except json.JSONDecodeError:
            saved = None
        keys = ("seq_len", "eval_samples")
        settings = {key: saved.get(key) for key in keys} if isinstance(saved, dict) else {}
        if not settings or not all(type(value) is int and value >= 1 for value in settings.values()):
            raise CheckpointError(f"{path}: its metadata {EVAL_SETTINGS_KEY} is damaged ({raw[:80]!r}); give "
                                  "eval --seq-len and --samples, or consolidate the checkpoint again")
        return settings
    return eval_settings(TrainState.read(path).config)


def refuse_task_adapters(path: Path, state: TrainState) -> None:
    """A LoRA checkpoint of a task other than the language model: no command exports its adapters
    (consolidate and the exports named each other)."""
    if state.base_weights is not None and state.task_path != LANGUAGE_MODEL_TASK:
        raise CheckpointError(f"checkpoint {str(path)!r} holds LoRA adapters only, of task="
                              f"{state.task_path}: no command exports a task's adapters yet (export-peft "
                              "and export-hf --merge serve the language-model task); resume it with the "
                              "task, or train with finetune=none for weights consolidate writes")


def refuse_adapters_only(path: Path, state: TrainState) -> None:
    """A LoRA checkpoint holds adapters, not a model: what reads whole weights refuses it, naming
    the export that serves it (``refuse_task_adapters``: none yet for a task's)."""
    refuse_task_adapters(path, state)
    if state.base_weights is not None:
        raise CheckpointError(f"checkpoint {str(path)!r} holds LoRA adapters only (finetune=lora), not a "
                              f"whole model: `shardtrain export-hf {path} OUT --merge` writes the merged "
                              f"model, `shardtrain export-peft {path} OUT` the adapters for PEFT")


def resolved_once(checkpoint: str | Path) -> Path:
    """The checkpoint itself, not a link a training may move (its checkpoints/best) while it is
    read: resolved by rank 0 for every rank (each resolving it could have read two checkpoints, the
    link moved between them; ``generate --devices N``, and ``model.init_from`` from another run's
    ``best``, whose checks and reads each opened the link anew: found by review)."""
    resolved = [str(resolved_keeping_file_name(Path(checkpoint).expanduser()))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(resolved, src=0)
    return Path(resolved[0])


def resolved_weights_source(model_cfg: ModelConfig) -> str | None:
    """``model_cfg.weights_source()`` with a link resolved once (``resolved_once``; a collective):
    one path for everything that identifies or reads a run's initial weights (a LoRA base's
    identity and the read resolved another run's moving ``best`` apart: found by review)."""
    source = model_cfg.weights_source()
    if source is None or source.startswith(HF_PREFIX):
        return source
    return str(resolved_once(source))


def load_model_weights(model: nn.Module, source: str, model_cfg: ModelConfig | None = None,
                       verify_checksums: bool = True, average: bool = False) -> None:
    """Fill ``model`` (sharded or not) with the weights at ``source``; optimizer state is not read.
    ``verify_checksums``: a checkpoint directory's recorded checksums are checked first.
    ``average``: the checkpoint's weight average (trainer.ema_decay) in place of its weights, the
    buffers and any frozen parameters (which it does not average) from the weights."""
    kind = agreed_source_kind(source)
    if average and kind in (HF_IMPORT, SAFETENSORS_FILE, HF_DIRECTORY):
        raise CheckpointError(f"{source} is {kind}, which holds one set of weights: the weights' average "
                              "(--ema) is read from a checkpoint directory (`shardtrain consolidate CKPT "
                              "OUT --key ema` writes it as such a file)")
    if kind == HF_IMPORT:
        if model_cfg is None:
            raise CheckpointError(f"{source}: importing a Hugging Face directory needs the model config")
        directory = source[len(HF_PREFIX):]
        read_on_first_replica(model, lambda taken: load_hf_into(model, model_cfg, directory, taken))
        return
    path = Path(source).expanduser()
    if kind == SAFETENSORS_FILE:
        read_on_first_replica(model, lambda taken: load_safetensors_into(model, path, taken))
        return
    if kind == HF_DIRECTORY:
        if model_cfg is None or model_cfg.name != "hf":
            raise CheckpointError(f"{path} is a Hugging Face model directory: train it with "
                                  f"model.name=hf model.path={path} (a Llama also imports into the "
                                  f"built-in model with model.init_from=hf:{path})")
        read_on_first_replica(model, lambda taken: load_hf_model_into(model, path, taken))
        return
    metadata = verify_shared(path, verify_checksums)
    if (path / STATE_FILE).is_file():
        refuse_adapters_only(path, TrainState.read(path))
    adapted = get_model_state_dict(model)
    state = {base_name(name): value for name, value in adapted.items() if not is_adapter(name)}
    check_model_compatible(path, metadata, state)
    if average:
        read_dcp(averaged_state(path, metadata, state), path, metadata)
    else:
        read_dcp({"model": state}, path, metadata)
    set_model_state_dict(model, {name: state[base_name(name)] for name in adapted if not is_adapter(name)},
                         options=StateDictOptions(strict=len(state) == len(adapted)))


def read_on_first_replica(model: nn.Module, read: Callable[[frozenset[int]], None]) -> None:
    """``read(from_replica)`` on every rank, ``from_replica`` the ids of the weights this rank takes from its
    first data-parallel replica (HSDP, NO_SHARD: ``layout.replica_of``) instead of the files, then
    one broadcast a weight over each replica group. Every replica read its rows of every file: R
    replicas, R times the model from the shared filesystem (found by review). What any rank raised is
    raised on all before the broadcasts, which a rank would otherwise wait in alone."""
    replicated, from_replica = [], set()
    for _, param in base_parameters(model):  # the adapters are drawn afterwards, not read
        if (found := layout.replica_of(param)) is not None:
            replicated.append(found[:3])
            if not found[3]:
                from_replica.add(id(param))
    run_agreed(lambda: read(frozenset(from_replica)))
    layout.broadcast_replicated(replicated)


def averaged_state(path: Path, metadata, state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The DCP read that fills the model's ``state`` with the checkpoint's weight average: each
    tensor the average holds from it, the rest (buffers, frozen parameters) from the weights."""
    saved = metadata.state_dict_metadata
    averaged = {name: value for name, value in state.items() if f"{layout.AVERAGE_KEY}.{name}" in saved}
    if not averaged:
        raise layout.no_average(path)
    rest = {name: value for name, value in state.items() if name not in averaged}
    return {layout.AVERAGE_KEY: averaged, **({"model": rest} if rest else {})}


# What ``load_model_weights`` reads a source as; each kind reads with other collectives.
HF_IMPORT = "a Hugging Face directory to import"
SAFETENSORS_FILE = "a safetensors file"
HF_DIRECTORY = "a Hugging Face model directory"


def source_kind(source: str) -> str:
    """What ``load_model_weights`` reads ``source`` as, seen from this rank."""
    if source.startswith(HF_PREFIX):
        return HF_IMPORT
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".safetensors":
        return SAFETENSORS_FILE
    if is_model_directory(path):
        return HF_DIRECTORY
    return "a checkpoint directory" if path.is_dir() else "nothing"


def agreed_source_kind(source: str) -> str:
    """``source_kind``, the same on every rank (one all-gather), else an error on every rank: a path
    that exists on some nodes only would send the ranks down readers with different collectives."""
    kinds = agree(None, source_kind(source), error_type=CheckpointError)
    if differing := [rank for rank, kind in enumerate(kinds) if kind != kinds[0]]:
        raise CheckpointError(f"{source} is {kinds[0]} on rank 0 but {kinds[differing[0]]} on rank "
                              f"{differing[0]}; put it on a filesystem every node mounts")
    return kinds[0]


def verify_shared(path: Path, verify_checksums: bool = True):
    """``layout.verify`` of a weights checkpoint, each rank checking its 1/world share of the shard
    files (every rank stat'ing every file is a million stats at 1,024 ranks) and hashing its share
    of the recorded files that hold the model (``model_files_damaged``); the ranks' verdicts are
    shared, so all raise the first error together, none going on alone into DCP's collectives."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    metadata, error, damaged = None, None, {}
    try:
        metadata = layout.verify(path, need_state=False, share=(rank, world))
        damaged = model_files_damaged(path, metadata, rank, world) if verify_checksums else {}
    except (CheckpointError, OSError, MemoryError) as exc:  # on one rank alone too: agreed below
        error = str(exc)
    if found := {name: why for part in agree(error, damaged, error_type=CheckpointError)
                 for name, why in part.items()}:
        raise integrity.damage_error(path, found)
    return metadata


def model_files_damaged(path: Path, metadata, rank: int, world: int) -> dict[str, str]:
    """What is wrong with this rank's share of the files a weights read needs (``.metadata`` and
    those holding ``model.`` entries or the weights' average's ``ema.``: not the RNG files, nor
    files of optimizer state alone, though DCP's writer puts a rank's optimizer state in the file
    with its model shard, so those are hashed whole), by the checkpoint's recorded checksums: a
    flipped bit would otherwise load as a wrong weight, silently."""
    files = integrity.read_manifest(path)
    if files is None:
        if rank == 0:
            integrity.warn_unrecorded(path)
        return {}
    read = {info.relative_path for index, info in (metadata.storage_data or {}).items()
            if index.fqn.startswith(("model.", f"{layout.AVERAGE_KEY}."))} | {layout.METADATA_FILE}
    wanted = {name: entry for name, entry in files.items() if name in read}
    return integrity.damaged_files(path, wanted, integrity.verification_share(wanted, rank, world)) or {}


def read_dcp(state: dict[str, Any], path: Path, metadata: Metadata) -> None:
    """``dcp.load`` of ``state`` from ``path`` (on the default group, if any) with the ``metadata``
    already read and checked, its failure as one CheckpointError: DCP's own ``CheckpointException``
    derives from BaseException and its text names only the failed ranks, not why. Data-parallel
    replicas (HSDP, NO_SHARD) take what the first one read (``ReplicaLoadPlanner``)."""
    planner = layout.ReplicaLoadPlanner()
    try:
        with layout.reading_alone():  # export-peft's and export-hf --merge's base, one process
            dcp.load(state, storage_reader=layout.KnownMetadataReader(path, metadata), planner=planner)
    except DCP_FAILURES as exc:
        raise_if_interrupted(exc)
        rank = dist.get_rank() if dist.is_initialized() else None
        raise CheckpointError(load_failed(path, exc, "use another checkpoint, or check the filesystem "
                                                     "it is on", rank)) from exc
    layout.broadcast_replicated(planner.replicated)


def load_adapters(model: nn.Module, path: Path, verify_checksums: bool = True) -> None:
    """The adapters of a ``finetune=lora`` checkpoint into ``model`` (built with the same LoRA
    settings, sharded at any world size or not at all); its base is read or drawn separately."""
    metadata = verify_shared(path, verify_checksums)
    state = {name: value for name, value in get_model_state_dict(model).items() if is_adapter(name)}
    check_model_compatible(path, metadata, state, adapters_only=True)
    read_dcp({"model": state}, path, metadata)
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def base_parameters(model: nn.Module, remove_duplicate: bool = True):
    """(name, parameter) of every weight a weights source holds: a LoRA model's base under the names
    it has without adapters, the adapters left out (they are drawn, or read from a checkpoint)."""
    for name, param in model.named_parameters(remove_duplicate=remove_duplicate):
        if not is_adapter(name):
            yield base_name(name), param


def row_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is an FSDP2 DTensor whose shards are row ranges (dim 0)."""
    return isinstance(param, DTensor) and param.ndim > 0 and all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in param.placements)


def box_slices(param: DTensor) -> tuple[slice, ...]:
    """The global index of the block of ``param`` this rank holds (``local_box``)."""
    offsets, sizes = local_box(param)
    return tuple(slice(offset, offset + size) for offset, size in zip(offsets, sizes))


def own_rows(param: torch.Tensor, handle, name: str, what: str) -> torch.Tensor:
    """The part of tensor ``name`` of an open safetensors file that this rank's ``param`` holds: its
    block of a sharded parameter (FSDP's rows; under tensor parallelism a row-parallel weight's
    columns too: the file is memory-mapped, so other ranks' parts are never read and a rank's memory
    while loading grows with its shard), else the whole tensor."""
    stored = handle.get_slice(name)
    shape = tuple(stored.get_shape())
    if shape != tuple(param.shape):
        raise CheckpointError(f"{what} has shape {list(shape)}, the model wants {list(param.shape)}")
    if not isinstance(param, DTensor) or param.ndim == 0:
        return handle.get_tensor(name)
    return stored[box_slices(param)]


def own_permuted_rows(param: torch.Tensor, handle, name: str, heads: int) -> torch.Tensor:
    """``own_rows`` of a q/k projection stored in Hugging Face's layout, permuted into ours: this
    rank's rows lie in a few runs per head of the stored tensor (``hf_rows``), read run by run."""
    stored = handle.get_slice(name)
    shape = tuple(stored.get_shape())
    if shape != tuple(param.shape):
        raise CheckpointError(f"{name} has shape {list(shape)}, the model wants {list(param.shape)}")
    first, count = (first_row(param), param.to_local().shape[0]) if row_sharded(param) else (0, shape[0])
    if count == 0:
        return stored[0:0]
    ordered, order = hf_rows(torch.arange(first, first + count), heads, shape[0]).sort()
    breaks = ((ordered.diff() != 1).nonzero().flatten() + 1).tolist()
    part = None
    for a, b in zip([0, *breaks], [*breaks, count]):
        run = stored[int(ordered[a]):int(ordered[b - 1]) + 1]
        part = run.new_empty((count, *shape[1:])) if part is None else part
        part[order[a:b]] = run
    if isinstance(param, DTensor) and not row_sharded(param):  # split along columns: this rank's block
        part = part[box_slices(param)]
    return part


def read_own_rows(param: torch.Tensor, part: torch.Tensor) -> None:
    """``param`` := ``part`` from ``own_rows`` (this rank's block of a DTensor)."""
    # copy_ converts the dtype in the copy: no full-size temporary
    (param.to_local() if isinstance(param, DTensor) else param).copy_(part)


def copy_into(param: torch.Tensor, full: torch.Tensor, what: str) -> None:
    """This rank's slice of ``full`` into ``param``, after checking the shape."""
    if tuple(full.shape) != tuple(param.shape):
        raise CheckpointError(f"{what} has shape {list(full.shape)}, the model wants {list(param.shape)}")
    param.copy_(shard_like(full.to(param.dtype), param))


def read_expert_parts(param: torch.Tensor, parts: list[tuple[Any, Any, str]], what: str) -> None:
    """A parameter that stacks its experts (``[experts, rows, ...]``) from each expert's stored
    tensors, ``(ExpertPart, open file, stored name)``: each rank reads only the part of each that
    its shard holds (FSDP's rows are whole experts), none of the others."""
    name, per_expert = parts[0][0].name, parts[0][0].parts
    count = param.shape[0] * per_expert
    found = {(part.expert, part.part) for part, _, _ in parts}
    if len(parts) != count or found != {(e, p) for e in range(param.shape[0]) for p in range(per_expert)}:
        raise CheckpointError(f"{what}: {name} stacks {param.shape[0]} experts from {count} stored tensors; "
                              f"the files hold {len(parts)} of them")
    local, (offsets, sizes) = ((param.to_local(), local_box(param)) if isinstance(param, DTensor)
                               else (param, ([0] * param.ndim, list(param.shape))))
    rows = param.shape[1] // per_expert
    for part, handle, key in parts:
        stored = handle.get_slice(key)
        if list(stored.get_shape()) != [rows, *param.shape[2:]]:
            raise CheckpointError(f"{what}: {key} has shape {list(stored.get_shape())}, the model wants "
                                  f"{[rows, *param.shape[2:]]} for expert {part.expert} of {name}")
        start = [part.expert, part.part * rows, *([0] * (param.ndim - 2))]
        length = [1, rows, *param.shape[2:]]
        low = [max(s, o) for s, o in zip(start, offsets)]
        high = [min(s + n, o + z) for s, n, o, z in zip(start, length, offsets, sizes)]
        if any(lo >= hi for lo, hi in zip(low, high)):
            continue  # another rank's expert
        source = stored[tuple(slice(lo - s, hi - s) for lo, hi, s in zip(low[1:], high[1:], start[1:]))]
        local[tuple(slice(lo - o, hi - o) for lo, hi, o in zip(low, high, offsets))].copy_(source[None])


@torch.no_grad()
def load_files_into(model: nn.Module, files: list[Path], what: str,
                    rename: Callable[[str], str] = lambda key: key,
                    expert_part: Callable[[str], Any] = lambda key: None,
                    required_buffers: Collection[str] = frozenset(),
                    from_replica: Collection[int] = frozenset()) -> None:
    """Every parameter of ``model`` (and each buffer the files hold) from safetensors ``files``, tensor
    by tensor, each rank reading only its own rows (``own_rows``). ``rename`` maps a stored name to
    the model's; ``expert_part`` says where one expert's stored tensor goes in a parameter that
    stacks the experts (``read_expert_parts``), None for the others. ``required_buffers``: buffers
    nothing but the files sets (a family's ``_init_weights`` leaves them), refused when absent.
    ``from_replica``: the ids of parameters not to read (another replica reads them for this rank:
    ``read_on_first_replica``).

    A parameter registered under several names (tied input and output embeddings) may be stored
    under any of them or all: a consolidated checkpoint keeps every name its state dict had, a
    Hugging Face directory only the first. Stored non-persistent buffers (RoPE tables in old
    exports) are skipped: the model recomputes them; so are tensors the family's own loading skips
    (``ignored_on_load``).
    """
    aliases: dict[int, list[str]] = {}
    targets: dict[int, torch.Tensor] = {}
    for name, param in base_parameters(model, remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        targets[id(param)] = param
    persistent = {base_name(name) for name in model.state_dict()}
    buffers = {base_name(name): buffer for name, buffer in model.named_buffers()}
    with ExitStack() as stack:
        stored: dict[str, tuple[object, str]] = {}  # model name -> (open file, stored name)
        experts: dict[str, list[tuple[Any, Any, str]]] = {}  # model name -> its experts' tensors
        for file in files:
            handle = stack.enter_context(open_safetensors(file))
            for key in handle.keys():
                if (part := expert_part(key)) is not None:
                    experts.setdefault(part.name, []).append((part, handle, key))
                else:
                    stored[rename(key)] = (handle, key)
        known = {name for names in aliases.values() for name in names}
        missing = sorted(names[0] for names in aliases.values()
                         if not (stored.keys() | experts.keys()) & set(names))
        skipped = ignored_on_load(model)
        unexpected = sorted(name for name in (stored.keys() | experts.keys()) - known if name not in buffers
                            and not (name in stored and any(p.search(stored[name][1]) for p in skipped)))
        if missing or unexpected:
            raise CheckpointError(f"{what}: missing keys {missing[:6]}, unexpected keys {unexpected[:6]}")
        if absent := sorted(name for name in required_buffers if base_name(name) not in stored):
            raise CheckpointError(f"{what} lacks {', '.join(absent[:6])}: buffers the model's family does "
                                  "not initialise, so only the weight files can set them; use a "
                                  "directory saved with them (save_pretrained keeps persistent buffers)")
        for key, names in aliases.items():
            if key in from_replica:
                continue
            if stacked := next((name for name in names if name in experts), None):
                read_expert_parts(targets[key], experts[stacked], what)
                continue
            present = [name for name in names if name in stored]
            handle, first = stored[present[0]]
            part = own_rows(targets[key], handle, first, f"{what}: {first}")
            read_own_rows(targets[key], part)
            for other in present[1:]:  # the same weight twice must be the same weight
                handle, name = stored[other]
                if not torch.equal(own_rows(targets[key], handle, name, f"{what}: {name}"), part):
                    raise CheckpointError(f"{what}: {name} and {first} are one tied weight in this "
                                          "model but differ in the files; untie the model to load it")
        for name in buffers.keys() & stored.keys() & persistent:
            handle, key = stored[name]
            copy_into(buffers[name], handle.get_tensor(key), f"{what}: {key}")


# RoPE tables of exports made while they were persistent buffers, which no family keeps now.
STALE_ROPE_TABLES = re.compile(r"rotary_emb\.(inv_freq|cos_cached|sin_cached)$")


def ignored_on_load(model: nn.Module) -> list[re.Pattern]:
    """Stored names the model's family skips as transformers loads it (its
    ``_keys_to_ignore_on_load_unexpected``: old exports' attention bias and mask buffers, GPT-NeoX's
    and GPT-J's), and stale RoPE tables: an old Pythia's files were refused as unexpected keys where
    ``from_pretrained`` loads them."""
    patterns = {pattern for module in model.modules()
                for pattern in getattr(module, "_keys_to_ignore_on_load_unexpected", None) or ()}
    return [STALE_ROPE_TABLES, *(re.compile(pattern) for pattern in sorted(patterns))]


def load_safetensors_into(model: nn.Module, path: Path, from_replica: Collection[int] = frozenset()) -> None:
    """A consolidated shardtrain file (the model's own parameter names)."""
    load_files_into(model, [path], str(path), from_replica=from_replica)


def load_hf_model_into(model: nn.Module, directory: str | Path,
                       from_replica: Collection[int] = frozenset()) -> None:
    """A Hugging Face model directory into ``model.name=hf``'s model (transformers' names)."""
    directory = Path(directory).expanduser()
    load_files_into(model, weight_files(directory), str(directory), rename=model.parameter_name,
                    expert_part=model.expert_part,
                    required_buffers=getattr(model, "buffers_only_in_weights", frozenset()),
                    from_replica=from_replica)


def read_hf_config(directory: Path) -> dict:
    config_file = directory / HF_CONFIG_FILE
    if not config_file.is_file():
        raise CheckpointError(f"{directory} has no {HF_CONFIG_FILE}: not a Hugging Face model directory")
    try:
        config = json.loads(config_file.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{config_file} is not readable JSON ({exc}); write it again with "
                              "save_pretrained") from exc
    if not isinstance(config, dict) or config.get("model_type") != "llama":
        kind = config.get("model_type") if isinstance(config, dict) else type(config).__name__
        raise CheckpointError(f"{directory} holds a {kind!r} model; only llama models can be imported")
    if found := unrepresentable(config):
        raise CheckpointError(f"{directory} is a Llama the built-in model cannot compute: "
                              f"{'; '.join(found)}; train it as it is with model.name=hf "
                              f"model.path={directory}")
    return config


@torch.no_grad()
def load_hf_into(model: nn.Module, cfg: ModelConfig, directory: str | Path,
                 from_replica: Collection[int] = frozenset()) -> None:
    """``model.init_from=hf:<dir>``: fill the sharded model tensor by tensor, shard by shard (not the
    parameters whose ids are in ``from_replica``: another replica reads them for this rank)."""
    directory = Path(directory).expanduser()
    mismatched = config_mismatches(cfg, model_config_from_hf(read_hf_config(directory)))
    if mismatched:
        raise CheckpointError(f"{directory} does not fit the model config: " + "; ".join(mismatched))
    params = dict(base_parameters(model))
    loaded = set()
    for file in weight_files(directory):
        with open_safetensors(file) as f:
            for hf_name in f.keys():
                name = from_hf_name(hf_name)
                if name is None and not hf_name.endswith("rotary_emb.inv_freq"):  # old exports' buffers
                    raise CheckpointError(f"{directory}: {hf_name} has no place in the built-in Llama; "
                                          f"train it as it is with model.name=hf model.path={directory}")
                if name is None or name not in params:
                    continue  # read only the tensors the model keeps
                loaded.add(name)
                if id(params[name]) in from_replica:
                    continue
                heads = rotary_heads(name, cfg)
                part = (own_permuted_rows(params[name], f, hf_name, heads) if heads else
                        own_rows(params[name], f, hf_name, hf_name))
                read_own_rows(params[name], part)
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{directory} lacks weights for {missing[:6]}")


# A fingerprint of a file reads its size, its first and last MiB and this many blocks between:
# seconds for a 70B model's files, where hashing every byte would take minutes on every resume.
FINGERPRINT_BLOCKS = 16
FINGERPRINT_BLOCK = 1 << 16
FINGERPRINT_ENDS = 1 << 20


def file_fingerprint(path: Path) -> str:
    """sha256 over a file's size, its first and last MiB and evenly spaced blocks between: any two
    different models' weight files differ in it (fine-tuned weights differ everywhere), any copy
    of a file has the same."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(FINGERPRINT_ENDS))
        for index in range(FINGERPRINT_BLOCKS):
            f.seek(size * index // FINGERPRINT_BLOCKS)
            digest.update(f.read(FINGERPRINT_BLOCK))
        f.seek(max(0, size - FINGERPRINT_ENDS))
        digest.update(f.read(FINGERPRINT_ENDS))
    return digest.hexdigest()


# ``fingerprint_kind`` of a DCP checkpoint base's identity (``dcp_fingerprint``). Identities without
# the key (every other source, and DCP bases recorded before it) hold ``files_fingerprint``.
DCP_FINGERPRINT = "dcp-metadata"


def source_path(source: str) -> Path:
    """The path a weights source (``ModelConfig.weights_source``) names: ``hf:`` (a Llama imported
    into the built-in model) stripped, ``~`` expanded."""
    return Path(source.removeprefix(HF_PREFIX)).expanduser()


def source_files(source: str) -> list[Path]:
    """The files holding the weights of a weights source (``ModelConfig.weights_source``)."""
    path = source_path(source)
    if path.is_file():
        return [path]
    if is_model_directory(path):
        return weight_files(path)
    if not path.is_dir():
        raise CheckpointError(
            f"the base weights {source!r} do not exist; if they moved since a run trained on them, put "
            f"them back, or link that path to where they are now (ln -s NEW {path}); a run resumed with "
            "the new path (model.path or model.init_from) records it in its next checkpoint")
    return sorted(p for p in path.iterdir() if p.is_file() and (p.suffix == ".distcp"
                                                                  or p.name == layout.METADATA_FILE))


def is_dcp_source(source: str) -> bool:
    """Whether a weights source is a DCP checkpoint directory (one shard file per saving rank)."""
    path = source_path(source)
    return path.is_dir() and not is_model_directory(path)


def files_fingerprint(source: str, known: Mapping[int, str] | None = None) -> str:
    """``file_fingerprint`` of every file of the source, combined: about 3 MiB read per file.
    ``known``: digests of some of them (by position in ``source_files``), read by another process."""
    digest = hashlib.sha256()
    for index, file in enumerate(source_files(source)):
        each = known[index] if known is not None and index in known else file_fingerprint(file)
        digest.update(file.name.encode() + each.encode())
    return digest.hexdigest()


def file_fingerprints_share(source: str, share: int, shares: int) -> dict[int, str]:
    """``file_fingerprint`` of every ``shares``-th file of the source from the ``share``-th on, by
    position in ``source_files``: one process's part of ``files_fingerprint`` split between several."""
    return {index: file_fingerprint(file) for index, file in enumerate(source_files(source))
            if index % shares == share}


def dcp_fingerprint(source: str) -> str:
    """sha256 of a DCP checkpoint's ``.metadata`` and, if it has one, its ``checksums.json``.

    ``.metadata`` holds the id DCP draws for every save and where each tensor's bytes lie; the
    manifest, every file's sha256. So a copy has the same fingerprint and another save (another
    model, or the same one saved again) another. Two small files, read by every rank at start:
    ``files_fingerprint`` read 3 MiB of every shard file on every rank, 3 GiB per rank for a base
    saved at 1,024 ranks.
    """
    path = source_path(source)
    digest = hashlib.sha256(DCP_FINGERPRINT.encode())
    for name in (layout.METADATA_FILE, MANIFEST_FILE):
        file = path / name
        if name == layout.METADATA_FILE and not file.is_file():
            raise CheckpointError(f"the base weights {source!r} are no DCP checkpoint: they have no "
                                  f"{layout.METADATA_FILE}")
        if file.is_file():
            digest.update(b"\0" + name.encode() + b"\0" + file_sha256(file).encode())
    return digest.hexdigest()


def base_identity(model_cfg: ModelConfig, seed: int, finetune: FinetuneConfig | None = None,
                  known: Mapping[int, str] | None = None) -> dict[str, Any]:
    """What a LoRA checkpoint's adapters were trained on: the base weights' source with a fingerprint
    of its files (``known``: as ``files_fingerprint`` takes them), or the seed of a random base;
    under QLoRA also how the base was quantised."""
    qlora = finetune is not None and finetune.method == "qlora"
    quantized = {"quantization": NF4_DESCRIPTION} if qlora else {}
    source = model_cfg.weights_source()
    if source is None:
        # The built-in model's draw depends on model.init_std too: a resume with another one trained
        # the adapters on another base without a word.
        drawn = {"init_std": model_cfg.init_std} if model_cfg.name == "llama" else {}
        return {"source": "random", "seed": seed, **drawn, **quantized}
    resolved = str(source_path(source).resolve())
    if is_dcp_source(source):
        return {"source": resolved, "fingerprint": dcp_fingerprint(source),
                "fingerprint_kind": DCP_FINGERPRINT, **quantized}
    described = ({"config": config_values(source_path(source))}
                 if is_model_directory(source_path(source)) else {})
    return {"source": resolved, "fingerprint": files_fingerprint(source, known), **described, **quantized}


# What a model directory's config.json holds that does not change the model's computation, or that a
# re-save rewrites (transformers' version, the dtype's spelling).
UNCOMPUTED_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "torch_dtype", "dtype",
                                    "use_cache", "architectures", "bos_token_id", "eos_token_id",
                                    "pad_token_id"})


def config_values(directory: Path) -> dict[str, Any]:
    """A model directory's config.json values, less ``UNCOMPUTED_CONFIG_KEYS``: the same weights under
    another config are another model (found by review: an edited rms_norm_eps changed eval's loss of
    a LoRA checkpoint without a word)."""
    config = json.loads((directory / HF_CONFIG_FILE).read_bytes())
    return {key: value for key, value in config.items() if key not in UNCOMPUTED_CONFIG_KEYS}


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The config keys both identities record with other values. Keys only one records are not
    compared: a re-save by another transformers adds its defaults and renames some (rope_scaling to
    rope_parameters), the model unchanged (found by the diff's review: a digest of every key refused
    the same base after a re-save)."""
    before, now = saved.get("config"), current.get("config")
    if not isinstance(before, dict) or not isinstance(now, dict):  # recorded before configs were
        return []
    return sorted(key for key in before.keys() & now.keys() if before[key] != now[key])


def same_base(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether two identities (``base_identity``) name the same base weights (and, where both record
    its config, one that computes alike)."""
    if "init_std" in saved and saved["init_std"] != current.get("init_std"):  # saved without: not known
        return False
    if config_changes(saved, current):
        return False
    if saved.get("fingerprint", saved.get("seed")) == current.get("fingerprint", current.get("seed")):
        return True
    # A checkpoint saved before DCP bases were fingerprinted by their metadata holds the old kind:
    # the current base's files are read the old way (slow, once) rather than the resume refused.
    old_kind = "fingerprint" in saved and "fingerprint_kind" not in saved
    if old_kind and current.get("fingerprint_kind") == DCP_FINGERPRINT:
        return saved["fingerprint"] == files_fingerprint(current["source"])
    return False


def describe_base(identity: dict[str, Any]) -> str:
    if identity["source"] != "random":
        return f"{identity['source']} ({identity.get('fingerprint')})"
    std = f", model.init_std {identity['init_std']}" if "init_std" in identity else ""
    return f"random (seed {identity.get('seed')}{std})"


def check_same_base(path: Path, saved: dict[str, Any] | None, current: dict[str, Any],
                    use: str = "resume it on") -> None:
    """A LoRA checkpoint resumes (is read, exported: ``use``) only onto the base its adapters were
    trained on."""
    if saved is None:
        raise CheckpointError(f"checkpoint {str(path)!r} holds no adapters (it is not a finetune=lora "
                              "checkpoint); resume it with finetune.method=none")
    if changed := config_changes(saved, current):
        shown = ", ".join(f"{key} {saved['config'][key]!r} -> {current['config'][key]!r}"
                          for key in changed[:3])
        raise CheckpointError(f"checkpoint {str(path)!r} was trained on base {saved['source']} with another "
                              f"config.json ({shown}): {use} the base as it was when it trained (put its "
                              "config.json back)")
    if not same_base(saved, current):
        raise CheckpointError(f"checkpoint {str(path)!r} was trained on base {describe_base(saved)}, not "
                              f"on this run's {describe_base(current)}: {use} the base it was trained on "
                              "(its files as they were when it trained, or its seed and model.init_std)")
    trained, now = saved.get("quantization", "none"), current.get("quantization", "none")
    if trained != now:  # QLoRA adapters learnt the quantised base's errors: not the same base
        raise CheckpointError(f"checkpoint {str(path)!r} was trained on the base quantised as {trained}, "
                              f"not {now}: resume it with the finetune.method it was trained with")
