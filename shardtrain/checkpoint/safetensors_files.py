"""The Hugging Face safetensors conventions, in one place: shard names, the index, metadata, dtypes.

``model.safetensors`` alone, or ``model-00001-of-00003.safetensors`` ... with
``model.safetensors.index.json`` mapping every tensor name to its file. Consolidation and export write
this layout; ``inspect``, ``model.init_from`` and generation read it.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardtrain.checkpoint.state import STATE_FILE, language_model_refusal
from shardtrain.errors import CheckpointError, first_line, os_error_code

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Metadata key under which shardtrain stores the model config in a consolidated file.
MODEL_CONFIG_KEY = "shardtrain_model_config"
# ... and the training data's config: `eval` scores the held-out split of it.
DATA_CONFIG_KEY = "shardtrain_data_config"
# ... and the windows the run's evaluations scored (trainer.seq_len, trainer.eval_samples): `eval` of
# the file repeats the val_loss the run logged, as of the checkpoint directory.
EVAL_SETTINGS_KEY = "shardtrain_eval_settings"
# ... and the task the weights were trained with (task.path, task.model_factory): another task's
# model is not the one model.* builds, which the keys above describe.
TASK_CONFIG_KEY = "shardtrain_task_config"
# ... and the tokenizer the model's text was read with (TrainState.tokenizer), which generate, eval
# and export-hf compare with the one they read.
TOKENIZER_KEY = "shardtrain_tokenizer"
# What readers of a model directory take from it (weights, indexes, configs, tokenizers): left by an
# earlier export beside a new one, they would be loaded instead of it (transformers prefers
# model.safetensors to an index) or mixed with it.
DCP_METADATA_FILE = ".metadata"  # layout.METADATA_FILE (layout imports this module, not the reverse)
# A PEFT adapter directory's settings (peft_adapter.py reads them; layout knows the directory by them).
ADAPTER_CONFIG = "adapter_config.json"
MODEL_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt",
               "*.pth", "*.gguf", "config.json", "generation_config.json", "adapter_config.json",
               "tokenizer*", "special_tokens_map.json", "chat_template.jinja")
# Every dtype the format holds, by its name in a file's header.
DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
          "BOOL": torch.bool, "C64": torch.complex64, "F8_E4M3": torch.float8_e4m3fn,
          "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
          "F8_E5M2FNUZ": torch.float8_e5m2fnuz}


def shard_name(index: int, count: int) -> str:
    """File name of shard ``index`` (1-based) of ``count``."""
    return SINGLE_FILE if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"


def shardtrain_metadata(config: dict[str, Any], tokenizer: str | None = None) -> dict[str, str]:
    """A consolidated file's metadata: the task, and for the language model built from ``model.*``
    the model's and the data's config and the run's evaluation windows (from a checkpoint's
    ``trainer_state.json``), so that ``generate`` and ``eval`` rebuild the model, and score what the
    run scored, from the file alone. Another task's file records its task alone (found by a new-user
    trial: it recorded the unused default model.*, and generate failed on its keys)."""
    task = {key: config.get("task", {}).get(key) for key in ("path", "model_factory")}
    metadata = {"format": "pt", TASK_CONFIG_KEY: json.dumps(task, sort_keys=True)}
    if tokenizer is not None:
        metadata[TOKENIZER_KEY] = tokenizer
    if language_model_refusal(task["path"], task["model_factory"]) is None:
        metadata.update({MODEL_CONFIG_KEY: json.dumps(config["model"], sort_keys=True),
                         DATA_CONFIG_KEY: json.dumps(config["data"], sort_keys=True),
                         EVAL_SETTINGS_KEY: json.dumps(eval_settings(config), sort_keys=True)})
    return metadata


def eval_settings(config: dict[str, Any]) -> dict[str, int]:
    """The windows a run's evaluations scored, from its saved config: ``seq_len`` and
    ``eval_samples`` where it has them."""
    trainer = config.get("trainer", {})
    return {key: int(trainer[key]) for key in ("seq_len", "eval_samples") if key in trainer}


def unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors, contiguous, each with storage of its own: safetensors refuses tensors that share
    memory (tied embeddings: both names are written, equal, as consolidation writes them)."""
    seen: set[int] = set()
    result = {}
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage().data_ptr()
        result[name] = tensor.clone() if storage in seen else tensor.contiguous()
        seen.add(storage)
    return result


