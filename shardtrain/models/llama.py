"""A Llama-style decoder in one file: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention.

The model knows nothing about sharding. It tells the framework three things:
- ``block_classes``: the classes that become FSDP units (the transformer block),
- ``extra_shard_groups()``: other module groups worth their own unit (embeddings; final norm + head),
- ``init_parameter(name, tensor, generator)``: how to fill one full-size parameter, so that the
  framework can initialise every parameter identically at any world size and sharding strategy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from shardtrain.config.compose import check_llama_shape
from shardtrain.config.schema import ModelConfig
from shardtrain.errors import ModelError
from shardtrain.models.dims import Dims
from shardtrain.models.lean_ops import project, rms_norm, swiglu_projected
from shardtrain.models.llama_tp import llama_tensor_parallel_plan, parallelize_llama
from shardtrain.models.masking import document_attention_bias


def ffn_hidden_dim(cfg: ModelConfig) -> int:
    if cfg.ffn_hidden_dim > 0:
        return cfg.ffn_hidden_dim
    hidden = int(8 * cfg.dim / 3)
    m = cfg.ffn_multiple_of
    return m * ((hidden + m - 1) // m)


def llama_dims(cfg: ModelConfig) -> Dims:
    """The sizes the built-in Llama of ``cfg`` will have (without building it)."""
    return Dims(cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, ffn_hidden_dim(cfg), cfg.vocab_size,
                cfg.dim // cfg.n_heads)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, lean: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.lean = lean
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.lean)


def rope_table(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """Each position's rotations as cos + i*sin, (max_seq_len, head_dim/2). Complex, not two real
    tables, because the blocks take it as an input and FSDP's mixed precision casts floating-point
    inputs to bf16 (8 mantissa bits: far positions lose their angle) but leaves complex ones alone."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return torch.complex(angles.cos(), angles.sin())


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (even, odd) of the last dim. x: (B, T, H, D); rope: (T, D/2), or (B, T, D/2)
    for positions that differ per row (document masking)."""
    cos, sin = rope.real.unsqueeze(-2), rope.imag.unsqueeze(-2)
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class KVCache:
    """Keys and values of the tokens seen so far, one pair per layer, filled as generation goes."""

    def __init__(self, n_layers: int, max_len: int) -> None:
        self.max_len = max_len
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.pos = 0  # tokens already in the cache

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T, D) at the current position; return everything up to them."""
        if self.keys[layer] is None:
            b, h, _, d = k.shape
            self.keys[layer] = k.new_zeros(b, h, self.max_len, d)
            self.values[layer] = v.new_zeros(b, h, self.max_len, d)
        end = self.pos + k.shape[2]
        self.keys[layer][:, :, self.pos:end] = k
        self.values[layer][:, :, self.pos:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads:
            raise ModelError(f"model.dim={cfg.dim} must be divisible by model.n_heads={cfg.n_heads}")
        if cfg.n_heads % cfg.n_kv_heads:
            raise ModelError(
                f"model.n_heads={cfg.n_heads} must be a multiple of model.n_kv_heads={cfg.n_kv_heads}"
            )
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # Head counts from the projections' widths: under tensor parallelism each rank holds
        # n_heads / tp query and n_kv_heads / tp key/value heads (models/llama_tp.py).
        # Rotated in (B, T, H, D) order, then viewed as (B, H, T, D): SDPA writes its output in its
        # query's memory order, so the output projection reads it without a copy (a copy would
        # also be kept for backward).
        q, k, v = (y.view(b, t, -1, self.head_dim) for y in project(x, self.wq, self.wk, self.wv))
        q = apply_rope(q, rope).transpose(1, 2)
        k = apply_rope(k, rope).transpose(1, 2)
        v = v.transpose(1, 2)
        start = 0
        if cache is not None:
            start = cache.pos
            k, v = cache.update(layer, k, v)
        causal = start == 0 and mask is None
        if start > 0 and t > 1:  # several new tokens after cached ones: causal, shifted
            mask = torch.ones(t, start + t, dtype=torch.bool, device=x.device).tril(start)
        grouped = k.shape[1] != q.shape[1]
        if grouped and mask is not None and t > 1:
            # On CUDA, SDPA runs grouped-query attention with a mask only in its math kernel (the
            # full fp32 score matrix per layer): give it as many key/value heads as query heads.
            k, v = (z.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for z in (k, v))
            grouped = False
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and t > 1,
                                           enable_gqa=grouped)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = ffn_hidden_dim(cfg)
        self.lean = cfg.lean_layers
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.w1, self.w3)
        return swiglu_projected(gate, up, self.w2, self.lean)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.lean_layers)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.lean_layers)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, cache, layer, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    block_classes = (TransformerBlock,)
    # init_parameter fills each element on its own (by the parameter's name, never its shape), so
    # each rank may initialise just the chunks of its own shard: True for every parameter (a model
    # may answer per name instead, models/initializer.py).
    init_parameter_elementwise = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        check_llama_shape(cfg)
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.lean_layers)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived, not learned: non-persistent so checkpoints never carry it.
        self.register_buffer("rope", self.rope_table(), persistent=False)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                positions: torch.Tensor | None = None, hidden_only: bool = False) -> torch.Tensor:
        """Logits for ``tokens`` (B, T). ``positions`` (B, T), each token's position within its
        document, packs several documents in a row: positions restart and attention stays inside
        each document (``models/masking.py``). ``hidden_only``: the final (normalised) hidden states
        instead, (B, T, dim), for a loss that applies ``output_head()`` itself chunk by chunk."""
        start = cache.pos if cache is not None else 0
        end = start + tokens.shape[1]
        if end > self.cfg.max_seq_len:
            raise ModelError(f"a sequence of {end} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}; "
                             "use shorter inputs or a model with a longer max_seq_len")
        h = self.tok_embeddings(tokens)
        mask = None
        if positions is None:
            rope = self.rope[start:end]
        else:
            if cache is not None:
                raise ModelError("positions= is for training on packed documents, not with a KV cache")
            if positions.shape != tokens.shape:
                raise ModelError(f"positions {tuple(positions.shape)} must have the tokens' shape "
                                 f"{tuple(tokens.shape)}: one position per token")
            # On the device, without a host read: a negative position would index the rotary table
            # from its end, silently.
            torch._assert_async((positions.min() >= 0) & (positions.max() < self.cfg.max_seq_len),
                                f"a position is outside 0..model.max_seq_len-1 ({self.cfg.max_seq_len - 1}): "
                                "positions count tokens from each document's start")
            rope = self.rope[positions]
            mask = document_attention_bias(positions, h.dtype)
        for index, layer in enumerate(self.layers):
            h = layer(h, rope, cache, index) if cache is not None else layer(h, rope, mask=mask)
        if cache is not None:
            cache.pos = end
        h = self.norm(h)
        return h if hidden_only else self.output(h)

    def output_head(self) -> nn.Linear:
        """The linear map from ``hidden_only`` states to logits (nothing else is applied to them)."""
        return self.output

    def input_embedding(self) -> nn.Embedding:
        """The token embedding: its rows are the ids the model can read."""
        return self.tok_embeddings

    @property
    def max_seq_len(self) -> int:
        return self.cfg.max_seq_len

    @property
    def dims(self) -> Dims:
        return llama_dims(self.cfg)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        return KVCache(self.cfg.n_layers, max_len or self.cfg.max_seq_len)

    # ---- what the framework asks of a model -------------------------------------------------

    def parallelize_tensors(self, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        """Split the weights over ``tp_mesh`` (tensor parallelism; see ``models/llama_tp.py``)."""
        parallelize_llama(self, tp_mesh, sequence_parallel)

    def tensor_parallel_plan(self, sequence_parallel: bool, tp: int) -> dict[str, ParallelStyle]:
        """The styles ``parallelize_tensors`` applies, by module path (read by the memory planner;
        the same for any ``tp``)."""
        return llama_tensor_parallel_plan(sequence_parallel)

    def extra_shard_groups(self) -> list[list[nn.Module]]:
        """Module groups that get their own FSDP unit besides the blocks (as torchtitan does)."""
        if self.cfg.tie_embeddings:
            # The shared weight must live in exactly one unit.
            return [[self.tok_embeddings, self.norm, self.output]]
        return [[self.tok_embeddings], [self.norm, self.output]]

    def rope_table(self) -> torch.Tensor:
        return rope_table(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len, self.cfg.rope_theta)

    def init_buffers(self) -> None:
        """Recompute derived buffers after the meta-device model was materialised."""
        self.rope.copy_(self.rope_table())

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill one full-size parameter; GPT-2 style, with scaled residual projections."""
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
            return
        std = self.cfg.init_std
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            std = std / math.sqrt(2 * self.cfg.n_layers)
        tensor.normal_(0.0, std, generator=generator)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and not self.cfg.tie_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), the formula torchtitan and PaLM use."""
        cfg = self.cfg
        head_dim = cfg.dim // cfg.n_heads
        return 6 * self.num_params(exclude_embeddings=True) + (
            12 * cfg.n_layers * cfg.n_heads * head_dim * seq_len
        )

