"""The built-in Llama's element-wise layers, written to keep less for backward than autograd would.

Autograd keeps every intermediate an operator's derivative reads. For RMSNorm that is the input and
the normalised input (the weight's gradient reads it), a second tensor of the residual stream's size
per norm; for SwiGLU it is both projections and ``silu(gate)``, a third hidden-size tensor beside
the product the down projection keeps. These functions keep only what the other intermediates are
cheap to recompute from (the norm's input and one rsqrt per token; the two projections) and redo the
element-wise work in backward. The forward values are autograd's to the bit (the same operations in
the same order); the norm's input gradient is the same formula regrouped, equal within rounding.

``swiglu_projected`` and ``project`` go one step further, through saved-tensor hooks around the
projections: the SwiGLU's product, which the down projection keeps for its weight's gradient, is
recomputed from the two projections when backward reaches it, and a norm's output, which the q, k, v
(or w1, w3) projections keep, from the norm's input and rsqrt (one element-wise pass a norm), whatever
module the projection is (a LoRA layer keeps it the same way; a float8 linear or a tensor-parallel
one that keeps something else keeps that). Together a block keeps 47-54% fewer activation bytes than
with autograd's layers (docs/memory-planner.md), for no extra matmul.

They work on DTensors as they do on tensors (sequence parallelism hands the norms sharded inputs):
every operation in them is an ordinary one.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor


def _normalise(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's output and its fp32 rsqrt a row: normalised in fp32 for stability under bf16,
    scaled in the input dtype. The lean and the plain norm both compute it, so their values agree
    by construction."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return _scaled(xf, rstd, weight, x.dtype), rstd


def _scaled(xf: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The norm's output from its fp32 input and rsqrt: the forward and its recomputation in
    backward (``project``) both compute it here, so that they agree to the bit."""
    return (xf * rstd).to(dtype) * weight


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out, rstd = _normalise(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = _saved_once(ctx)
        # The engine frees the saved tensors after this; so must we, and the output the
        # projections' backward recomputed (_RecomputedNormOutput).
        ctx.saved_once = ctx.recomputed_output = None
        normed = x.float() * rstd
        grad_weight = (grad * normed.type_as(x)).sum_to_size(weight.shape)
        grad_normed = (grad * weight).float()
        # d(x * rstd)/dx with rstd = mean(x^2)^(-1/2): (g - n * mean(g * n)) * rstd, n = x * rstd;
        # in place, so that backward holds two fp32 tensors of the input's size, not five.
        dot = (grad_normed * normed).mean(-1, keepdim=True)
        grad_x = grad_normed.sub_(normed.mul_(dot)).mul_(rstd)
        return grad_x.type_as(x), grad_weight, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        # In place: silu(gate) is not kept, so its buffer becomes the product (without checkpointing
        # the forward would otherwise hold a fourth hidden-size tensor for a moment).
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = _saved_once(ctx)
        ctx.saved_once = None  # the engine frees the saved tensors after this; so must we
        # The operations autograd's own backward runs, on silu(gate) recomputed; one gradient at a
        # time and the second in place, so that backward holds no more hidden-size tensors than
        # autograd's (the incoming gradient and the two outgoing ones).
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        grad_up = F.silu(gate).mul_(grad)
        return grad_gate, grad_up


def _saved_once(ctx) -> tuple[torch.Tensor, ...]:
    """A lean function's saved tensors, read once and held until its own backward: a projection's
    backward reads them first (to recompute the product or the norm's output), and under activation
    checkpointing saved tensors may be unpacked only once."""
    if getattr(ctx, "saved_once", None) is None:
        ctx.saved_once = ctx.saved_tensors
    return ctx.saved_once


class _Recomputed:
    """Kept by a layer for backward in place of (a view of) a tensor that is recomputed, from what
    another autograd node keeps anyway, when backward reads it."""

    __slots__ = ("node", "size", "stride", "offset")

    def __init__(self, node, view: torch.Tensor) -> None:
        self.node = node  # the recomputed tensor's autograd node: part of the graph anyway
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()

    def tensor(self) -> torch.Tensor:
        return self.whole().as_strided(self.size, self.stride, self.offset)

    def whole(self) -> torch.Tensor:
        raise NotImplementedError


class _RecomputedProduct(_Recomputed):
    """The SwiGLU's product, kept by the down projection."""

    __slots__ = ()

    def whole(self) -> torch.Tensor:
        gate, up = _saved_once(self.node)
        # The forward's operations: the same values to the bit.
        return F.silu(gate).mul_(up)


class _RecomputedNormOutput(_Recomputed):
    """An RMSNorm's output, kept by the projections that read it: recomputed by the first of
    their backwards and held on the norm's node for the others (q, k and v read one output), until
    the norm's own backward, which follows theirs."""

    __slots__ = ()

    def whole(self) -> torch.Tensor:
        output = getattr(self.node, "recomputed_output", None)
        if output is None:
            x, weight, rstd = _saved_once(self.node)
            output = self.node.recomputed_output = _scaled(x.float(), rstd, weight, x.dtype)
        return output


def _unpack(saved):
    return saved.tensor() if isinstance(saved, _Recomputed) else saved


def _recomputing(target: torch.Tensor, kind: type[_Recomputed]):
    """Saved-tensor hooks under which what saves ``target`` (or a view of it) keeps a ``kind`` in its
    place. Autograd keeps the hooks with every tensor saved under them: a reference to ``target``
    here would keep it alive."""
    node = target.grad_fn
    target_ref = weakref.ref(target)

    def pack(saved: torch.Tensor):
        target = target_ref()
        if target is not None and (saved is target or saved._base is target):
            return kind(node, saved)
        return saved

    return saved_tensors_hooks(pack, _unpack)


def _may_recompute(tensor: torch.Tensor) -> bool:
    """Recomputation in backward through our hooks: not under activation checkpointing (it already
    recomputes, and tensors saved under a hook of ours would escape its own hooks) nor compilation
    (the compiler chooses what to keep), and not for a DTensor (a tensor-parallel layer keeps its own
    DTensor input, which is not it)."""
    # Compilation first: the compiler cannot trace a context variable's lookup (a graph break).
    return (not torch.compiler.is_compiling() and tensor.requires_grad and not isinstance(tensor, DTensor)
            and not _checkpointed.get())


_checkpointed = contextvars.ContextVar("checkpointed", default=False)


@contextlib.contextmanager
def checkpointed() -> Iterator[None]:
    """Activation checkpointing's forward and recomputation run inside this: the checkpoint already
    recomputes the product and the norms' outputs, and tensors saved under a hook of ours would
    escape its own hooks."""
    token = _checkpointed.set(True)
    try:
        yield
    finally:
        _checkpointed.reset(token)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lean: bool = True) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, normalised in fp32 and
    returned in ``x``'s dtype. ``lean``: keeps ``x`` and one fp32 value a row for backward;
    otherwise plain autograd's operations (which keep the fp32 input and the normalised input too)."""
    return _RMSNorm.apply(x, weight, eps) if lean else _normalise(x, weight, eps)[0]


