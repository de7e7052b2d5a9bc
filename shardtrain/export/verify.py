"""The export's self-check: the written directory, loaded by transformers, must give the checkpoint's
logits. Peers' users report exports that load and then compute something else (a permuted q/k, a
dropped tie, a wrong norm epsilon); ``export-hf`` runs this after writing unless ``--no-verify``.

Neither model is ever whole in memory. Both are built with their parameters on the meta device and
run on the same batch block by block: each block's weights (or a module's outside the blocks) are
read just before its forward (transformers' model from the written files, through transformers'
renaming rules as ``from_pretrained`` applies them; ours from the checkpoint) and dropped right after
it. Host memory is about the largest block's weights, not the model twice in fp32 (560 GB for a 70B
model).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shardtrain.checkpoint.safetensors_files import check_one_layout, weight_files
from shardtrain.checkpoint.weights import model_config_of
from shardtrain.config.schema import ModelConfig
from shardtrain.distributed.sharded_model import parameters_on_meta
from shardtrain.errors import CheckpointError
from shardtrain.export.consolidate import Cast, load_tensors, plan_shards
from shardtrain.models.hf import ExpertPart, HFCausalLM
from shardtrain.models.hf_directory import CONFIG_FILE, PREFIX
from shardtrain.models.registry import build_model

# Largest |logit difference| relative to the largest |logit|: fp32 implementations of the same
# model agree to ~1e-6; a single corrupted weight is off by orders of magnitude more.
EXPORT_TOLERANCE = 1e-4

# Every name of one parameter (a tied weight has several) -> its value, read from disk.
Reader = Callable[[list[str]], torch.Tensor]


@torch.no_grad()
def verify_export(checkpoint: str | Path, out_dir: str | Path,
                  tolerance: float = EXPORT_TOLERANCE, key: str | None = None) -> float:
    """Compare the export's logits with the checkpoint's model on a fixed batch; return the largest
    relative difference, or raise naming it. Both sides hold the same weights rounded to the dtype
    the export was written in, and compute in fp32, so only a wrong conversion tells them apart.
    ``key``: the checkpoint's entry that was exported (``ema``: the weights' average)."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    cfg = model_config_of(checkpoint)
    with parameters_on_meta():
        ours = build_model(cfg)
        theirs = HFCausalLM(ModelConfig(name="hf", path=str(out_dir)))  # from_pretrained's model
    cast = written_cast(theirs, out_dir)
    tokens = check_tokens(ours)

    def rounded(names: list[str]) -> torch.Tensor:
        weight = read(names)
        return weight.to(cast.of(names[0], weight.dtype)).float()

    with checkpoint_reader(checkpoint, key) as read:
        want = streamed_forward(ours, tokens, rounded)
    read = export_reader(out_dir, theirs)
    got = streamed_forward(theirs, tokens, lambda names: read(names).float())
    return compare_logits(want, got, f"{out_dir} loaded by transformers", tolerance)


def written_cast(theirs: HFCausalLM, out_dir: Path) -> Cast:
    """The cast the export into ``out_dir`` made: to the dtype its config.json names, but for what
    the family of ``theirs`` (the model transformers builds from it) keeps in fp32."""
    written = getattr(torch, json.loads((out_dir / CONFIG_FILE).read_bytes())["torch_dtype"])
    return Cast(written, theirs.kept_in_fp32(written))


def check_tokens(model: nn.Module) -> torch.Tensor:
    """The fixed batch every export check runs: 2 sequences of up to 32 seeded tokens."""
    # (a family without a position limit, Bloom's ALiBi, has max_seq_len None: a TypeError, found by review)
    return torch.randint(0, model.dims.vocab_size, (2, min(32, model.max_seq_len or 32)),
                         generator=torch.Generator().manual_seed(0))


def compare_logits(want: torch.Tensor, got: torch.Tensor, loaded: str,
                   tolerance: float = EXPORT_TOLERANCE) -> float:
    """The largest |logit difference| relative to the largest |logit| of ``want``; a CheckpointError
    past ``tolerance`` naming ``loaded`` (what was read back, and by what)."""
    difference = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    if not difference <= tolerance:  # NaN fails too
        raise CheckpointError(
            f"export check failed: {loaded} gives logits that differ from the checkpoint's by "
            f"{difference:.2e} (relative; limit {tolerance:.0e}): the written files do not reproduce "
            "the model")
    return difference


