"""A sharded, initialised model from a factory, in the one order that is correct.

Build on meta -> checkpoint blocks -> ``fully_shard`` every unit bottom-up, then the root ->
``to_empty`` on the real device -> initialise every parameter so that every world size and strategy
starts from identical weights. Training, generation and evaluation all build their model here.

Initialisation draws a parameter as fixed-size chunks of its flattened elements, each chunk from its
own generator seeded by (seed, parameter name, chunk index). The values depend on the seed and the
chunk size only, never on the world size, and a rank draws just the chunks its shard overlaps: its
memory and time scale with its shard, not the model (a 70B model no longer needs every full weight on
every rank). This needs an initialiser that fills elements independently of the tensor's shape, which
a model declares with ``init_parameter_elementwise = True``, or per parameter with a method
``init_parameter_elementwise(name)`` (``model.name=hf`` computes a few small parameters whole, such
as Mamba's ``A_log``); other parameters get ``init_parameter`` called on full tensors, each seeded by
(seed, parameter name), the same on every rank (``models/initializer.py``). The initialiser is the
task's (a model the user did not change) or the model's own.

A caller that learns only after building whether every parameter will be read from a checkpoint
(the trainer finds its resume checkpoint once the optimizer exists) builds inside
``deferred_initialization`` and draws only when nothing was read: at 70B the draw is minutes of
start-up, thrown away by a resume.

Building "on meta" puts the parameters on the meta device but lets buffers be computed as the module
constructs them (sinusoidal or rotary tables, masks): they are restored after materialisation, so a
module the framework did not write needs no method of ours to recompute them. Tied parameters stay
one object throughout.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.nn.parameter import UninitializedParameter

from shardtrain.config.compose import check_qlora_combinations
from shardtrain.config.plan import DTYPES, ShardingPlan, check_base_dtype
from shardtrain.config.schema import Config
from shardtrain.distributed.env import DistEnv
from shardtrain.distributed.parallelize import ShardingReport, TensorPlan, parallelize, sum_gradients
from shardtrain.distributed.qlora import check_quantizable, stand_in_for_nf4, to_nf4_before_sharding
from shardtrain.errors import ConfigError, ModelError
from shardtrain.models.hf_directory import is_model_directory
from shardtrain.models.initializer import draws_elementwise, elementwise_constants
from shardtrain.models.lora import AdapterInitializer, add_adapters, base_name, is_adapter, store_base_in

log = logging.getLogger(__name__)

ModelFactory = Callable[[], nn.Module]
InitFn = Callable[[str, torch.Tensor, torch.Generator], None]


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``param``: this rank's slice as a DTensor, or ``full`` itself.

    src_data_rank=None: every rank already holds the same full tensor, so each keeps its own slice
    without any communication.
    """
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


# Elements per initialisation chunk. The weights depend on it: changing it changes every run's start.
INIT_CHUNK_ELEMENTS = 1 << 20


