"""The built-in Llama's lean layers (models/lean_ops.py): autograd's values, fewer bytes kept.

Forward values and the weights' gradients are plain autograd's to the bit; the norm's input
gradient (a regrouped formula) within 1e-6 relative in fp32. And a block keeps exactly the bytes
the memory planner counts for it (docs/memory-planner.md), in fp32 and bf16, lean or plain.
"""

from __future__ import annotations

import pytest
import torch

from shardtrain.config.loader import load_config
from shardtrain.config.plan import resolve_plan
from shardtrain.diagnostics.planner import activation_model
from shardtrain.models.lean_ops import rms_norm, swiglu
from shardtrain.models.llama import Llama, llama_dims
from shardtrain.models.masking import document_attention_bias


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_layers_compute_what_autograd_computes(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 17, 64, generator=generator) * 3).to(dtype).requires_grad_()
    weight = (torch.rand(64, generator=generator) + 0.5).to(dtype).requires_grad_()
    grad = torch.randn(3, 17, 64, generator=generator).to(dtype)
    lean, plain = rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5, lean=False)
    assert torch.equal(lean, plain)
    (lean_x, lean_w), (plain_x, plain_w) = (torch.autograd.grad(y, (x, weight), grad) for y in (lean, plain))
    assert torch.equal(lean_w, plain_w)
    assert relative(lean_x, plain_x) < 1e-6

    gate, up = (torch.randn(3, 17, 40, generator=generator).to(dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(3, 17, 40, generator=generator).to(dtype)
    lean, plain = swiglu(gate, up), swiglu(gate, up, lean=False)
    assert torch.equal(lean, plain)
    for a, b in zip(torch.autograd.grad(lean, (gate, up), grad), torch.autograd.grad(plain, (gate, up), grad),
                    strict=True):
        assert torch.equal(a, b)


def saved_bytes(run, exclude: tuple[torch.Tensor, ...]) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``run()`` runs, but for
    those of ``exclude`` (parameters, tables: not activations)."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("document_mask", "lean"), [(False, True), (True, True), (False, False)])
def test_a_block_keeps_the_bytes_the_planner_counts(dtype: torch.dtype, document_mask: bool,
                                                    lean: bool) -> None:
    cfg = load_config(["model.dim=128", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
                       "trainer.seq_len=64", "trainer.micro_batch_size=2",
                       f"model.lean_layers={str(lean).lower()}",
                       f"data.document_mask={str(document_mask).lower()}"])
    model = Llama(cfg.model)
    for parameter in model.parameters():  # as mixed precision casts them; the RoPE table stays complex
        parameter.data = parameter.data.to(dtype)
    x = torch.randn(2, 64, cfg.model.dim, dtype=dtype, requires_grad=True)
    rope, mask = model.rope[:64], None
    if document_mask:
        positions = torch.arange(64).remainder(40).expand(2, 64)  # two documents a row
        rope, mask = model.rope[positions], document_attention_bias(positions, dtype)
    # The mask and the rows' RoPE table are made once for all blocks: the planner counts the mask
    # beside them (and leaves out the table, head_dim * 4 bytes a token).
    exclude = (*model.parameters(), model.rope, rope, *([mask] if mask is not None else []))
    kept = saved_bytes(lambda: model.layers[0](x, rope, mask=mask), exclude)
    planned = activation_model(cfg, llama_dims(cfg.model), 2, dtype, resolve_plan(cfg.strategy, 1, 1)).block
    assert kept == planned
