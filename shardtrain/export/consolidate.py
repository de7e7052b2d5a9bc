"""Sharded DCP checkpoint -> model-only safetensors, streamed a group of tensors at a time.

Reads shardtrain checkpoints, Lightning's sharded FSDP checkpoints (``meta.pt`` + ``.metadata`` +
``*.distcp``; the Trainer keeps weights under ``state_dict.``, Fabric under the user's key such as
``model.``) and plain DCP directories. Each output file's header is written first (every tensor's
dtype, shape and place is known from DCP's metadata), then its tensors, read ``READ_BYTES`` at a
time (a larger tensor alone): peak memory is about that, not the model, nor the output file (one
file of a 70B model held it all). No process group needed.
The checksums a shardtrain checkpoint records are verified first (``verify=False``, the CLI's
``--skip-checksums``, skips that), so damage is named instead of surfacing as a torch error. An
output that already holds model files is refused (``check_new_output``): an earlier export's files
left beside the new ones would be read instead of them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shardtrain.checkpoint import integrity, layout
from shardtrain.checkpoint.dcp_errors import DCP_FAILURES, load_failed, raise_if_interrupted
from shardtrain.checkpoint.safetensors_files import (
    INDEX_FILE,
    check_new_output,
    check_writable,
    file_order_key,
    shard_name,
    shardtrain_metadata,
    write_index,
    write_streamed,
)
from shardtrain.checkpoint.state import TrainState
from shardtrain.checkpoint.weights import refuse_adapters_only
from shardtrain.config.plan import DTYPES, dtype_name
from shardtrain.config.schema import ModelConfig
from shardtrain.config.sizes import parse_size
from shardtrain.errors import CheckpointError, ModelError
from shardtrain.models.registry import build_model

# The bytes of checkpoint tensors read from DCP at once while a file is written: fewer reads of larger
# groups cost little, and the peak memory is about this (or the largest tensor).
READ_BYTES = 256 * 2**20

# Wrapper prefixes that torch.compile and FSDP1/activation-checkpoint wrappers put into names.
WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


AVERAGE_PREFIX = f"{layout.AVERAGE_KEY}."


def model_prefix(keys: list[str], fmt: str, key: str | None) -> str:
    """Which top-level entry holds the model weights."""
    if key is not None:
        prefix = key.rstrip(".") + "." if key else ""
    elif fmt == "lightning" and any(k.startswith("state_dict.") for k in keys):
        prefix = "state_dict."
    elif any(k.startswith("model.") for k in keys):
        prefix = "model."
    else:
        prefix = ""
    if prefix and not any(k.startswith(prefix) for k in keys):
        tops = sorted({k.split(".", 1)[0] for k in keys})
        raise CheckpointError(f"no tensors under {prefix!r} in this checkpoint; its top-level keys are "
                              f"{tops}: pass --key with the one that holds the model")
    return prefix


@dataclass(frozen=True)
class Cast:
    """``--dtype``: floating-point tensors written in ``dtype`` (None: as stored; an integer buffer
    such as a step count or token ids would lose its values), except those whose name a pattern of
    ``kept`` is found in: what the model's family keeps in fp32 (``HFCausalLM.kept_in_fp32``), written
    as stored (a MoE router's gate rounded to bf16 was read back upcast, its precision gone)."""

    dtype: torch.dtype | None = None
    kept: tuple[str, ...] = ()

    def of(self, name: str, stored: torch.dtype) -> torch.dtype:
        """The dtype the tensor ``name``, stored in ``stored``, is written in."""
        if self.dtype is None or not stored.is_floating_point or self.keeps(name):
            return stored
        return self.dtype

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in the dtype it is written in; a value past that dtype's range (fp16's 65504)
        refused, naming the tensor: written as inf, consolidate exited 0 and export-hf's check
        blamed the conversion (found by review)."""
        dtype = self.of(name, tensor.dtype)
        written = tensor.to(dtype)
        if (dtype != tensor.dtype and torch.finfo(dtype).max < torch.finfo(tensor.dtype).max
                and (torch.isfinite(tensor) & ~torch.isfinite(written)).any()):
            largest = tensor[torch.isfinite(tensor)].abs().max().item()
            fix = ("use --dtype bf16 (fp32's range) or leave the weights as stored" if dtype != torch.bfloat16
                   else "leave the weights as stored")
            raise CheckpointError(f"tensor {name!r} holds {largest:.4g}, past {dtype_name(dtype)}'s "
                                  f"largest value ({torch.finfo(dtype).max:.6g}): --dtype would write it as "
                                  f"inf; {fix}")
        return written

    def keeps(self, name: str) -> bool:
        return any(re.search(pattern.replace("*", ".*"), name) for pattern in self.kept)


def written_dtype(dtype: str | None) -> torch.dtype | None:
    """``--dtype``'s torch dtype (None: as stored), an unknown name refused."""
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    return DTYPES[dtype] if dtype else None