def read_umask() -> int:
    """The process's umask (reading it means setting it: done once, at import, before any thread
    that writes files has started)."""
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


# The mode any new file gets here: 0666 less the umask.
NEW_FILE_MODE = 0o666 & ~read_umask()


def remove_written(out: Path, written: Iterable[Path], made: bool) -> None:
    """The files an export wrote into ``out``, removed (what a failure left would block the next
    attempt, "already holds model files", and keep the space), and ``out`` itself where the export
    made it and nothing else is in it (as consolidate's)."""
    for path in written:
        if not path.is_dir():
            path.unlink(missing_ok=True)
    if made and out.is_dir() and not any(out.iterdir()):
        out.rmdir()

def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' ``save_file`` with the permissions any other file written here gets: the library
    creates its files 0600 whatever the umask, so on a shared cluster an export was unreadable to
    the serving job or a colleague. A failure of the filesystem is an OSError naming the file (the
    library's own error named neither file nor filesystem: found by review)."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as exc:
        if (code := os_error_code(exc)) is None or isinstance(exc, OSError):
            raise
        raise OSError(code, os.strerror(code), str(path)) from exc
    try:
        os.chmod(path, NEW_FILE_MODE)
    except OSError as exc:  # a filesystem without modes (some network mounts) keeps its own
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise


def save_shard(tensors: dict[str, torch.Tensor], target: Path, metadata: dict[str, str]) -> None:
    """Write one file atomically (a crash leaves no half-written file under the final name)."""
    tmp = target.with_name(target.name + ".tmp")
    save_safetensors(tensors, tmp, metadata)
    os.replace(tmp, target)


# A tensor of a file written as it streams: its name, dtype and shape, known before its bytes.
TensorLayout = tuple[str, torch.dtype, tuple[int, ...]]
SAFETENSORS_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def check_writable(layout: list[TensorLayout]) -> None:
    """Every tensor of ``layout`` in a dtype safetensors holds (before any file is written)."""
    for name, dtype, _ in layout:
        if dtype not in SAFETENSORS_NAMES:
            raise CheckpointError(f"tensor {name!r} is {dtype}, which safetensors files cannot hold (they "
                                  f"hold {', '.join(DTYPES)})")


def file_order_key(name: str, dtype: torch.dtype) -> tuple[int, str]:
    """The order the library writes a file's tensors in, larger items first (then by name): each
    tensor's offset is then a multiple of its item size, which readers that map the file and view
    its bytes as the dtype (zero-copy loaders) need."""
    return -dtype.itemsize, name


def streamed_header(layout: list[TensorLayout], metadata: dict[str, str]) -> bytes:
    """The safetensors header of ``layout``'s tensors stored one after another in that order: an
    8-byte little-endian length, then the JSON (padded with spaces to a multiple of 8 bytes, as the
    library writes it) of each tensor's dtype, shape and byte range."""
    check_writable(layout)
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in layout:
        size = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_streamed(target: Path, layout: list[TensorLayout], metadata: dict[str, str],
                   tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file whose header is known before its tensors (``layout``, in file order), the
    tensors' bytes written as ``tensors`` yields them in that order: only the ones being yielded are
    in memory, not the file's (the library writes from a dict of every tensor). Atomic, as
    ``save_shard``; the library reads the result (tested)."""
    tmp = target.with_name(target.name + ".tmp")

    def written(call: Callable[..., Any], *args: Any) -> None:
        try:
            call(*args)
        except OSError as exc:  # a file object's write names no file: a full disk said without a path
            if exc.filename is None and exc.errno is not None:
                raise OSError(exc.errno, exc.strerror, str(target)) from exc
            raise

    try:
        out = open(tmp, "wb")
        try:
            written(out.write, streamed_header(layout, metadata))
            expected = iter(layout)
            for name, tensor in tensors:
                want = next(expected)
                if (name, tensor.dtype, tuple(tensor.shape)) != want:  # the caller's order: a bug if not
                    raise RuntimeError(f"streamed tensor {name} {tensor.dtype} {tuple(tensor.shape)} is not "
                                       f"the next of the header, {want}")
                # Little-endian bytes (the format's, and every platform torch trains on)
                written(out.write, memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
            if next(expected, None) is not None:
                raise RuntimeError(f"{target}: fewer tensors streamed than its header holds")
            written(out.flush)  # what the buffer holds, before close would write it unnamed
            written(out.close)  # a network filesystem reports a failed write at close
        finally:
            if not out.closed:  # after a failure: its error is said, not close's retry of the write
                with contextlib.suppress(OSError):
                    out.close()
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_index(directory: Path, weight_map: dict[str, str], total_bytes: int) -> Path:
    index = directory / INDEX_FILE
    index.write_text(json.dumps({"metadata": {"total_size": total_bytes},
                                 "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    return index


def indexed_files(index: Path) -> list[Path]:
    """The shard files an index names (each once, sorted)."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
    if not (isinstance(weight_map, dict) and all(isinstance(name, str) for name in weight_map.values())):
        raise CheckpointError(f"{index}: not a valid safetensors index (its weight_map is not a mapping "
                              "of tensor names to file names)")
    return sorted({index.parent / name for name in weight_map.values()})


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory: its index's shards, or its single file."""
    if (directory / INDEX_FILE).is_file():
        return indexed_files(directory / INDEX_FILE)
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    raise CheckpointError(f"{directory} has no {SINGLE_FILE} or {INDEX_FILE} (only safetensors "
                          "Hugging Face checkpoints are supported)")


def model_files(directory: Path) -> list[str]:
    """The names in ``directory`` that a model directory's readers would read (``MODEL_FILES``)."""
    if not directory.is_dir():
        return []
    return sorted(entry.name for entry in directory.iterdir()
                  if any(fnmatch.fnmatch(entry.name, pattern) for pattern in MODEL_FILES))


def check_new_output(out: Path) -> None:
    """An export's output must not mix with files already there: a directory that holds model files
    (see ``MODEL_FILES``), or a ``.safetensors`` file that exists (or a single file written beside an
    index), is refused. Nothing is deleted: the user's files stay as they are."""
    if out.suffix == ".safetensors":
        if out.exists():
            raise CheckpointError(f"{out} already exists; choose a new file name or delete it first")
        if out.name == SINGLE_FILE and (out.parent / INDEX_FILE).exists():
            raise CheckpointError(f"{out.parent} already holds {INDEX_FILE}, which readers would take "
                                  f"instead of the new {SINGLE_FILE}; choose a new directory or empty it")
        return
    check_new_directory(out)


def check_new_directory(out: Path) -> None:
    """An export's output directory: refused if it holds model files (``MODEL_FILES``) already, or
    is a checkpoint (its rng-rank*.pt are no model files)."""
    if (out / DCP_METADATA_FILE).is_file() or (out / STATE_FILE).is_file():
        raise CheckpointError(f"output directory {out} is a checkpoint, whose files the export's would be "
                              "mixed with; choose a new directory")
    if found := model_files(out):
        listed = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise CheckpointError(f"output directory {out} already holds model files ({listed}) that would "
                              "be mixed with the new ones; choose a new directory or empty it")


def check_one_layout(directory: Path) -> None:
    """A single file beside an index of other shards: transformers loads the file, shardtrain's
    readers the index's shards, so which weights a reader gets depends on the reader. (An index of
    the single file alone, as a one-shard export writes, names the same weights.)"""
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.is_file() and index.is_file() and indexed_files(index) != [single]:
        raise CheckpointError(f"{directory} holds both {SINGLE_FILE} and an {INDEX_FILE} of other "
                              "shards: transformers loads the first, other readers the second; write "
                              "the export to a new directory")


@contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """``safe_open`` of a weight file; one that is damaged, truncated or not safetensors at all (its
    header is checked against the file's length here) is one line naming it."""
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises several types for a bad header
        raise CheckpointError(f"{path} is not a readable safetensors file ({first_line(exc)}); write "
                              "it again (consolidate or export the checkpoint anew) or point at another"
                              ) from exc
    with handle as f:
        yield f


def file_metadata(path: Path) -> dict[str, str]:
    with open_safetensors(path) as f:
        return f.metadata() or {}