def stable_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def run_init(init: InitFn, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    """``init(name, tensor, generator)``, checked to have filled ``tensor`` in place: a hook that
    returns a new tensor, or passes over a name, would leave the uninitialised memory as the weights
    (it is given NaN, so that what it leaves is seen)."""
    tensor.fill_(float("nan"))
    returned = init(name, tensor, generator)
    owner = getattr(init, "__qualname__", "init_parameter")
    if not torch.isnan(tensor).any():
        return  # filled in place (what it returns, a view of it, say, does not matter)
    if isinstance(returned, torch.Tensor):
        raise ModelError(f"{owner} returned a new tensor for {name!r}; fill the tensor it is given in "
                         "place (tensor.normal_(0, 0.02, generator=generator), nn.init.*_(tensor)) and "
                         "return nothing")
    raise ModelError(f"{owner} left parameter {name!r} unfilled (or filled it with NaN); fill every "
                     "parameter it is called with, in place (pretrained weights: model.init_from)")


def fill_elements(init: InitFn, name: str, seed: int, out: torch.Tensor, start: int, total: int,
                  constants: Sequence[tuple[int, int, float]] = ()) -> None:
    """``out`` (1-D, fp32) := elements ``[start, start + len(out))`` of parameter ``name``'s flattened
    initial value (``total`` elements), drawing only the chunks that range overlaps; ``constants``:
    ``(begin, end, value)`` ranges set after the draw (``models/initializer.elementwise_constants``)."""
    end = start + out.numel()
    for index in range(start // INIT_CHUNK_ELEMENTS, -(-end // INIT_CHUNK_ELEMENTS)):
        low = index * INIT_CHUNK_ELEMENTS
        chunk = torch.empty(min(INIT_CHUNK_ELEMENTS, total - low), dtype=torch.float32)
        run_init(init, name, chunk, torch.Generator().manual_seed(stable_seed(seed, f"{name}#{index}")))
        first, last = max(start, low), min(end, low + chunk.numel())
        out[first - start:last - start] = chunk[first - low:last - low]
    for begin, stop, value in constants:
        if max(begin, start) < min(stop, end):
            out[max(begin, start) - start:min(stop, end) - start] = value


def init_full_parameter(initializer: Any, name: str, tensor: torch.Tensor, seed: int) -> None:
    """The full initial value of parameter ``name``, exactly as the sharded build gives it at any
    world size (for references and hand-written loops that start from the same weights);
    ``initializer``: the model or task whose ``init_parameter`` the build uses."""
    if draws_elementwise(initializer, name):
        flat = torch.empty(tensor.numel(), dtype=torch.float32)
        fill_elements(initializer.init_parameter, name, seed, flat, 0, tensor.numel(),
                      elementwise_constants(initializer, name))
        tensor.copy_(flat.view(tensor.shape))
    else:
        full = torch.empty(tensor.shape, dtype=torch.float32)
        generator = torch.Generator().manual_seed(stable_seed(seed, name))
        run_init(initializer.init_parameter, name, full, generator)
        tensor.copy_(full)


def _parameter_to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    if isinstance(param, UninitializedParameter):
        raise ModelError(f"{type(module).__name__} is a lazy module (its {name!r} has no shape until a first "
                         "forward), which cannot be sharded before it has run; build the model with its "
                         f"sizes given (nn.Linear(in, out) for nn.LazyLinear(out))")
    if param is None or param.device.type == "meta":
        return None  # already meta: the same object, so a tied parameter stays tied
    return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules constructed inside get their parameters on the meta device as they are registered
    (so the initialisers modules run after registration, like ``nn.Linear.reset_parameters``, run on
    meta, for free; a value computed before registration, ``nn.Parameter(torch.randn(...))``, is
    still computed) and their buffers computed for real (they are small, and only the module knows
    how to make them). A parameter tied by assigning it to a second attribute stays one object."""
    handle = register_module_parameter_registration_hook(_parameter_to_meta)
    try:
        yield
    finally:
        handle.remove()


def local_box(param: DTensor) -> tuple[list[int], list[int]]:
    """(global offsets, sizes) of the block of ``param`` this rank holds: FSDP's rows of it, and
    under tensor parallelism its rows or columns of the TP shard (FSDP shards a TP shard's rows
    again, a strided layout). DCP's own description of a DTensor's shard, which checkpoints rely on."""
    chunk = param.__create_chunk_list__()[0]
    return list(chunk.offsets), list(chunk.sizes)


def first_row(param: DTensor) -> int:
    """The first global row this rank holds of a parameter sharded along dim 0."""
    return local_box(param)[0][0] if param.ndim else 0


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers (RoPE tables and the like) to ``device``, parameters left where they are."""
    for name, buffer in list(model.named_buffers(remove_duplicate=False)):  # shared ones under each name
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, buffer.to(device))


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, cpu_offload: bool = False,
                initialize: bool = True, initializer: Any = None,
                select: Callable[[str], bool] | None = None) -> None:
    """Allocate the sharded parameters on ``device``, initialise them world-size-invariantly with
    ``initializer.init_parameter`` (default: the model's; ``initialize=False``: leave them
    uninitialised, for weights that are read next), and bring back the buffers: the model's own
    ``init_buffers`` recomputes them, else the values they had when constructed are restored.

    With CPU offload FSDP2 requires the sharded parameters in host memory before its first forward
    (it pins and keeps them there); buffers are not FSDP's and must be on the device that computes.
    """
    recompute = getattr(model, "init_buffers", None)
    constructed = {} if recompute is not None else {
        name: buffer.clone() for name, buffer in model.named_buffers(remove_duplicate=False)
        if buffer.device.type != "meta"}
    model.to_empty(device="cpu" if cpu_offload else device)
    if cpu_offload:
        move_buffers(model, device)
    if initialize:
        initialize_parameters(model, seed, initializer or model, select)
    if recompute is not None:
        recompute()
        return
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if name not in constructed:
            raise ModelError(f"buffer {name!r} of {type(model).__name__} was made on the meta device, so "
                             "its value is unknown after materialisation; build the model without a "
                             "torch.device('meta') context, or give it init_buffers()")
        buffer.copy_(constructed[name])


