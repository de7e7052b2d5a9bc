"""The export's self-check: the written directory, loaded by transformers, must give the checkpoint's
logits. Peers' users report exports that load and then compute something else (a permuted q/k, a
dropped tie, a wrong norm epsilon); ``export-hf`` runs this after writing unless ``--no-verify``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from shardtrain.checkpoint.weights import load_model_weights, model_config_of
from shardtrain.errors import CheckpointError
from shardtrain.models.registry import build_model

# Largest |logit difference| relative to the largest |logit|: fp32 implementations of the same
# model agree to ~1e-6; a single corrupted weight is off by orders of magnitude more.
EXPORT_TOLERANCE = 1e-4


@torch.no_grad()
def verify_export(checkpoint: str | Path, out_dir: str | Path,
                  tolerance: float = EXPORT_TOLERANCE) -> float:
    """Compare the export's logits with the checkpoint's model on a fixed batch; return the largest
    relative difference, or raise naming it. Both sides hold the same weights rounded to the dtype
    the export was written in, and compute in fp32, so only a wrong conversion tells them apart."""
    cfg = model_config_of(Path(checkpoint))
    written = json.loads((Path(out_dir) / "config.json").read_text())["torch_dtype"]
    dtype = getattr(torch, written)
    ours = build_model(cfg)
    load_model_weights(ours, str(checkpoint), cfg)
    for param in ours.parameters():
        param.copy_(param.to(dtype).float())
    transformers.utils.logging.disable_progress_bar()  # one line of result, not a loading bar
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    tokens = torch.randint(0, ours.dims.vocab_size, (2, min(32, ours.max_seq_len)),
                           generator=torch.Generator().manual_seed(0))
    want = ours.eval()(tokens)
    got = theirs.eval()(tokens).logits
    difference = ((got - want).abs().max() / want.abs().max()).item()
    if not difference <= tolerance:  # NaN fails too
        raise CheckpointError(
            f"export check failed: {out_dir} loaded by transformers gives logits that differ from the "
            f"checkpoint's by {difference:.2e} (relative; limit {tolerance:.0e}): the written files do not "
            "reproduce the model. Do not use them; export again (--no-verify skips this check)")
    return difference
