"""Autoregressive generation from a sharded model, under every strategy, FULL_SHARD included.

AudioCraft forbids FULL_SHARD because each token's forward would all-gather every weight again.
Here, by default, the weights are gathered once into a plain (unsharded) copy of the model in the
parameter dtype, generation runs on that copy with a KV cache and no collectives at all, and the copy
is freed afterwards: the sharded model and its FSDP settings are never touched, so training can go
on right after (sampling during training). Every rank runs the same loop with the same seed and so
produces the same tokens.

When the gathered copy would not fit the device (``generation_mode``), ``generate`` runs the sharded
model itself unit by unit (``sharded_inference``): each unit is all-gathered for its forward and
freed after it (the head and the last block too, which training keeps), with the next block
prefetched, so a rank holds about two units at a time; the cost
is one all-gather per unit per new token (docs/generation.md measures it).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from shardtrain.accelerator import free_memory_bytes, is_out_of_memory
from shardtrain.config.sizes import human_bytes
from shardtrain.data.tokenizer import Tokenizer
from shardtrain.distributed.parallelize import reshard_all
from shardtrain.distributed.qlora import full_value
from shardtrain.errors import GenerationError, first_line
from shardtrain.tasks.language_model import embedding_rows

GENERATION_MODES = ("auto", "gathered", "sharded")
# The gathered copy and the KV cache must leave this share of the free memory for activations and
# whatever else the process allocates meanwhile.
GATHER_HEADROOM = 0.8


@dataclass
class ModeChoice:
    mode: str  # "gathered" or "sharded"
    gathered_bytes: int  # the plain copy's parameters in the generation dtype
    free_bytes: int | None  # the least free memory of any rank (None: unknown)
    asked: bool = False  # the mode was asked for, not chosen by the memory
    cache_bytes: int = 0  # the KV cache of the longest generation, beside the copy

    def cache_fits_nowhere(self) -> bool:
        """Whether the KV cache alone passes the headroom: every rank holds the whole cache in
        either mode (sharding splits the weights, not the cache)."""
        return self.free_bytes is not None and self.cache_bytes > GATHER_HEADROOM * self.free_bytes

    def reason(self) -> str:
        free = "unknown" if self.free_bytes is None else human_bytes(self.free_bytes)
        cache = f" and its KV cache {human_bytes(self.cache_bytes)}" if self.cache_bytes else ""
        memory = f"the gathered model needs {human_bytes(self.gathered_bytes)}{cache}, {free} is free"
        return f"as asked; {memory}" if self.asked else memory


def kv_cache_bytes(model: nn.Module, positions: int, dtype: torch.dtype) -> int:
    """The keys and values one sequence of ``positions`` tokens keeps at every layer (a hybrid's
    layers without attention counted as attention's: an upper bound); 0 for a model whose sizes
    are not known (a task's own module without ``dims``)."""
    dims = getattr(model, "dims", None)
    if dims is None or positions <= 0:
        return 0
    return 2 * dims.n_layers * dims.n_kv_heads * dims.head_dim * positions * dtype.itemsize


def generation_mode(model: nn.Module, dtype: torch.dtype, device: torch.device,
                    requested: str = "auto", local_processes: int = 1, positions: int = 0) -> ModeChoice:
    """``gathered`` when the plain copy and the KV cache of a generation of ``positions`` tokens
    fit the free memory of every rank with room to spare, else ``sharded``; every rank gets the same
    answer (the least free memory of any rank). On a CPU the ``local_processes`` of a machine each
    build their copy in its one memory: a share each. The cache counts (found by review: a long
    generation's, gigabytes at 100k positions, was left to the 20% headroom)."""
    if requested not in GENERATION_MODES:
        raise GenerationError(f"generation mode {requested!r} is not one of {', '.join(GENERATION_MODES)}")
    need = sum(p.numel() for p in model.parameters()) * dtype.itemsize  # tied weights once
    # (a prompt past the model's positions is refused before its generation, not counted)
    cache = kv_cache_bytes(model, min(positions, getattr(model, "max_seq_len", None) or positions), dtype)
    free = free_memory_bytes(device)
    if free is not None and device.type == "cpu":
        free //= max(local_processes, 1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        # The least known: a rank that cannot tell (its -1) decided for all where it was the minimum
        # (found by review), so an unknown is the largest value instead, and all unknown is None
        unknown = torch.iinfo(torch.int64).max
        least = torch.tensor([free if free is not None else unknown], dtype=torch.int64,
                             device=device if dist.get_backend() != "gloo" else "cpu")
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        free = int(least.item()) if int(least.item()) != unknown else None
    if requested != "auto":
        return ModeChoice(requested, need, free, asked=True, cache_bytes=cache)
    fits = free is None or need + cache <= GATHER_HEADROOM * free
    return ModeChoice("gathered" if fits else "sharded", need, free, cache_bytes=cache)


@contextmanager
def out_of_memory_explained(mode: str) -> Iterator[None]:
    """A generation that runs out of memory (an accelerator's, or the CPU allocator's refusal) says
    what to change, as one line (the split path of ``generate --devices N`` said it as exit 2, the
    others as a traceback)."""
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        smaller = "fewer --max-new-tokens or a shorter prompt (the KV cache), or more devices (--devices N)"
        fix = (f"--mode sharded (a rank then holds about two units of the model), {smaller}"
               if mode == "gathered" else smaller)
        raise GenerationError(
            f"out of memory generating ({first_line(exc)}) in mode {mode}; use {fix}") from exc


@contextmanager
def sharded_inference(model: nn.Module) -> Iterator[nn.Module]:
    """The sharded model itself, ready for generation: in eval mode (each block prefetches the next
    one's all-gather during its own forward, as ``parallelize`` set it up for training), every unit
    resharded after its forward; resharded and its mode restored afterwards.

    Units training keeps gathered after forward for the backward that follows (every unit under
    SHARD_GRAD_OP, the head and last block under FULL_SHARD) stayed gathered from the first token
    on: a rank held about the whole model, more than the gathered copy this mode is chosen to avoid
    (found by review). No backward follows here, so each is freed after its forward; their setting
    is not restored (FSDP takes a bool, training's may be a group size): the model is generation's
    from now on."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_reshard_after_forward(True, recurse=False)
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        reshard_all(model)
        model.train(was_training)


@torch.no_grad()
def gathered_copy(model: nn.Module, factory: Callable[[], nn.Module], device: torch.device,
                  dtype: torch.dtype) -> nn.Module:
    """An unsharded copy of ``model`` with its parameters in ``dtype``: one all-gather per parameter,
    then none.

    The copy is allocated in ``dtype`` from the start (built on the meta device, parameters cast
    there), and parameters are gathered one at a time: the peak is the copy plus one gathered
    parameter, never a full-precision copy of the model. Buffers (RoPE tables and the like) are
    copied from the sharded model, which holds them whole, in their own dtype.
    """
    with torch.device("meta"):
        plain = factory()
    for param in plain.parameters():
        param.data = param.data.to(dtype)
    shared = shared_parameter_names(plain)
    plain.to_empty(device=device)
    for names in shared:  # to_empty gives each module its own new Parameter: tie them again
        tied = plain.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(plain.get_submodule(owner), attr, tied)
    for name, param in model.named_parameters():
        full = full_value(param)  # QLoRA's NF4 base dequantised
        plain.get_parameter(name).copy_(full)
        del full
    for name, buffer in model.named_buffers():
        plain.get_buffer(name).copy_(buffer)
    return plain.eval()


def shared_parameter_names(model: nn.Module) -> list[list[str]]:
    """Names of each parameter registered under several names (tied embeddings)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def pick_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
              generator: torch.Generator) -> torch.Tensor:
    """Greedy when temperature is 0; else sampling from the top-k (0 = all), top-p (1 = all) tokens."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    # Shifted to a maximum of 0 first: a tiny temperature then sends the others to -inf, where
    # dividing the raw logits overflowed to inf and the softmax to NaN. One below fp32's smallest
    # normal would be 0 in the division (the top logit's 0 / 0 a NaN): fp32's smallest it is.
    logits = logits.float()
    temperature = max(temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.max(-1, keepdim=True).values) / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first one always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1).cpu()
    return torch.multinomial(probs, 1, generator=generator).to(logits.device)


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """``text``'s token ids; for an empty prompt, where a document starts in the training data: after
    the tokenizer's end-of-text token, or, for a tokenizer without one (documents concatenated as
    they are), at a new line."""
    ids = tokenizer.encode(text)
    if ids:
        return ids
    return [tokenizer.eos_id] if tokenizer.eos_id is not None else tokenizer.encode("\n")


def positions_needed(prompt_tokens: int, max_new_tokens: int) -> int:
    """The positions a generation shows the model: the prompt and every new token but the last, which
    is never fed back. The same limit with and without the cache (without it, a window once slid past
    it)."""
    return prompt_tokens + max(max_new_tokens - 1, 0)


def check_prompt(model: nn.Module, prompt: list[int], max_new_tokens: int) -> int:
    """The positions a generation of ``prompt`` needs (``positions_needed``), refused where the model
    has fewer; a token id past the model's embedding (a tokenizer that is not the model's: an index
    error on a CPU, a device-side assert on a GPU) refused too."""
    rows = embedding_rows(model)
    if rows is not None and prompt and max(prompt) >= rows:
        raise GenerationError(f"the prompt holds token id {max(prompt)} and the model embeds {rows} ids: "
                              "the tokenizer is not this model's (its model.tokenizer, or the "
                              "tokenizer.json of its Hugging Face directory)")
    positions = positions_needed(len(prompt), max_new_tokens)
    max_len = getattr(model, "max_seq_len", None)
    if max_len is not None and len(prompt) > max_len:
        raise GenerationError(f"the prompt ({len(prompt)} tokens) is longer than the model's {max_len} "
                              "positions; shorten it")
    if max_len is not None and positions > max_len:
        raise GenerationError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) "
                              f"exceeds the model's {max_len} positions; ask for fewer new tokens")
    return positions


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, use_cache: bool = True,
             vocab_limit: int | None = None, on_token: Callable[[int], None] | None = None,
             device: torch.device | None = None, stop_tokens: Collection[int] = (),
             rank0_tokens: bool = False) -> list[int]:
    """New token ids after ``prompt`` from a plain model (see ``gathered_copy``); ends early at one
    of ``stop_tokens`` (a tokenizer's ``stop_ids``: its end of text, an end of turn), which is not
    returned. ``rank0_tokens``: every rank
    takes rank 0's token (a sharded model, whose every forward is a collective: a rank whose logits
    differ in the last bit at a near-tie, from a kernel that accumulates in another order, would
    otherwise stop or continue alone)."""
    device = device or next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    if not prompt:
        raise GenerationError("an empty prompt: give at least one token (prompt_ids gives a tokenizer's "
                              "start of a document for empty text)")
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    positions = check_prompt(model, prompt, max_new_tokens)
    cache = None
    if use_cache and hasattr(model, "new_cache"):
        cache = model.new_cache(positions)
    out: list[int] = []
    step_input = tokens
    for _ in range(max_new_tokens):
        if cache is not None:
            logits = model(step_input, cache=cache)[:, -1, :]
        else:
            logits = model(tokens)[:, -1, :]
        if vocab_limit is not None:
            logits = logits[:, :vocab_limit]
        if not torch.isfinite(logits).all():
            # Greedy picked token 0 at every step, sampling raised torch's "probability tensor
            # contains either inf, nan" (found by review); every rank of a sharded model sees them
            raise GenerationError(f"the model's logits are not finite after {len(out)} new token(s) (NaN or "
                                  "inf: weights holding them, or activations that overflowed the compute "
                                  "dtype); check the checkpoint (shardtrain inspect), or generate in fp32 "
                                  "(--dtype fp32)")
        nxt = pick_next(logits, temperature, top_k, top_p, generator)
        if rank0_tokens and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(nxt, src=0)
        if int(nxt) in stop_tokens:
            break
        tokens = torch.cat([tokens, nxt], dim=1)
        step_input = nxt
        out.append(int(nxt))
        if on_token is not None:
            on_token(int(nxt))
    return out