def initializer_of(task_or_model: Any) -> Any:
    """What initialises the parameters: an object with ``init_parameter``, else None."""
    return task_or_model if getattr(task_or_model, "init_parameter", None) is not None else None


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int, initializer: Any = None,
                          select: Callable[[str], bool] | None = None) -> None:
    """Every (sharded) parameter from ``initializer.init_parameter`` (default: the model's), each
    rank only its own part; ``select``: only the parameters whose names it accepts."""
    initializer = initializer or model
    if getattr(initializer, "init_parameter", None) is None:
        raise ModelError(
            f"{type(model).__name__} has no init_parameter(name, tensor, generator); "
            "build it with init_device='cpu' instead of meta"
        )
    for adapted_name, param in model.named_parameters():
        if select is not None and not select(adapted_name):
            continue
        name = base_name(adapted_name)  # a LoRA run's base draws what the plain run's does
        if not (isinstance(param, DTensor) and draws_elementwise(initializer, name)):
            full = torch.empty(param.shape, dtype=torch.float32)
            init_full_parameter(initializer, name, full, seed)
            param.copy_(shard_like(full.to(param.dtype), param))
            continue
        local = param.to_local()
        if param.ndim == 0:
            offsets, sizes = [0], [1]
        else:
            offsets, sizes = local_box(param)
        # The whole rows of the block are drawn (a contiguous range of the flattened parameter),
        # then its columns cut out: tp times the shard's elements for a column-split weight, never
        # more.
        row = math.prod(param.shape[1:])  # global shape: a rank's shard may have no rows
        values = torch.empty(sizes[0] * row, dtype=torch.float32)
        fill_elements(initializer.init_parameter, name, seed, values, offsets[0] * row, param.numel(),
                      elementwise_constants(initializer, name))
        block = values.view(sizes[0], *param.shape[1:])[
            (slice(None), *(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:], strict=True)))]
        local.copy_(block.reshape(local.shape).to(local.dtype))


