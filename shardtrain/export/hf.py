"""``shardtrain export-hf``: a shardtrain checkpoint as a Hugging Face model directory.

Streams one consolidated shard at a time and converts tensor by tensor. The built-in Llama goes
through its state-dict adapter (``models/llama_hf_adapter.py``) into a ``LlamaForCausalLM``; a
``model.name=hf`` model already has transformers' names (under ``hf.``) and gets its own directory's
config.json, generation config and tokenizer files back. An output directory that already holds
model files is refused, never written into. The self-check after writing loads the directory with
transformers (``export/verify.py``). Importing goes the other way through
``model.init_from=hf:<dir>`` (built-in Llama) or ``model.name=hf`` (``checkpoint/weights.py``).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    PrefixChange,
    WeightConverter,
    WeightRenaming,
    revert_weight_conversion,
)

from shardtrain.checkpoint.safetensors_files import DTYPES as SAFETENSORS_DTYPES
from shardtrain.checkpoint.safetensors_files import (
    check_new_directory,
    open_safetensors,
    remove_written,
    save_shard,
    shard_name,
    unshared,
    write_index,
)
from shardtrain.checkpoint.weights import model_config_of, tokenizer_of
from shardtrain.config.plan import dtype_name
from shardtrain.config.schema import ModelConfig
from shardtrain.config.sizes import parse_size
from shardtrain.data.tokenizer import (
    GENERATION_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    TOKENIZER_FILES,
    byte_level_tokenizer,
    check_recorded_tokenizer,
    load_tokenizer,
    tokenizer_source,
)
from shardtrain.errors import CheckpointError
from shardtrain.export.consolidate import Cast, shard_readers, written_dtype
from shardtrain.generation.generate import shared_parameter_names
from shardtrain.models.hf import stacks_experts
from shardtrain.models.hf_directory import CONFIG_FILE, hf_name, model_directory
from shardtrain.models.llama_hf_adapter import hf_config, to_hf
from shardtrain.models.registry import build_model

Converter = Callable[[str, torch.Tensor], "tuple[str, torch.Tensor] | None"]


Layout = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Conversion:
    """How a model's weights, under our names, become a Hugging Face directory's: ``convert`` renames
    each (None: a tied weight's second name, dropped), ``cast`` gives its written dtype, ``layout``
    gives a shard's tensors the stored layout. Made once an export: a ``model.name=hf`` model's is
    read from the model built on the meta device (built four times an export before)."""

    cfg: ModelConfig
    cast: Cast
    convert: Converter
    layout: Layout
    # The model's state, by our names, a tied weight's first name only: what a whole model's file holds.
    names: frozenset[str]


def hf_conversion(cfg: ModelConfig, dtype: str | None = None) -> Conversion:
    """The conversion of the model ``cfg`` describes, its floating-point weights written in ``dtype``
    (``--dtype``; None: as stored). The built-in Llama goes through its state-dict adapter. A
    Hugging Face model keeps transformers' names, a tied weight once, under its first name
    (from_pretrained ties it), in the stored layout: transformers' renamings and its stacking of
    experts reverted, as its save_pretrained writes (a MoE's experts one by one under the
    checkpoint's names: the stacked layout was transformers v5's in-memory one, which other readers
    of model directories do not know). Only what shardtrain reads back (``stacks_experts``): another
    conversion (a family's split convolutions, fused projections) is written as held in memory,
    which transformers and shardtrain load, and a reverted merge could need tensors of two shards.
    What the family keeps in fp32 is written as stored (``HFCausalLM.kept_in_fp32``)."""
    written = written_dtype(dtype)
    with torch.device("meta"):
        model = build_model(cfg)
    dropped = {name for names in shared_parameter_names(model) for name in names[1:]}
    names = frozenset(name for name in model.state_dict() if name not in dropped)
    if cfg.name != "hf":
        return Conversion(cfg, Cast(written), lambda name, tensor: to_hf(name, tensor, cfg), dict, names)
    model.hf._weight_conversions = [
        rule for rule in get_model_conversion_mapping(model.hf, add_legacy=False)
        if not isinstance(rule, PrefixChange) and (
            isinstance(rule, WeightRenaming) or isinstance(rule, WeightConverter) and stacks_experts(rule))]

    def convert(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        return None if name in dropped else (hf_name(name), tensor)

    return Conversion(cfg, Cast(written, model.kept_in_fp32(written)), convert,
                      lambda tensors: dict(revert_weight_conversion(model.hf, tensors)), names)


def write_hf_model_files(cfg: ModelConfig, out: Path, dtype: torch.dtype) -> list[Path]:
    """The run's tokenizer (the model directory's, or the one ``model.tokenizer`` put in its place),
    then the model directory's config.json (with the written dtype), last. A replaced tokenizer's
    special ids go into config.json and generation_config.json in the base's place: the base's are
    ids of another vocabulary, another token in this one (found by review: transformers' generate
    stopped at whatever the base's end-of-text id now encodes, or ran past the run's)."""
    source = model_directory(cfg)
    config = json.loads((source / CONFIG_FILE).read_bytes())
    config["torch_dtype"] = config["dtype"] = dtype_name(dtype)
    files = write_tokenizer_files(cfg, out, config.get("max_position_embeddings", cfg.max_seq_len))
    if cfg.tokenizer != "auto":  # the base model's would encode text into other ids than the run trained on
        tokenizer = load_tokenizer(tokenizer_source(cfg))
        ids = {"bos_token_id": getattr(tokenizer, "bos_id", None), "pad_token_id": None}
        config |= ids | {"eos_token_id": tokenizer.eos_id}
        # A multimodal model's language model reads its own (Llama 4's, Mllama's text_config)
        if isinstance(config.get("text_config"), dict):
            config["text_config"] |= ids | {"eos_token_id": tokenizer.eos_id}
        # The sampling defaults are the model's; the stop ids the run's (its end of text, and the
        # end of turn a generation_config.json beside its tokenizer names).
        if (generation := source / GENERATION_CONFIG_FILE).is_file():
            stops = sorted(tokenizer.stop_ids)
            settings = model_settings(generation) | ids | {
                "eos_token_id": stops[0] if len(stops) == 1 else stops or None}
            (out / GENERATION_CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n")
            files = sorted({*files, out / GENERATION_CONFIG_FILE})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return files + [out / CONFIG_FILE]


def model_settings(file: Path) -> dict:
    """The settings a JSON file of the model's directory holds, one line where it does not parse."""
    try:
        settings = json.loads(file.read_bytes())
    except ValueError as exc:
        raise CheckpointError(f"{file} is not readable JSON ({exc}); mend it, or remove it") from exc
    if not isinstance(settings, dict):
        raise CheckpointError(f"{file} holds a {type(settings).__name__}, not settings; mend it, or "
                              "remove it")
    return settings


def tokenizer_files_in(directory: Path) -> dict[str, Path]:
    """The tokenizer files a model directory holds, by name."""
    return {name: directory / name for name in TOKENIZER_FILES if (directory / name).is_file()}


def copy_files(copies: dict[str, Path], out: Path) -> list[Path]:
    """Each source copied into ``out`` under its name; the written paths."""
    for name, source in copies.items():
        shutil.copyfile(source, out / name)
    return [out / name for name in copies]


def export_hf(checkpoint: str | Path, out_dir: str | Path, max_shard_size: str = "2GB",
              dtype: str | None = None, key: str | None = None, verify_checksums: bool = True) -> list[Path]:
    """A transformers-loadable directory from a shardtrain checkpoint (or its safetensors).
    ``key``: the checkpoint's entry to export (``ema``: the weights' average; default the model)."""
    src, out = Path(checkpoint), Path(out_dir)
    cfg = model_config_of(src)
    if key is not None and src.is_file():
        raise CheckpointError(f"{src} is a consolidated file, which holds one set of weights: the weights' "
                              "average (--ema) is exported from a checkpoint directory")
    check_new_directory(out)  # before the consolidation's work, not after it
    # A tokenizer, or a Hugging Face model's directory, gone since training: said before the
    # consolidation's work, not after it.
    if cfg.name == "hf":
        model_directory(cfg)
    tokenizer_copies(cfg)
    # the tokenizer written beside the weights is the run's
    check_recorded_tokenizer(tokenizer_of(src), load_tokenizer(tokenizer_source(cfg)), str(src))
    conversion = hf_conversion(cfg, dtype)
    # Streamed: each output shard's tensors read (from the checkpoint, or the file) when it is
    # written, renamed, permuted and cast tensor by tensor; one shard in memory, no staged copy.
    if src.is_file():
        check_whole_model_file(src, conversion.names)
        parts = [partial(read_part, src, names) for names in file_parts(src, max_shard_size, conversion.cast)]
    else:
        parts = shard_readers(src, max_shard_size, dtype, key, verify_checksums, conversion.cast)
    return write_hf_directory(conversion, out, parts, max_shard_size)


def shard_parts(sizes: dict[str, int], max_shard_size: str | None) -> list[list[str]]:
    """The names in each output shard, given each tensor's bytes as written: in order, each shard
    at most ``max_shard_size`` bytes (a tensor larger than that alone in its shard)."""
    limit = parse_size(max_shard_size, "--max-shard-size") if max_shard_size else None
    parts: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if limit and parts[-1] and size + nbytes > limit:
            parts.append([])
            size = 0
        parts[-1].append(name)
        size += nbytes
    return parts


def check_whole_model_file(path: Path, names: frozenset[str]) -> None:
    """A consolidated file holds every tensor ``names`` (``Conversion.names``) of the model it
    describes: each shard of a sharded consolidation names the model too, and one was exported as
    the whole model (found by review: with --no-verify transformers drew the rest at random)."""
    with open_safetensors(path) as f:
        stored = set(f.keys())
    missing = sorted(names - stored)
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} of the model's tensors ({missing[0]}, ...): one "
                              "file of a sharded consolidation? export the checkpoint directory, or "
                              "consolidate it into one .safetensors file")