def streamed_forward(model: nn.Module, tokens: torch.Tensor, read: Reader) -> torch.Tensor:
    """``model(tokens)`` in eval mode, its weights read unit by unit just before the unit's forward
    and given back to the meta device right after it. A unit is a block (``model.block_classes``)
    with everything inside it, or any other module with parameters of its own: a block's modules
    may read a child's weight without calling the child (Jamba's Mamba mixer reads its ``dt_proj``
    and ``conv1d`` weights; found by review: they were still on meta, and the export was deleted).
    A unit's persistent buffers are read too where the files hold them, else keep what the model's
    construction made, as from_pretrained leaves them (found by review: a router's score-correction
    bias, never read, was the constructed zeros on both sides, and a merge that dropped it passed)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(buffer), []).append(name)
    blocks = tuple(getattr(model, "block_classes", ()))
    inside_blocks: set[int] = set()
    handles = []
    for module in model.modules():  # a block comes before the modules inside it
        if id(module) in inside_blocks:
            continue
        members = list(module.modules()) if blocks and isinstance(module, blocks) else [module]
        inside_blocks.update(id(member) for member in members[1:])
        held = [(member, attr, param) for member in members
                for attr, param in member._parameters.items() if param is not None]
        buffers = [(member, attr, buffer) for member in members for attr, buffer in member._buffers.items()
                   if buffer is not None and attr not in member._non_persistent_buffers_set]
        if not held and not buffers:
            continue

        def load(module: nn.Module, args, held=held, buffers=buffers) -> None:
            for member, attr, param in held:
                member._parameters[attr] = nn.Parameter(read(names[id(param)]), requires_grad=False)
            for member, attr, buffer in buffers:
                with suppress(CheckpointError):  # not stored: as constructed
                    member._buffers[attr] = read(names[id(buffer)]).to(buffer.dtype)

        def drop(module: nn.Module, args, output, held=held, buffers=buffers) -> None:
            for member, attr, param in held:
                member._parameters[attr] = param
            for member, attr, buffer in buffers:
                member._buffers[attr] = buffer

        handles += [module.register_forward_pre_hook(load), module.register_forward_hook(drop)]
    try:
        return model.eval()(tokens)
    finally:
        for handle in handles:
            handle.remove()


def first_stored(names: list[str], stored, missing: str) -> str:
    """The first of a parameter's names that ``stored`` holds; else an error saying ``missing``."""
    for name in names:
        if name in stored:
            return name
    raise CheckpointError(missing.format(names[0]))


@contextmanager
def checkpoint_reader(checkpoint: Path, key: str | None = None) -> Iterator[Reader]:
    """Our parameters one at a time from a consolidated file or a DCP checkpoint (its entry ``key``,
    as consolidate reads it)."""
    missing = f"{checkpoint} holds no {{}}: it is not a checkpoint of the model it describes"
    if checkpoint.is_file():
        with safe_open(str(checkpoint), framework="pt") as f:
            stored = set(f.keys())
        yield lambda names: read_one(checkpoint, first_stored(names, stored, missing))
        return
    plan = plan_shards(checkpoint, None, Cast(), key)
    entries = {entry[1]: entry for shard in plan.shards for entry in shard}

    def read(names: list[str]) -> torch.Tensor:
        entry = entries[first_stored(names, entries, missing)]
        return load_tensors(checkpoint, [entry], plan.metadata)[entry[0]]

    yield read


def export_reader(out_dir: Path, model: HFCausalLM) -> Reader:
    """transformers' parameters one at a time from the written files, found under the names
    ``model.parameter_name`` gives the stored ones; a MoE's stacked experts put together from each
    expert's stored tensors (``model.expert_part``), as from_pretrained does."""
    try:  # the files read here must be the ones transformers loads
        check_one_layout(out_dir)
    except CheckpointError as exc:
        raise CheckpointError(f"export check failed: {exc}") from exc
    stored: dict[str, tuple[Path, str]] = {}
    experts: dict[str, list[tuple[ExpertPart, Path, str]]] = {}
    for file in weight_files(out_dir):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if (part := model.expert_part(key)) is not None:
                    experts.setdefault(part.name, []).append((part, file, key))
                else:
                    stored[model.parameter_name(key)] = (file, key)
    missing = (f"export check failed: {out_dir} holds no weight for {{}} (transformers would draw it "
               "at random); export again")

    shapes = {name: param.shape for name, param in model.named_parameters()}

    def read(names: list[str]) -> torch.Tensor:
        name = first_stored(names, stored.keys() | experts.keys(), missing)
        if name not in experts:
            return read_one(*stored[name])
        return stacked(experts[name], shapes[name][0], f"export check failed: {out_dir} lacks expert {{}} of "
                       f"{name.removeprefix(PREFIX)} (transformers would draw it at random); export again")

    return read


def stacked(parts: list[tuple[ExpertPart, Path, str]], count: int, missing: str) -> torch.Tensor:
    """A parameter stacking ``count`` experts (``[experts, rows, ...]``), from each expert's stored
    tensors: expert e's part p fills rows ``p * rows .. (p + 1) * rows`` of ``[e]``; an expert or
    part not stored is ``missing`` (formatted with the expert's number)."""
    pieces = {(part.expert, part.part): (file, key) for part, file, key in parts}
    per_expert = parts[0][0].parts
    absent = [e for e in range(count) for p in range(per_expert) if (e, p) not in pieces]
    if absent:
        raise CheckpointError(missing.format(absent[0]))
    return torch.stack([torch.cat([read_one(*pieces[e, p]) for p in range(per_expert)])
                        for e in range(count)])


def read_one(file: Path, key: str) -> torch.Tensor:
    # Opened for each tensor: an open file stays memory-mapped, and every page read through it
    # would count against the process until it is closed, adding up to the whole file.
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(key)
