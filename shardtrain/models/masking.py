"""Document masking for packed windows: attention stays inside each document.

A batch with document masking carries each token's position within its document (``Batch.positions``,
restarting at 0 where a document begins). Models that support it take ``positions=`` in ``forward``:
rotary embeddings use those positions, and attention keeps to each document. The built-in Llama
uses ``document_attention_bias``, an additive mask for ``scaled_dot_product_attention`` (SDPA runs it
on CPU and on GPUs alike); Hugging Face models pass the positions as ``position_ids``, from which
transformers builds the model's own mask.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from shardtrain.errors import ModelError


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool, True where token i may attend to token j: j <= i and both in one document.

    ``positions`` (B, T): each token's position within its document; a document begins where it is
    0 (the first token of every row is one).
    """
    documents = (positions == 0).cumsum(dim=1)
    allowed = documents.unsqueeze(2) == documents.unsqueeze(1)
    length = positions.shape[1]
    allowed &= torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    return allowed.unsqueeze(1)


def document_attention_bias(positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``document_causal_mask`` as SDPA's additive mask in the attention's dtype (0 or -inf), made
    once per forward and shared by every layer. SDPA turns a boolean mask into this form on each
    call, and each layer's backward would keep its own copy: measured +1 GiB for 4 layers at 4 x
    4,096 tokens, where one shared copy is 256 MiB (fp32) or 128 MiB (bf16)."""
    blocked = document_causal_mask(positions).logical_not_()
    bias = torch.zeros(blocked.shape, dtype=dtype, device=positions.device)
    return bias.masked_fill_(blocked, float("-inf"))


def check_document_mask_support(model: nn.Module) -> None:
    """Refuse document masking for a model whose ``forward`` cannot take ``positions=``, or that
    says (``document_mask_refusal()``) masking attention would not keep its documents apart."""
    if "positions" not in inspect.signature(model.forward).parameters:
        raise ModelError(
            f"data.document_mask=true needs a model whose forward takes positions= (per-token positions "
            f"within documents); {type(model).__name__}.forward does not. Give it that argument "
            "(see docs/data.md) or set data.document_mask=false")
    refusal = getattr(model, "document_mask_refusal", None)
    reason = refusal() if refusal is not None else None
    if reason:
        raise ModelError(f"data.document_mask=true cannot keep this model's documents apart: {reason}; "
                         "set data.document_mask=false")