def model_cast(cfg: ModelConfig | None, dtype: torch.dtype | None) -> Cast:
    """The cast to ``dtype`` of the weights of the model ``cfg`` describes (None: a checkpoint that
    does not say, written by another framework: every floating-point tensor is cast)."""
    if cfg is None or cfg.name != "hf" or dtype in (None, torch.float32):
        return Cast(dtype)
    try:
        with torch.device("meta"):  # through the registry: transformers only where a run asks for it
            return Cast(dtype, build_model(cfg).kept_in_fp32(dtype))
    except ModelError as exc:  # its config.json gone: the weights it keeps in fp32 cannot be told
        raise CheckpointError(f"--dtype {dtype_name(dtype)} reads the Hugging Face model's config.json "
                              f"to keep in fp32 what its family keeps so ({exc}); or write the weights as "
                              "stored (no --dtype)") from exc


def clean_name(name: str, prefix: str) -> str:
    name = name[len(prefix):]
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


@dataclass
class Plan:
    shards: list[list[tuple[str, str, TensorStorageMetadata]]]  # (checkpoint key, output name, meta)
    total_bytes: int
    metadata: Metadata  # read once, reused by every output shard's read
    files: list[str]  # the files the model's tensors are read from, and .metadata


def plan_shards(path: Path, max_shard_bytes: int | None, cast: Cast, key: str | None) -> Plan:
    metadata = layout.read_dcp_metadata(path)
    layout.check_shard_files(path, metadata)
    tensors = {k: v for k, v in metadata.state_dict_metadata.items()
               if isinstance(v, TensorStorageMetadata)}
    averaging = key is not None and key.rstrip(".") == layout.AVERAGE_KEY
    if averaging and not any(k.startswith(AVERAGE_PREFIX) for k in tensors):
        raise layout.no_average(path)
    prefix = model_prefix(list(tensors), layout.detect_format(path), key)
    if prefix == "" and any(k.startswith(("optim.", "optimizer")) for k in tensors):
        raise CheckpointError("cannot tell model weights from optimizer state here; pass --key")
    selected = [(k, clean_name(k, prefix), tensors[k]) for k in tensors if k.startswith(prefix)]
    if prefix == AVERAGE_PREFIX:
        # trainer.ema_decay averages the trained parameters: the model's buffers (a norm's running
        # statistics) and any frozen parameters come from the weights themselves.
        averaged = {name for _, name, _ in selected}
        selected += [(k, name, tensors[k]) for k in tensors if k.startswith("model.")
                     if (name := clean_name(k, "model.")) not in averaged]
    if not selected:
        raise CheckpointError(f"checkpoint {str(path)!r} holds no model tensors")
    names = [n for _, n, _ in selected]
    if len(set(names)) != len(names):
        raise CheckpointError("two checkpoint keys map to the same weight name after removing prefixes")
    shards: list[list] = [[]]
    current = total = 0
    for entry in selected:
        meta = entry[2]
        size = meta.size.numel() * cast.of(entry[1], meta.properties.dtype).itemsize
        if max_shard_bytes and shards[-1] and current + size > max_shard_bytes:
            shards.append([])
            current = 0
        shards[-1].append(entry)
        current += size
        total += size
    keys = {k for k, _, _ in selected}
    files = {info.relative_path for index, info in (metadata.storage_data or {}).items()
             if index.fqn in keys}
    return Plan(shards, total, metadata, sorted(files | {layout.METADATA_FILE}))