class DeferredDraws:
    """The random initialisations ``deferred_initialization`` held back."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []

    def draw(self) -> None:
        """Initialise the held-back models, as their build would have."""
        while self.pending:
            self.pending.pop(0)()


_deferred: ContextVar[DeferredDraws | None] = ContextVar("deferred_draws", default=None)


@contextmanager
def deferred_initialization() -> Iterator[DeferredDraws]:
    """Models built inside are materialised (buffers computed) without their random draw; call
    ``draw()`` on what this yields when no checkpoint filled them."""
    draws = DeferredDraws()
    token = _deferred.set(draws)
    try:
        yield draws
    finally:
        _deferred.reset(token)


def with_adapters(factory: ModelFactory, cfg: Config, device: torch.device) -> ModelFactory:
    """``factory`` whose model gets LoRA adapters on a frozen base (``finetune.method``)."""
    method = cfg.finetune.method
    if method == "none":
        return factory
    if method == "qlora":
        refuse_with_qlora(cfg)
    if cfg.finetune.base_dtype != "fp32":
        base_dtype = DTYPES[cfg.finetune.base_dtype]
        return lambda: store_base_in(add_adapters(factory(), cfg.finetune), base_dtype)
    return lambda: add_adapters(factory(), cfg.finetune)


def refuse_with_qlora(cfg: Config) -> None:
    """What ``finetune.method=qlora``'s NF4 base does not combine with, in one line (also for a
    config built in code, which ``compose_config`` did not check)."""
    check_qlora_combinations(cfg)
    source = cfg.model.weights_source()
    # What else model.init_from may name: hf:DIR, a .safetensors file, or a Hugging Face directory
    # (its config file; read as model.name=hf reads model.path).
    dcp_checkpoint = (source and source != cfg.model.path and not source.startswith("hf:")
                      and not source.endswith(".safetensors")
                      and not is_model_directory(Path(source).expanduser()))
    if dcp_checkpoint:
        # DCP's reader assigns state dicts, which makes FSDP re-read the parameters before the NF4
        # base is in place
        raise ConfigError(f"finetune.method=qlora reads its base from a Hugging Face directory or a "
                          f".safetensors file, not the DCP checkpoint {source}; `shardtrain consolidate` it")


def nf4_conversion(model: nn.Module, cfg: Config,
                   plan: ShardingPlan) -> Callable[[nn.Module], set[nn.Parameter]] | None:
    """``finetune.method=qlora``: the base's linear weights to NF4 as FSDP shards them, after a check
    that their shards hold whole NF4 blocks (before minutes of reading weights)."""
    if cfg.finetune.method != "qlora":
        return None
    check_quantizable(model, plan.shard_group)
    return partial(to_nf4_before_sharding, shards=plan.shard_group)


def build_sharded_model(cfg: Config, env: DistEnv, plan: ShardingPlan, mesh: DeviceMesh,
                        factory: ModelFactory, wrap_policy: Sequence[str | type] | None = None,
                        initializer: Any = None,
                        tensor_plan: TensorPlan | None = None) -> tuple[nn.Module, ShardingReport]:
    """``initializer``: an object with ``init_parameter`` (a task's) used instead of the model's;
    ``tensor_plan``: a task's tensor-parallel plan, used instead of the model's.
    With ``finetune.method=lora`` the factory's model gets adapters before it is sharded."""
    # (a task's WrapPolicy kept as it is: it names its source)
    policy = wrap_policy if wrap_policy is not None else list(cfg.strategy.wrap_policy)
    check_base_dtype(cfg, plan.param_dtype)
    factory = with_adapters(factory, cfg, env.device)
    with parameters_on_meta():
        try:
            model = factory()
        except NotImplementedError as exc:
            if "meta tensor" not in str(exc):
                raise
            # torch's own advice (to_empty) is not the fix here: the move is.
            raise ModelError("the model was moved (.to(device), .cuda(), .cpu()) while it was being built: "
                             "build_model runs with parameters on the meta device and must return the model "
                             "unmoved; the framework places each rank's shard on its device") from exc
    initializer = initializer_of(initializer) or initializer_of(model)
    if initializer is not None and cfg.finetune.method != "none":
        initializer = AdapterInitializer(initializer, model)
    if initializer is not None:
        report = parallelize(model, mesh, plan, policy, tensor_plan, nf4_conversion(model, cfg, plan))
        # Weights that will be read (model.init_from, a Hugging Face model's own) need no drawing:
        # at 0.5B parameters that is most of the start-up.
        initialize = cfg.model.weights_source() is None
        # LoRA on read weights: the adapters are still drawn.
        select = None if initialize or cfg.finetune.method == "none" else is_adapter
        initialize = initialize or select is not None
        deferred = _deferred.get()
        if initialize and deferred is not None:
            deferred.pending.append(partial(initialize_parameters, model, cfg.trainer.seed, initializer,
                                            select))
            initialize = False
        qlora = cfg.finetune.method == "qlora"
        materialize(model, env.device, cfg.trainer.seed, plan.cpu_offload,
                    initialize=initialize and not qlora, initializer=initializer, select=select)
        if qlora:  # the base is drawn or read into plain stand-ins, then quantised (distributed/qlora.py)
            stand_in_for_nf4(model)
            if initialize:
                initialize_parameters(model, cfg.trainer.seed, initializer, select)
    else:
        if cfg.finetune.method == "qlora" and plan.size("dp_shard") > 1 and cfg.model.weights_source():
            # Built whole, it is quantised whole from its draw; weights read in afterwards land shard by
            # shard, and torchao re-quantises each shard alone (another base at each world size).
            raise ConfigError(f"finetune.method=qlora reads {type(model).__name__}'s base into NF4 shards, "
                              "which needs init_parameter(name, tensor, generator) (docs/tasks.md: the model "
                              "is then built on meta and its base quantised whole once read); add it, or "
                              "use finetune=lora")
        # Without a per-parameter initialiser there is no way to initialise shards independently
        # of the world size, so build the full model once on CPU (same seed on every rank).
        if env.is_main:  # every rank's would be the same line
            log.warning(
                "%s has no init_parameter(name, tensor, generator): building it in full on CPU on "
                "every rank before sharding (fine for small models; add init_parameter to build on "
                "the meta device)", type(model).__name__,
            )
        torch.manual_seed(cfg.trainer.seed)
        model = factory()
        report = parallelize(model, mesh, plan, policy, tensor_plan, nf4_conversion(model, cfg, plan))
        if plan.cpu_offload:
            move_buffers(model, env.device)
        else:
            model.to(env.device)
    sum_gradients(model, plan.reduce_unused_params)
    if cfg.strategy.compile:
        for name in report.units:
            if name != "<root>" and "+" not in name:
                model.get_submodule(name).compile()
    return model, report
