"""A fused, chunked linear + cross-entropy: the output head and the loss computed a chunk of tokens at
a time, so that neither the full ``[tokens, vocab]`` fp32 logits nor their gradient ever exist.

The plain path, ``F.cross_entropy(head(hidden).float(), ...)``, keeps the logits in the compute dtype,
their fp32 copy, and in backward a gradient of each: for a 128k vocabulary at 8k tokens over 8 GB, often
a step's memory peak. Here each chunk's logits are computed exactly as the plain path computes them
(the matmul in the compute dtype, then ``.float()``), its summed cross-entropy taken, and, while the
chunk is at hand, the gradient of that sum with respect to the logits (softmax minus the one-hot target,
zero for ignored tokens) turned into the chunk's gradients of the hidden states and the head weight.
Backward only scales those by the incoming gradient (Liger-Kernel's fused linear cross-entropy does
the same): no logits are recomputed. The alternative, per-chunk recomputation under
``torch.utils.checkpoint``, runs the head's matmul a third time: ``benchmarks/run.py --only loss``
measured it at 0.79x this design's tokens/s at a 32k vocabulary on CPU, with more peak memory.

The head weight and bias are inputs of the autograd function, so their gradients reach them through
autograd: under FSDP2 the unsharded parameter gets them and its reduce-scatter hooks fire as usual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardtrain.data.batches import IGNORE_INDEX

# Tokens per chunk when a caller names none: [256, vocab] fp32 logits are 31 MiB at a 32k vocabulary
# and 125 MiB at 128k (Liger-Kernel's rule, chunk logits about the size of the hidden states, gives
# 256 tokens for Llama-3 8B at 8,192 tokens). The loss's forward and backward at 32k ran as fast at
# 256 tokens a chunk as at 512 on this CPU (1.17 vs 1.21 s for 1,024 tokens on one thread; 128: 1.25,
# 64: 1.46), and the vocabulary-heavy ablation's peak fell by 31 MiB a rank (docs/benchmarks.md).
DEFAULT_CHUNK_TOKENS = 256
# trainer.loss_chunk_tokens=auto chunks from this vocabulary up. Measured on CPU (docs/benchmarks.md):
# 1.16x the plain loss's tokens/s at 32k with 59% less step memory; at the default 256-token
# vocabulary 0.97x with 512-token chunks and 1.06x with 256 (the head is a sliver of that step, and
# within the scatter of one run either way it goes), so small vocabularies keep the plain loss.
AUTO_CHUNK_MIN_VOCAB = 32_000


def chunk_tokens_for(setting: int | str, vocab_size: int) -> int:
    """Tokens per chunk of the loss (0: the plain full-logits loss) for ``trainer.loss_chunk_tokens``
    (a count, or "auto") and the output head's vocabulary."""
    if setting == "auto":
        return DEFAULT_CHUNK_TOKENS if vocab_size >= AUTO_CHUNK_MIN_VOCAB else 0
    return int(setting)