def load_tensors(path: Path, entries, metadata: Metadata) -> dict[str, torch.Tensor]:
    """``entries``' tensors from ``path``, with its ``metadata`` as ``layout.read_dcp_metadata`` read it
    (DCP's own reader unpickles ``.metadata`` with no restriction)."""
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, _, m in entries}
    with layout.reading_alone():
        try:
            dcp.load(state, storage_reader=layout.KnownMetadataReader(path, metadata),
                     planner=layout.WeightsOnlyLoadPlanner(), no_dist=True)
        except DCP_FAILURES as exc:  # DCP's CheckpointException is a BaseException: one line here
            raise_if_interrupted(exc)
            raise CheckpointError(load_failed(path, exc, "check the checkpoint's files (shardtrain inspect "
                                              "names a damaged one when it has checksums)")) from exc
    return state


def written_layout(entries: list, cast: Cast) -> list:
    """(output name, written dtype, shape) of each entry: a file's header, before its bytes."""
    return [(out_name, cast.of(out_name, meta.properties.dtype), tuple(meta.size))
            for _, out_name, meta in entries]


def read_groups(entries: list) -> Iterator[list]:
    """``entries`` in order, in runs of at most ``READ_BYTES`` stored bytes (a larger tensor alone)."""
    budget = READ_BYTES
    group: list = []
    size = 0
    for entry in entries:
        meta = entry[2]
        nbytes = meta.size.numel() * meta.properties.dtype.itemsize
        if group and size + nbytes > budget:
            yield group
            group, size = [], 0
        group.append(entry)
        size += nbytes
    if group:
        yield group


def streamed_tensors(path: Path, entries: list, metadata: Metadata,
                     cast: Cast) -> Iterator[tuple[str, torch.Tensor]]:
    """(output name, tensor in its written dtype) of ``entries`` in order, read a group at a time."""
    for group in read_groups(entries):
        loaded = load_tensors(path, group, metadata)
        for ckpt_key, out_name, _ in group:
            tensor = loaded.pop(ckpt_key)
            yield out_name, cast.apply(out_name, tensor)
        del loaded


def resolved(checkpoint: str | Path) -> Path:
    """The checkpoint itself, not a link to it: a training moves its checkpoints/best while an export
    reads through it a group of tensors at a time, and the export mixed two steps without a word
    (found by review). A prune during the read then fails loudly: the files are gone."""
    return Path(checkpoint).expanduser().resolve()


def checked_plan(path: Path, max_shard_size: str | None, dtype: str | None, key: str | None,
                 verify: bool, cast: Cast | None = None) -> tuple[Plan, Cast]:
    """The output shards of checkpoint ``path`` and the dtype they are cast to (``cast``: the
    caller's, export-hf's from the model it converts with; None: made from the checkpoint's model),
    after every check that comes before a tensor is read: the kind of checkpoint, the options, its
    structure, then the checksums of the files it reads."""
    if reason := layout.unfinished_save(path):  # found by review: exported as if whole
        raise CheckpointError(reason)
    state = TrainState.read(path) if layout.detect_format(path) == "shardtrain" else None
    if state is not None:
        # Its model entries are the adapters alone: a "model" file of them would load as nothing.
        refuse_adapters_only(path, state)
    written = written_dtype(dtype)
    # Another task's model, or one a factory in code built, has no model.* to read: cast whole
    # (asked of it, consolidate refused every such checkpoint, its only export: found by review)
    if cast is None:
        cfg = state.model_config() if state is not None and state.built_from_model_config else None
        cast = model_cast(cfg, written)
    limit = parse_size(max_shard_size, "--max-shard-size") if max_shard_size else None
    plan = plan_shards(path, limit, cast, key)  # the structure first: cheap, and the precise message
    if verify:
        # then every byte of the files it reads (not the RNG files, nor files of optimizer state only)
        integrity.verify_files(path, names=plan.files)
    return plan, cast