def swiglu(gate: torch.Tensor, up: torch.Tensor, lean: bool = True) -> torch.Tensor:
    """``silu(gate) * up``. ``lean``: keeps ``gate`` and ``up`` for backward, not ``silu(gate)``;
    otherwise plain autograd's operations."""
    return _SwiGLU.apply(gate, up) if lean else F.silu(gate) * up


def swiglu_projected(gate: torch.Tensor, up: torch.Tensor, down: Callable[[torch.Tensor], torch.Tensor],
                     lean: bool = True) -> torch.Tensor:
    """``down(silu(gate) * up)``, the feed-forward's second half. ``lean``: nothing keeps the product
    for backward; ``down``'s backward gets it recomputed from ``gate`` and ``up`` (which the SwiGLU
    keeps) in its place. Wherever ``down`` keeps something else (a float8 copy, a DTensor under tensor
    parallelism), that is kept as it is; under compilation the compiler chooses what to keep."""
    product = swiglu(gate, up, lean)
    if not (lean and _may_recompute(product)):
        return down(product)
    with _recomputing(product, _RecomputedProduct):
        return down(product)


def project(x: torch.Tensor,
            *projections: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Each of ``projections`` applied to ``x``. When ``x`` is a lean RMSNorm's output
    (``rms_norm(..., lean=True)``), what the projections keep of it for their weights' gradients
    is recomputed from the norm's input and rsqrt (which the norm keeps) when backward reads it: one
    element-wise pass a norm instead of a residual-stream-sized tensor kept per norm. Whatever a
    projection keeps that is not ``x`` (a float8 copy, a LoRA layer's dropout output) is kept as it is."""
    # _may_recompute first: compiled, the autograd graph is not there to look at.
    if not (_may_recompute(x) and isinstance(x.grad_fn, _RMSNorm._backward_cls)):
        return tuple(projection(x) for projection in projections)
    with _recomputing(x, _RecomputedNormOutput):
        return tuple(projection(x) for projection in projections)
