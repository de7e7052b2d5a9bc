"""The chunked linear + cross-entropy against the plain full-logits loss (``benchmarks/run.py --only
loss``): one process, the built-in Llama, a training step (forward, backward, fused AdamW).

``python benchmarks/loss_bench.py memory VOCAB DIM LAYERS SEQ BATCH LOSS``: in a fresh process, a
step's peak resident memory over what stays between steps (LOSS: ``plain``, ``chunked`` or
``recompute``, per-chunk recomputation with ``torch.utils.checkpoint``, the alternative design);
prints one JSON line.
``python benchmarks/loss_bench.py speed VOCAB DIM LAYERS SEQ BATCH ROUNDS``: tokens/s of each loss,
alternating step by step in one process (the machine's load falls on all alike); one JSON line.
``python benchmarks/loss_bench.py precision TOKENS DIM VOCAB``: the head and loss alone in bf16, plain
and chunked at several chunk sizes, against the same computed in fp32: the relative error of the
loss and of the hidden states' and head weight's gradients; one JSON line.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shardtrain.config.schema import ModelConfig
from shardtrain.data.batches import IGNORE_INDEX, Batch
from shardtrain.models.llama import Llama
from shardtrain.tasks.language_model import token_loss_sum
from shardtrain.tasks.losses import DEFAULT_CHUNK_TOKENS, chunked_cross_entropy

CHUNK = int(os.environ.get("LOSS_CHUNK_TOKENS", DEFAULT_CHUNK_TOKENS))

LOSSES = ("plain", "chunked", "recompute")


def recomputed_loss(model: Llama, batch: Batch, chunk_tokens: int) -> torch.Tensor:
    """The other design: each chunk's logits and loss under activation checkpointing, recomputed in
    backward (torchtune's chunked loss with checkpointing; the head matmul runs three times)."""
    hidden = model(batch.inputs, hidden_only=True).flatten(0, 1)
    weight = model.output_head().weight

    def chunk_loss(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, weight).float(), t, ignore_index=IGNORE_INDEX, reduction="sum")

    return sum(checkpoint(chunk_loss, h, t, use_reentrant=False)
               for h, t in zip(hidden.split(chunk_tokens), batch.targets.flatten().split(chunk_tokens),
                               strict=True))


def setup(vocab: int, dim: int, layers: int, seq: int, batch: int):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=max(dim // 64, 1),
                      n_kv_heads=max(dim // 128, 1), max_seq_len=seq)
    model = Llama(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    return model, optimizer, Batch(tokens[:, :-1], tokens[:, 1:])


def step(model: Llama, optimizer: torch.optim.Optimizer, batch: Batch, loss_kind: str) -> float:
    if loss_kind == "recompute":
        loss = recomputed_loss(model, batch, CHUNK)
    else:
        loss = token_loss_sum(model, batch, CHUNK if loss_kind == "chunked" else 0)
    (loss / batch.targets.numel()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def status_mib(field: str) -> float:
    """VmRSS (resident now) or VmHWM (its peak since the last reset) of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory(vocab: int, dim: int, layers: int, seq: int, batch: int, loss_kind: str) -> dict:
    """A step's peak over what stays between steps (weights and AdamW's state, made by a step on one
    short sequence first): Linux's peak resident size, reset just before the step (``clear_refs``).
    Run under ``MALLOC_MMAP_THRESHOLD_`` so that freed tensors leave the resident set at once."""
    model, optimizer, data = setup(vocab, dim, layers, seq, batch)
    step(model, optimizer, Batch(data.inputs[:1, :8], data.targets[:1, :8]), loss_kind)
    gc.collect()
    before = status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    step(model, optimizer, data, loss_kind)
    return {"loss": loss_kind, "vocab": vocab, "step_peak_mib": status_mib("VmHWM") - before,
            "resident_before_mib": before, "logits_fp32_mib": batch * seq * vocab * 4 / 2**20}


def speed(vocab: int, dim: int, layers: int, seq: int, batch: int, rounds: int) -> dict:
    model, optimizer, data = setup(vocab, dim, layers, seq, batch)
    seconds: dict[str, list[float]] = {kind: [] for kind in LOSSES}
    for kind in LOSSES:  # warm-up: first-call allocations, optimizer state
        step(model, optimizer, data, kind)
    for _ in range(rounds):
        for kind in LOSSES:
            start = time.perf_counter()
            step(model, optimizer, data, kind)
            seconds[kind].append(time.perf_counter() - start)
    tokens = batch * seq
    return {"vocab": vocab, "dim": dim, "layers": layers, "seq": seq, "batch": batch, "rounds": rounds,
            "threads": torch.get_num_threads(),
            "tokens_per_s": {kind: tokens / statistics.median(s) for kind, s in seconds.items()}}


def precision(tokens: int, dim: int, vocab: int) -> dict:
    """bf16 against fp32 for the plain loss and the chunked one: the chunked loss sums the head
    weight's gradient chunk by chunk in bf16, one rounding a chunk, where the plain loss's single
    matmul rounds it once. Targets skewed to the first 50 ids, as a real vocabulary's frequent tokens
    give some weight rows large gradients of one sign (the case where roundings add up)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=generator)
    weight = torch.randn(vocab, dim, generator=generator) * 0.1
    targets = torch.randint(0, 50, (tokens,), generator=generator)

    def gradients(dtype: torch.dtype, chunk: int) -> list[torch.Tensor]:
        h, w = (t.to(dtype).requires_grad_() for t in (hidden.bfloat16(), weight.bfloat16()))
        if chunk:
            loss = chunked_cross_entropy(h, w, targets, chunk_tokens=chunk)
        else:
            loss = F.cross_entropy(F.linear(h, w).float(), targets, reduction="sum")
        (loss / tokens).backward()
        return [loss.detach().float(), h.grad.float(), w.grad.float()]

    exact = gradients(torch.float32, 0)  # the bf16 inputs, computed in fp32

    def errors(values: list[torch.Tensor]) -> dict:
        return {name: float((v - e).norm() / e.norm())
                for name, v, e in zip(("loss", "hidden_grad", "weight_grad"), values, exact, strict=True)}

    chunks = sorted({DEFAULT_CHUNK_TOKENS, DEFAULT_CHUNK_TOKENS // 4, tokens // 4})
    return {"tokens": tokens, "dim": dim, "vocab": vocab, "plain": errors(gradients(torch.bfloat16, 0)),
            "chunked": {chunk: {"chunks": -(-tokens // chunk), **errors(gradients(torch.bfloat16, chunk))}
                        for chunk in chunks}}


if __name__ == "__main__":
    mode, *numbers, last = sys.argv[1:]
    shape = [int(n) for n in numbers]
    if mode == "precision":
        result = precision(*shape, int(last))
    else:
        result = memory(*shape, last) if mode == "memory" else speed(*shape, int(last))
    print(json.dumps(result))
