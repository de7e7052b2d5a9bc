"""The built-in Llama's tensor-parallel plan (beside the model, as its Hugging Face adapter is):
which of its linear maps split their output features (column-wise) or their input features
(row-wise) over the ``tp`` dimension of the mesh, with torch's ``torch.distributed.tensor.parallel``
styles, after torchtitan's ``parallelize_llama``.

Attention: ``wq``, ``wk``, ``wv`` column-wise (each rank holds whole heads: n_heads / tp query heads
and n_kv_heads / tp key/value heads), ``wo`` row-wise; the feed-forward's ``w1``, ``w3`` column-wise
and ``w2`` row-wise; so a block costs two collectives forward and two backward. The embedding is split
along the vocabulary (row-wise) and so is the output head (column-wise): its logits stay sharded along
the vocabulary and the loss is computed on them with ``loss_parallel`` (no rank holds full logits).

Sequence parallelism (on by default): between the blocks' matmuls the residual stream and the norms
are sharded along the sequence (``Shard(1)``) instead of replicated, so their activations (and the
norms' work) are divided by tp; the all-reduces after ``wo`` and ``w2`` become reduce-scatters and
an all-gather before the next column-wise matmul: the same bytes. Without it the residual stream is
replicated and the norms are plain modules, each rank computing the same values.

The modules compute on local tensors (``use_local_output``): the attention reads its local head
counts from the projections' outputs, never from the config.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardtrain.errors import ConfigError
from shardtrain.models.dims import Dims, even_tensor_parallel_degrees


def check_tensor_parallel_dims(dims: Dims, tp: int) -> None:
    """Every split the plan makes must be even: one line naming the first size that is not."""
    if tp == 1:
        return
    sizes = (("model.n_heads", dims.n_heads, "query heads"),
             ("model.n_kv_heads", dims.n_kv_heads, "key/value heads"),
             ("model.ffn_hidden_dim", dims.ffn_hidden_dim, "the feed-forward width"),
             ("model.vocab_size", dims.vocab_size, "the vocabulary"))
    for key, size, what in sizes:
        if size % tp:
            # A preset model's sizes are given: the degrees it takes come first.
            degrees = even_tensor_parallel_degrees([s for _, s, _ in sizes], tp)
            fix = f"pad model.vocab_size to a multiple of {tp}" if key == "model.vocab_size" else \
                f"set {key} to a multiple of {tp}"
            evenly = ", ".join(map(str, degrees))
            raise ConfigError(f"strategy.tensor_parallel={tp} must divide {what} ({key}={size}); this "
                              f"model splits evenly at strategy.tensor_parallel={evenly}, or {fix}")


def check_sequence_split(length: int, tp: int, what: str = "trainer.seq_len") -> None:
    """Sequence parallelism splits every sequence into ``tp`` equal slices: the blocks hand the
    residual stream on as local tensors, and each norm rebuilds the whole from its slice's length
    times ``tp``, so an uneven split desynchronises the ranks' collectives (gloo aborts, NCCL may
    hang) instead of failing."""
    if tp > 1 and length % tp:
        raise ConfigError(f"{what}={length} must be a multiple of strategy.tensor_parallel={tp} with "
                          "sequence parallelism (the built-in Llama splits each sequence evenly); "
                          f"use a length that is a multiple of {tp} or set strategy.sequence_parallel=false")


def llama_tensor_parallel_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan, module path to style (``layers.*`` for every block), for ``parallelize_module``;
    the memory planner reads which dimension of each weight it splits from the same plan."""
    # Where the residual stream lives between the matmuls: sharded along the sequence, or whole.
    stream = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        # DTensor logits sharded along the vocabulary, for loss_parallel.
        "output": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
    }
    # The attention's inputs (x, rope, cache, layer, mask): only x is laid out; rope and the mask
    # cover the whole sequence, which every rank sees after the all-gather.
    rest = (None,) * 4
    block: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=stream),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=stream),
    }
    if sequence_parallel:
        block |= {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), *rest),
                                            desired_input_layouts=(Replicate(), *rest)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
        }
    return plan | {f"layers.*.{path}": style for path, style in block.items()}


def parallelize_llama(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Apply the plan in place (on the meta device or real weights; before ``fully_shard``)."""
    check_tensor_parallel_dims(model.dims, tp_mesh.size())
    parallelize_module(model, tp_mesh, llama_tensor_parallel_plan(sequence_parallel))
    if sequence_parallel:
        # Tasks that feed the built-in Llama their own lengths meet the check here, on every rank
        # of the group alike (they see the same batch), before the first collective.
        tp = tp_mesh.size()
        def check_batch(_: nn.Module, args: tuple, kwargs: dict) -> None:
            tokens = args[0] if args else kwargs["tokens"]
            check_sequence_split(tokens.shape[1], tp, "a batch's sequence length")

        model.register_forward_pre_hook(check_batch, with_kwargs=True)
    if model.cfg.tie_embeddings:
        # Each style distributed its module's weight into a parameter of its own; both split the
        # vocabulary rows (Shard(0)), so the head takes the embedding's again.
        model.output.weight = model.tok_embeddings.weight