def shard_readers(checkpoint: str | Path, max_shard_size: str | None = None, dtype: str | None = None,
                  key: str | None = None, verify: bool = True,
                  cast: Cast | None = None) -> list[Callable[[], dict[str, torch.Tensor]]]:
    """The shards ``consolidate`` would write, each a function that reads its tensors (output names,
    cast) into memory when called: export-hf converts them as they come, with no consolidated copy
    on disk (it staged one, the model's size in free disk on top of the export)."""
    path = resolved(checkpoint)
    plan, cast = checked_plan(path, max_shard_size, dtype, key, verify, cast)
    return [partial(shard_tensors, path, entries, plan.metadata, cast) for entries in plan.shards]


def shard_tensors(path: Path, entries: list, metadata: Metadata,
                  cast: Cast) -> dict[str, torch.Tensor]:
    return dict(streamed_tensors(path, entries, metadata, cast))


def consolidate(checkpoint: str | Path, out: str | Path, max_shard_size: str | None = None,
                dtype: str | None = None, key: str | None = None, verify: bool = True) -> list[Path]:
    """Write model-only safetensors; returns the files written."""
    path, out = resolved(checkpoint), Path(out)
    check_new_output(out)  # before reading anything: files of an earlier export must not mix in
    plan, cast = checked_plan(path, max_shard_size, dtype, key, verify)
    single = out.suffix == ".safetensors"
    if single and len(plan.shards) > 1:
        raise CheckpointError(f"{out} names one file but --max-shard-size makes {len(plan.shards)} "
                              "shards; pass a directory instead")
    metadata = {"format": "pt"}
    model_entries = key is None or key.rstrip(".") in ("model", layout.AVERAGE_KEY)
    if layout.detect_format(path) == "shardtrain" and model_entries:
        # the weights' average (trainer.ema_decay's) is the same model's
        state = TrainState.read(path)
        metadata = shardtrain_metadata(state.config, state.tokenizer)
    check_writable([entry for entries in plan.shards for entry in written_layout(entries, cast)])
    directory = out.parent if single else out
    made = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    try:
        return write_shards(path, plan, directory, out.name if single else None, metadata, cast, files)
    except BaseException:
        # What a failure (a full disk, Ctrl-C) left would block the next attempt ("already holds
        # model files") and keep the space that ran out: the files this call wrote go.
        for file in files:
            file.unlink(missing_ok=True)
        if made and not any(directory.iterdir()):
            directory.rmdir()
        raise


def write_shards(path: Path, plan: Plan, directory: Path, single_name: str | None, metadata: dict[str, str],
                 cast: Cast, files: list[Path]) -> list[Path]:
    """``plan``'s shards into ``directory`` (one file named ``single_name``, or numbered shards and
    their index), each appended to ``files`` once written."""
    n = len(plan.shards)
    weight_map = {}
    for index, entries in enumerate(plan.shards, start=1):
        name = single_name or shard_name(index, n)
        # In the order the file holds them: each offset a multiple of its item size
        entries = sorted(entries, key=lambda entry: file_order_key(
            entry[1], cast.of(entry[1], entry[2].properties.dtype)))
        write_streamed(directory / name, written_layout(entries, cast), metadata,
                       streamed_tensors(path, entries, plan.metadata, cast))
        weight_map.update((out_name, name) for _, out_name, _ in entries)
        files.append(directory / name)
    if n > 1:
        files.append(directory / INDEX_FILE)  # before it is written: a half-written index goes too
        write_index(directory, weight_map, plan.total_bytes)
    return files