def file_parts(path: Path, max_shard_size: str | None, cast: Cast) -> list[list[str]]:
    """``shard_parts`` of a safetensors file's tensors, sized from its header (nothing loaded)."""
    sizes = {}
    with open_safetensors(path) as f:
        for name in f.keys():
            piece = f.get_slice(name)
            stored = SAFETENSORS_DTYPES[piece.get_dtype()]
            sizes[name] = math.prod(piece.get_shape()) * cast.of(name, stored).itemsize
    return shard_parts(sizes, max_shard_size)


def read_part(path: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of a safetensors file (default: all of them)."""
    with open_safetensors(path) as f:
        return {name: f.get_tensor(name) for name in (f.keys() if names is None else names)}


def write_hf_directory(conversion: Conversion, out: Path,
                       parts: Sequence[Callable[[], dict[str, torch.Tensor]]],
                       max_shard_size: str | None = None) -> list[Path]:
    """The Hugging Face directory of a model whose weights, under our names, each of ``parts`` reads:
    one output shard per part, read only when written (one in memory), converted (renamed, permuted,
    cast) tensor by tensor. config.json comes last, so that a directory without it is unfinished to
    every reader; a failure removes every file this call wrote (a full disk left the weights, the
    index and config.json: a model to transformers, without its tokenizer)."""
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)  # new or without model files: its callers checked first
    before = set(out.iterdir())
    try:
        return write_hf_files(conversion, out, parts, max_shard_size)
    except BaseException:
        remove_written(out, set(out.iterdir()) - before, made)
        raise



def write_hf_files(conversion: Conversion, out: Path, parts: Sequence[Callable[[], dict[str, torch.Tensor]]],
                   max_shard_size: str | None = None) -> list[Path]:
    """``write_hf_directory``'s files: the shards, the index, the tokenizer, config.json."""
    cfg, cast = conversion.cfg, conversion.cast
    written: list[tuple[Path, list[str]]] = []  # each shard under a staging name, its tensors' names
    total = 0
    out_dtype = None
    for read in parts:
        part = read()
        tensors = {}
        for name in list(part):
            converted = conversion.convert(name, part.pop(name))
            if converted is None:
                continue
            hf_name, t = converted
            t = cast.apply(hf_name, t).contiguous()
            # the config's dtype is the weights', not an integer buffer's nor one kept in fp32
            if t.is_floating_point() and not cast.keeps(hf_name):
                out_dtype = t.dtype
            tensors[hf_name] = t
        stored = conversion.layout(tensors)
        # A stacked tensor written one expert a tensor: its pieces split into shards of the limit
        # again, each copied out of the storage they share (safetensors refuses shared storage in
        # one file) only as its shard is written.
        sizes = {name: t.numel() * t.element_size() for name, t in stored.items()}
        for names in shard_parts(sizes, max_shard_size) if stored else []:
            # a part of dropped names only (a tied head's second name) makes no shard
            shard = unshared({name: stored.pop(name) for name in names})
            staged = out / f".shard-{len(written) + 1}.staging"
            save_shard(shard, staged, {"format": "pt"})
            written.append((staged, list(shard)))
            total += sum(t.numel() * t.element_size() for t in shard.values())
            del shard
        del tensors, stored, part
    # Named once their number is known: "-of-N" counts the shards written.
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for index, (staged, names) in enumerate(written, start=1):
        name = shard_name(index, len(written))
        staged.rename(out / name)
        files.append(out / name)
        weight_map.update(dict.fromkeys(names, name))
    files.append(write_index(out, weight_map, total))
    if cfg.name == "hf":
        return files + write_hf_model_files(cfg, out, out_dtype or torch.float32)
    files += write_tokenizer_files(cfg, out, cfg.max_seq_len)
    config = hf_config(cfg, out_dtype or torch.float32) | special_token_ids(cfg)
    config_file = out / CONFIG_FILE
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return files + [config_file]


def special_token_ids(cfg: ModelConfig) -> dict[str, int]:
    """The run's tokenizer's beginning- and end-of-text ids, for config.json (none for the byte
    tokenizer, which has neither): left null, transformers' generate never stopped at the end of
    text (found by review)."""
    tokenizer = load_tokenizer(tokenizer_source(cfg))
    ids = {"bos_token_id": getattr(tokenizer, "bos_id", None), "eos_token_id": tokenizer.eos_id}
    return {key: value for key, value in ids.items() if value is not None}


def tokenizer_copies(cfg: ModelConfig) -> dict[str, Path] | None:
    """The files of the tokenizer ``model.tokenizer`` named, by the name each gets in a model
    directory; None for the byte tokenizer. One that is gone since training is one line."""
    source = tokenizer_source(cfg)
    if source == "bytes":
        return None
    path = Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(f"the run's tokenizer model.tokenizer={source!r} does not exist (moved since "
                              "training?); put it back, or link its new place there")
    copies = tokenizer_files_in(path if path.is_dir() else path.parent)
    if path.is_file():  # a tokenizer file named otherwise
        copies[TOKENIZER_FILE] = path
    if TOKENIZER_FILE not in copies:
        # (found by review: exported without one, exit 0; generate and eval of the export then refused)
        raise CheckpointError(f"the run's tokenizer {str(path / TOKENIZER_FILE)!r} does not exist (removed "
                              "since training?); put it back: the export writes it beside the weights")
    return copies


def tokenizer_max_length(cfg: ModelConfig) -> int:
    """The positions the model of ``cfg`` takes, as a written byte tokenizer's config names them."""
    if cfg.name != "hf":
        return cfg.max_seq_len
    config = json.loads((model_directory(cfg) / CONFIG_FILE).read_bytes())
    return config.get("max_position_embeddings", cfg.max_seq_len)


def write_tokenizer_files(cfg: ModelConfig, out: Path, max_length: int) -> list[Path]:
    """The run's tokenizer beside its weights, so that the directory is a whole model to
    transformers and to ``generate`` and ``eval`` (which read it as model=hf): the byte tokenizer as
    a ``tokenizer.json`` (for ``max_length`` positions), or the files of the tokenizer
    ``model.tokenizer`` named."""
    copies = tokenizer_copies(cfg)
    if copies is None:
        byte_level_tokenizer().save(str(out / TOKENIZER_FILE))
        # No tokenizer class of the model's: LlamaTokenizerFast would put a BOS token first.
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                    "clean_up_tokenization_spaces": False}
        (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n")
        return [out / TOKENIZER_FILE, out / TOKENIZER_CONFIG_FILE]
    return copy_files(copies, out)
