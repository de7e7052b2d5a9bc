"""Text sampling from a (possibly sharded) byte-level model.

Every rank runs the same loop, because under FSDP each forward is a collective. Token choices come
from a generator seeded identically on every rank over identical logits, so the ranks stay in step
and always run the same number of forwards.
"""

from __future__ import annotations

import torch
from torch import nn

from shardtrain.distributed.parallelize import reshard_all


def pick_next(logits: torch.Tensor, temperature: float, top_k: int,
              generator: torch.Generator) -> torch.Tensor:
    """Greedy when temperature is 0, else sampling from the top-k (0 = all) tokens."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1).cpu()
    return torch.multinomial(probs, 1, generator=generator).to(logits.device)


@torch.no_grad()
def sample_bytes(model: nn.Module, prompt: bytes, max_new_tokens: int, context: int,
                 device: torch.device, temperature: float = 0.8, top_k: int = 40,
                 seed: int = 0) -> bytes:
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([list(prompt or b"\n")], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -context:])[:, -1, :256]  # bytes only, whatever the vocabulary
        tokens = torch.cat([tokens, pick_next(logits, temperature, top_k, generator)], dim=1)
    model.train(was_training)
    reshard_all(model)
    return bytes(tokens[0].tolist())
