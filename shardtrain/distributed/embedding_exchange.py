"""Embedding tables that are never gathered: each rank asks the rows' owners for the rows it reads.

FSDP gathers a unit's whole parameters for its forward and reduce-scatters a gradient of the
whole table after its backward: for an embedding that is vocabulary x dim each way every step, of
which a micro-batch reads a few thousand rows (and its gradient is zero everywhere else). FSDP2
already gives each rank a contiguous block of rows (``Shard(0)``); this module keeps that layout,
the same DTensor placements, so checkpoints, the optimizer and clipping see what they would under
FSDP, and moves rows instead of the table (TorchRec's row-wise sharding of recommendation tables):

- forward: a rank's distinct token ids go to the ranks that own them, which send those rows back
  (all-to-all, uneven splits);
- backward: each distinct token's gradient goes back to the owner, which adds it to its own rows'
  gradient; across the replicas of a hybrid mesh the shards' gradients are summed after the step's
  last micro-batch, as FSDP's hybrid all-reduce is.

The traffic is the micro-batch's distinct tokens x dim, whatever the vocabulary and the world size,
where FSDP moves the table twice (docs/parallelism.md has what it was measured to save). It applies
to a unit holding one plain ``nn.Embedding`` alone (not tied to the head, whose matmul needs the
whole table), without tensor parallelism or CPU offload; ``strategy.embedding_lookup=gather`` turns
it off.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from shardtrain.config.plan import ShardingPlan


def plain_embedding(module: nn.Module) -> bool:
    """An ``nn.Embedding`` whose forward is the lookup itself (a subclass that scales or normalises
    its weight may need it in backward), without the options the lookup alone does not apply:
    ``max_norm`` renormalises the table's rows in place, ``scale_grad_by_freq`` scales by counts
    over the whole batch, ``sparse`` makes a sparse gradient (exchanged, the first two were dropped
    without a word)."""
    return (isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward
            and module.max_norm is None and not module.scale_grad_by_freq and not module.sparse)


def exchanges_rows(plan: ShardingPlan) -> bool:
    """Whether this run exchanges embedding rows: asked for, and the table sharded over more than
    one rank by FSDP alone (tensor parallelism splits it its own way; cpu_offload keeps the shards
    on the host)."""
    return (plan.embedding_lookup == "exchange" and plan.shard_group > 1 and plan.tensor_parallel == 1
            and not plan.cpu_offload)


def exchangeable(model: nn.Module, modules: list[nn.Module]) -> bool:
    """An FSDP unit that is one plain embedding whose table no other module uses (a tied head's
    matmul needs the whole table)."""
    if len(modules) != 1 or not plain_embedding(modules[0]):
        return False
    table = modules[0].weight
    return not any(p is table for m in model.modules() if m is not modules[0]
                   for p in m.parameters(recurse=False))


@dataclass(frozen=True)
class RowRoute:
    """Where an embedding's rows live: ``rows`` a rank (the last may hold fewer), over ``group``;
    ``replicas``: the group that holds copies of this shard (hybrid meshes), or None."""

    group: dist.ProcessGroup
    replicas: dist.ProcessGroup | None
    rows: int
    num_embeddings: int
    compute_dtype: torch.dtype | None
    padding_idx: int | None


class _ExchangeLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_rows: torch.Tensor, tokens: torch.Tensor, route: RowRoute) -> torch.Tensor:
        world, rank = dist.get_world_size(route.group), dist.get_rank(route.group)
        wanted, inverse = torch.unique(tokens.reshape(-1), return_inverse=True)  # sorted: by owner
        # Owners clamped so that an id out of range still gives ``world`` counts. A rank holding
        # one sends -1 to every rank in place of its counts (decided on the device: no extra host
        # read), so that every rank stops at the check below rather than waiting in the next
        # all-to-all for the rank that raised.
        owners = (wanted // route.rows).clamp_(0, world - 1)
        send = torch.bincount(owners, minlength=world) if wanted.numel() else owners.new_zeros(world)
        bounds = wanted[[0, -1]] if wanted.numel() else send[:2]
        if wanted.numel():
            send = torch.where((bounds[0] < 0) | (bounds[1] >= route.num_embeddings),
                               torch.full_like(send, -1), send)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=route.group)
        # The forward's one host read: the split sizes, with the range check (docs/metrics.md).
        sizes = torch.cat([send, recv, bounds]).tolist()
        send_sizes, recv_sizes, (low, high) = sizes[:world], sizes[world:2 * world], sizes[2 * world:]
        if wanted.numel() and (low < 0 or high >= route.num_embeddings):
            raise IndexError(f"token id {low if low < 0 else high} is outside the embedding's "
                             f"{route.num_embeddings} rows: the tokenizer and model.vocab_size disagree")
        if min(recv_sizes) < 0:
            raise IndexError(f"rank {recv_sizes.index(-1)} of the embedding's row exchange looked up a "
                             f"token id outside its {route.num_embeddings} rows (its error names the "
                             "id): the tokenizer and model.vocab_size disagree")
        asked = wanted.new_empty(sum(recv_sizes))
        dist.all_to_all_single(asked, wanted, recv_sizes, send_sizes, group=route.group)
        asked -= rank * route.rows  # this rank's own row numbers
        found = local_rows.index_select(0, asked).to(route.compute_dtype or local_rows.dtype)
        received = found.new_empty(wanted.numel(), local_rows.shape[1])
        dist.all_to_all_single(received, found, send_sizes, recv_sizes, group=route.group)
        padding = (wanted == route.padding_idx) if route.padding_idx is not None else None
        ctx.save_for_backward(inverse, asked, padding)
        ctx.route, ctx.sizes, ctx.local_shape, ctx.local_dtype = route, (send_sizes, recv_sizes), \
            local_rows.shape, local_rows.dtype
        return received.index_select(0, inverse).view(*tokens.shape, local_rows.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        inverse, asked, padding = ctx.saved_tensors
        send_sizes, recv_sizes = ctx.sizes
        route, dim = ctx.route, ctx.local_shape[1]
        # Summed per distinct token in the parameter's precision at least (fp32 under bf16-mixed), as
        # the gathered table's backward accumulates: CUDA's index_add_ in bf16 rounds at every add,
        # and a frequent token's gradient lost percents (a review's estimate: 2.5% at 512
        # occurrences; never run on a GPU). The owner then adds every rank's sums.
        distinct = sum(send_sizes)
        total = torch.promote_types(grad.dtype, ctx.local_dtype)
        sums = grad.new_zeros(distinct, dim, dtype=total).index_add_(0, inverse,
                                                                      grad.reshape(-1, dim).to(total))
        if padding is not None:
            sums[padding] = 0  # nn.Embedding's padding_idx row gets no gradient
        returned = sums.new_empty(asked.numel(), dim)
        dist.all_to_all_single(returned, sums, recv_sizes, send_sizes, group=route.group)
        grad_rows = torch.zeros(ctx.local_shape, dtype=ctx.local_dtype, device=grad.device)
        grad_rows.index_add_(0, asked, returned.to(ctx.local_dtype))
        return grad_rows, None, None


class ExchangedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose weight is sharded by rows over the data-parallel mesh and looked up
    by exchanging rows (module docstring). Made by :func:`exchange_embedding_rows`."""

    route: RowRoute
    # Whether this backward ends the step's accumulation, when the replicas' shards are summed (the
    # training step sets it per micro-batch, as it tells FSDP when to all-reduce).
    sum_replicas: bool = True
    # The weight whose gradient hook sums the replicas.
    _summed: Callable[[], nn.Parameter | None] = staticmethod(lambda: None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        replicated = self.route.replicas is not None and self.weight.requires_grad
        if replicated and self._summed() is not self.weight:
            # Here rather than when sharding: materialising the model (to_empty) and some loads
            # replace the Parameter object, and a hook stays with the object it was put on.
            self.weight.register_post_accumulate_grad_hook(partial(_sum_replicas, self))
            self._summed = weakref.ref(self.weight)
        return _ExchangeLookup.apply(self.weight.to_local(), tokens, self.route)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rows exchanged over {dist.get_world_size(self.route.group)} ranks"


def exchange_embedding_rows(embedding: nn.Embedding, mesh: DeviceMesh,
                            compute_dtype: torch.dtype | None) -> nn.Parameter:
    """Shard ``embedding``'s table by rows over ``mesh`` (its last dimension; the others replicate,
    as FSDP2's hybrid sharding does) and make its forward exchange rows. Returns the new parameter,
    which FSDP must then leave alone (``ignored_params``)."""
    if mesh.ndim > 2:
        raise ValueError(f"row-exchanged embeddings take a 1-D or 2-D data-parallel mesh, not {mesh}")
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    old = embedding.weight
    # Every rank holds the same full table (the same seed, or meta): each keeps its own rows, as
    # fully_shard does, without a scatter from rank 0.
    weight = nn.Parameter(distribute_tensor(old.detach(), mesh, placements, src_data_rank=None),
                          requires_grad=old.requires_grad)
    embedding.weight = weight
    group = mesh.get_group(mesh.ndim - 1)
    replicas = mesh.get_group(0) if mesh.ndim > 1 else None
    embedding.__class__ = ExchangedEmbedding
    embedding.route = RowRoute(group, replicas, -(-embedding.num_embeddings // group.size()),
                               embedding.num_embeddings, compute_dtype, embedding.padding_idx)
    return weight


def _sum_replicas(embedding: ExchangedEmbedding, weight: nn.Parameter) -> None:
    """After the step's last backward: each replica's shard gradient holds its own tokens' sums,
    summed over the replicas as FSDP's hybrid all-reduce does (after the gradient is accumulated,
    so that earlier micro-batches' sums are in it)."""
    if embedding.sum_replicas:
        dist.all_reduce(weight.grad.to_local(), group=embedding.route.replicas)