def _chunk_gradient(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[
        torch.Tensor, torch.Tensor]:
    """The chunk's summed cross-entropy and its gradient w.r.t. the fp32 logits, written over them
    (one chunk-sized buffer, not the two or three of log-softmax and its gradient).

    The softmax is taken in place (max, subtract, exp, sum, scale) rather than through
    ``torch.logsumexp``, which on CPU allocates a second chunk-sized buffer and took 14% of a step
    at a 32k vocabulary (docs/benchmarks.md, "Chunked loss")."""
    kept = targets != ignore_index
    # Ignored tokens' rows read (and later zero) column 0. gather and scatter check their indices as
    # cross_entropy does: a negative target other than ignore_index is an error, not a wrapped index.
    columns = targets.masked_fill(~kept, 0).unsqueeze(1)
    picked = logits.gather(1, columns).squeeze(1)  # a copy, read before the logits are overwritten
    maxes = logits.amax(-1, keepdim=True)
    grad = logits.sub_(maxes).exp_()
    sums = grad.sum(-1, keepdim=True)
    log_normaliser = (sums.log() + maxes).squeeze(1)
    loss = ((log_normaliser - picked) * kept).sum()
    # One pass normalises the softmax and zeroes ignored tokens' rows.
    grad.mul_(kept.unsqueeze(1).to(grad.dtype) / sums)
    grad.scatter_add_(1, columns, -kept.to(grad.dtype).unsqueeze(1))
    return loss, grad


def _chunk_loss_and_grads(chunk: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          targets: torch.Tensor, ignore_index: int, grad_chunk: torch.Tensor | None,
                          grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None,
                          first: bool) -> torch.Tensor:
    """One chunk's summed cross-entropy; its gradients written into ``grad_chunk`` (the chunk's rows
    of the hidden states' gradient) and added to ``grad_bias`` and to ``grad_weight`` (written over
    it by the ``first`` chunk), those that are not None (all None: the loss alone)."""
    logits = F.linear(chunk, weight, bias).float()  # the compute-dtype copy is freed here
    if grad_chunk is None and grad_weight is None and grad_bias is None:
        return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    chunk_loss, grad_logits = _chunk_gradient(logits, targets, ignore_index)
    # The plain path's ``.float()`` hands its gradient back in the compute dtype: so here.
    grad_logits = grad_logits.to(chunk.dtype)
    if grad_chunk is not None:
        torch.mm(grad_logits, weight, out=grad_chunk)
    if grad_weight is not None:
        # beta=0: the uninitialised buffer is ignored, never read (torch.addmm's contract). The
        # out= form, not addmm_: torch's FLOP counter counts it (addmm_ it does not, and a task's
        # FLOPs, counted once before training, lost a third of the head's: found by review).
        torch.addmm(grad_weight, grad_logits.t(), chunk, beta=0 if first else 1, out=grad_weight)
    if grad_bias is not None:
        grad_bias += grad_logits.sum(0)
    return chunk_loss


def _summed_over_chunks(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        targets: torch.Tensor, chunk_tokens: int, ignore_index: int,
                        grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None,
                        grad_bias: torch.Tensor | None) -> torch.Tensor:
    """The summed cross-entropy over every chunk of ``chunk_tokens`` rows, each chunk's gradients
    written into the buffers given (``_chunk_loss_and_grads``; all None: the loss alone)."""
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        # One function call a chunk: its logits die when it returns. A loop variable would keep
        # the last chunk's logits alive while the next chunk's are computed, two chunks at the
        # peak (measured: 62 MiB more a rank at a 32k vocabulary).
        grad_chunk = None if grad_hidden is None else grad_hidden[rows]
        loss += _chunk_loss_and_grads(hidden[rows], weight, bias, targets[rows], ignore_index,
                                      grad_chunk, grad_weight, grad_bias, first=start == 0)
    return loss


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk_tokens: int, ignore_index: int) -> torch.Tensor:
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # Summed over chunks in the weight's dtype, in place (Liger-Kernel does the same): an fp32
        # buffer of the weight's size, or a chunk's product upcast, would be the step's peak at a
        # 128k vocabulary in bf16. In fp32 this is exactly the plain path's sum, in another order.
        # The first chunk writes the weight's, so no pass zeroes it (at a 32k vocabulary and dim 512,
        # 53 ms of a 5 s CPU step went to zeroing it); without tokens there is no first chunk.
        grad_weight = None
        if want_weight:
            grad_weight = torch.empty_like(weight) if hidden.shape[0] else torch.zeros_like(weight)
        grad_bias = torch.zeros_like(bias) if want_bias else None
        loss = _summed_over_chunks(hidden, weight, bias, targets, chunk_tokens, ignore_index, grad_hidden,
                                   grad_weight, grad_bias)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.backward_done = False
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # Autograd runs backward with grad mode on only for create_graph=True: the gradients here are
        # buffers computed in forward, without a graph, so a gradient penalty would silently be a constant.
        if torch.is_grad_enabled():
            raise RuntimeError("chunked_cross_entropy has no second derivative (create_graph=True); "
                               "take a gradient penalty through the plain F.cross_entropy loss")
        if ctx.backward_done:
            raise RuntimeError("chunked_cross_entropy's gradients were scaled in place by the first "
                               "backward; backward through it twice (retain_graph) is not supported")
        ctx.backward_done = True
        grads = [None if g is None else scale_in_place(g, grad_output) for g in ctx.saved_tensors]
        return *grads, None, None, None


# Elements of a low-precision gradient scaled in fp32 at a time (a 64 MiB buffer).
SCALE_CHUNK = 1 << 24


def scale_in_place(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``grad`` times the fp32 ``scale``, in place, multiplied in fp32 and rounded once, as the plain
    loss's gradient is (found by review: 1/N rounded to bf16 first biased every gradient of a bf16
    step by up to 0.2%). A CUDA kernel casts a 0-dim operand to the other's dtype (as read; not run on
    a GPU), so a low-precision
    gradient is taken to fp32 a chunk at a time: a whole fp32 copy would be one more weight-sized
    buffer, and ``scale.item()`` a host sync in every backward."""
    if grad.dtype == scale.dtype or not grad.is_contiguous():
        return grad.mul_(scale) if grad.dtype == scale.dtype else grad.copy_(grad.float() * scale)
    for part in grad.view(-1).split(SCALE_CHUNK):
        part.copy_(part.float().mul_(scale))
    return grad


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          bias: torch.Tensor | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                          ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Summed cross-entropy of ``F.linear(hidden, weight, bias)`` against ``targets``, never holding
    more than ``chunk_tokens`` rows of logits; equal to
    ``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, ignore_index=ignore_index,
    reduction="sum")`` (and its gradients) within fp32 rounding in fp32; in bf16 the weight's gradient
    is summed chunk by chunk in bf16, one rounding a chunk (docs/tasks.md measures it).

    ``hidden``: (..., dim) final hidden states in the compute dtype; ``weight``: (vocab, dim);
    ``targets``: (...) token ids, ``ignore_index`` where no loss is taken (fine-tuning masks). The loss
    is an fp32 scalar. Under autograd it holds, between forward and backward, the gradients of the
    hidden states and of the weight (their sizes and dtypes) instead of the logits; under
    ``torch.no_grad``, or with no input that requires grad, it computes the loss alone.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be at least 1")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and targets {tuple(targets.shape)} "
                         "must agree in every dimension but the last")
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    differentiable = any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not (torch.is_grad_enabled() and differentiable):
        # Evaluation (torch.no_grad): the loss alone, no gradient buffers nor their matmuls.
        return _summed_over_chunks(hidden, weight, bias, targets, chunk_tokens, ignore_index, None, None,
                                   None)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_tokens, ignore_index)
