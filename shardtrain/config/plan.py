"""Resolve a config (FSDP1 vocabulary welcome) into what FSDP2 and torchrun will be asked to do.

Pure functions of the config and the world: the launch shape (processes per node, world size), the
mesh shape, reshard policy and dtypes. Unit-testable, and the ``plan`` and diagnostics commands can
show them without starting any process group. This module is the one home of the torch dtype table
and how a mesh is described; the names it resolves (strategies, precision presets) are ``strategy``'s,
checked there without torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from shardtrain.accelerator import accelerator_count, default_precision
from shardtrain.config.schema import Config, StrategyConfig
from shardtrain.config.strategy import (
    DTYPE_NAMES,
    PRECISION_PRESETS,
    STRATEGIES,
    check_compute_dtype,
    checkpointing_mode,
    devices_count,
    normalize_strategy_name,
    precision_preset,
    reshard_setting,
)
from shardtrain.errors import ConfigError, LayoutError

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


def dtype_name(dtype: torch.dtype | str) -> str:
    """'float32', 'bfloat16', ...: how every report and file names a dtype."""
    return str(dtype).replace("torch.", "")


def describe_mesh(dim_names: list[str] | tuple[str, ...], shape: list[int] | tuple[int, ...]) -> str:
    """'dp_replicate=2 x dp_shard=4'."""
    return " x ".join(f"{n}={s}" for n, s in zip(dim_names, shape, strict=True))


@dataclass(frozen=True)
class ShardingPlan:
    strategy: str
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    reshard_after_forward: bool | int
    storage_dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    cpu_offload: bool
    activation_checkpointing: str
    activation_checkpointing_every: int
    grad_accumulation: str = "sharded"  # sharded | unsharded (see StrategyConfig)
    precision: str = "fp32"  # the mixed-precision preset, with auto resolved
    float8: bool = False  # strategy.float8: blocks' linears in float8 (gathered in float8: gathers_float8)
    sequence_parallel: bool = False  # only with a tp dimension
    embedding_lookup: str = "gather"  # strategy.embedding_lookup: exchange | gather
    reduce_unused_params: bool = False  # strategy.reduce_unused_params

    def size(self, dim_name: str) -> int:
        """The size of mesh dimension ``dim_name`` (1 where the mesh has none)."""
        names = self.mesh_dim_names
        return self.mesh_shape[names.index(dim_name)] if dim_name in names else 1

    @property
    def tensor_parallel(self) -> int:
        return self.size("tp")

    @property
    def shard_group(self) -> int:
        """Ranks that FSDP shards each parameter over."""
        return self.size("dp_shard")

    @property
    def gathers_float8(self) -> bool:
        """Whether FSDP gathers strategy.float8's weights in float8: only where it shards them over
        more than one rank (torchtitan's choice too). With one rank a shard group there are no bytes
        to halve, and the cast before each gather is host work outside the compiled blocks, one
        weight at a time; gathered in the compute dtype, each weight is cast inside its compiled
        block, fused (benchmarks/float8_host_ops.py: a compiled step then dispatches no more
        operators than without float8)."""
        return self.float8 and self.shard_group > 1

    @property
    def data_parallel_dims(self) -> tuple[str, ...]:
        """The mesh dimensions FSDP runs over (every one but tp)."""
        return tuple(name for name in self.mesh_dim_names if name != "tp")

    def checkpointed(self, block_index: int) -> bool:
        if self.activation_checkpointing in ("all", "selective"):
            return True
        if self.activation_checkpointing == "every_k":
            return block_index % self.activation_checkpointing_every == 0
        return False

    @property
    def mesh(self) -> str:
        return describe_mesh(self.mesh_dim_names, self.mesh_shape)

    def describe(self) -> str:
        ac = self.activation_checkpointing
        if ac == "selective":
            ac = "selective (attention and every second matmul's outputs kept)"
        if ac == "every_k":
            ac = f"every {self.activation_checkpointing_every} blocks"
        gathered = "float8" if self.gathers_float8 else dtype_name(self.param_dtype)
        return (
            f"{self.strategy}: mesh [{self.mesh}], reshard_after_forward={self.reshard_after_forward}, "
            f"storage={dtype_name(self.storage_dtype)} compute={dtype_name(self.param_dtype)} "
            f"reduce={dtype_name(self.reduce_dtype)}, cpu_offload={self.cpu_offload}, "
            f"activation_checkpointing={ac}, grad_accumulation={self.grad_accumulation}"
            + (f", float8 linears gathered in {gathered}" if self.float8 else "")
        )


def resolve_precision(name: str, accelerated: bool | None = None) -> str:
    """The mixed-precision preset ``strategy.mixed_precision`` names; ``auto`` is bf16-mixed on
    accelerators (``accelerated``; None: this machine's devices) and fp32 on CPUs."""
    preset = precision_preset(name)
    if preset == "auto":
        preset = default_precision() if accelerated is None else ("bf16-mixed" if accelerated else "fp32")
    return preset


def planned_param_dtype(cfg: StrategyConfig, accelerated: bool | None = None) -> torch.dtype:
    """The compute dtype the strategy section gives, whatever the world size."""
    _, param, _ = PRECISION_PRESETS[resolve_precision(cfg.mixed_precision, accelerated)]
    return DTYPES[check_compute_dtype("param_dtype", cfg.param_dtype or param)]


def check_base_dtype(cfg: Config, param_dtype: torch.dtype) -> None:
    """A LoRA base stored in bf16 is read by a bf16 computation only."""
    if cfg.finetune.method != "none" and cfg.finetune.base_dtype == "bf16" and param_dtype != torch.bfloat16:
        raise ConfigError(f"finetune.base_dtype=bf16 needs a bf16 compute dtype (this run computes in "
                          f"{dtype_name(param_dtype)}, which cannot read a bf16 weight); set "
                          "strategy.mixed_precision=bf16-mixed or finetune.base_dtype=fp32")


def resolve_plan(cfg: StrategyConfig, world_size: int, local_world_size: int,
                 accelerated: bool | None = None) -> ShardingPlan:
    """``accelerated``: what ``mixed_precision=auto`` plans for (None: this machine's devices).

    With ``tensor_parallel`` > 1 the mesh gains an innermost ``tp`` dimension (neighbouring ranks,
    so that a group stays inside a node) and the data-parallel dimensions share world / tp ranks."""
    strategy = normalize_strategy_name(cfg.sharding_strategy)
    hybrid, reshard = STRATEGIES[strategy]
    tp = check_tensor_parallel_layout(cfg, world_size, local_world_size)
    dp_world, dp_per_node = world_size // tp, max(1, local_world_size // tp)

    if strategy == "NO_SHARD":
        mesh_shape: tuple[int, ...] = (dp_world, 1)
    elif hybrid:
        shard = cfg.shard_group_size or dp_per_node
        if shard <= 0 or dp_world % shard:
            what = "the world size" if tp == 1 else "the data-parallel ranks (world / tensor_parallel)"
            raise LayoutError(
                f"strategy.shard_group_size={shard} must divide {what} {dp_world} "
                f"for {strategy}; set strategy.shard_group_size to a divisor of {dp_world}"
            )
        mesh_shape = (dp_world // shard, shard)
    else:
        mesh_shape = (dp_world,)
    names: tuple[str, ...] = ("dp_replicate", "dp_shard") if len(mesh_shape) == 2 else ("dp_shard",)
    if tp > 1:
        mesh_shape, names = (*mesh_shape, tp), (*names, "tp")
    shard_group = mesh_shape[names.index("dp_shard")]

    raf = reshard_setting(cfg.reshard_after_forward)
    if raf is None:
        reshard_after_forward: bool | int = reshard
    elif isinstance(raf, bool):
        reshard_after_forward = raf
    elif raf == shard_group:  # k equal to the group is true (a group of 1 too: found by review)
        reshard_after_forward = True
    else:
        # No divisor between 1 and a group of 1-2 ranks: the error named an impossible fix.
        if shard_group <= 2:
            raise LayoutError(
                f"strategy.reshard_after_forward={raf}: the shard group has {shard_group} rank"
                f"{'s' if shard_group > 1 else ''}, so no smaller group exists to reshard to; use true or "
                "false (or leave it unset)")
        if raf == 1 or shard_group % raf:
            raise LayoutError(
                f"strategy.reshard_after_forward={raf} must be a divisor of the shard group size "
                f"{shard_group} other than 1 (or true/false)"
            )
        if tp > 1:
            # FSDP2 refuses it at the first forward (NotImplementedError: resharding to a smaller
            # mesh is not supported for DTensor parameters), after a launch and a build.
            raise ConfigError(
                f"strategy.reshard_after_forward={raf} with strategy.tensor_parallel={tp}: FSDP2 cannot "
                "reshard tensor-parallel (DTensor) parameters to a smaller group; use true or false")
        if cfg.float8:
            # Nor a parameter that brings its own all-gather (float8's): a bare NotImplementedError in
            # the first backward (torch 2.13; found by review)
            raise ConfigError(
                f"strategy.reshard_after_forward={raf} with strategy.float8=true: FSDP2 cannot reshard "
                "float8-gathered weights to a smaller group; use true or false")
        reshard_after_forward = raf

    preset = resolve_precision(cfg.mixed_precision, accelerated)
    storage, param, reduce = PRECISION_PRESETS[preset]
    param = check_compute_dtype("param_dtype", cfg.param_dtype or param)
    reduce = check_compute_dtype("reduce_dtype", cfg.reduce_dtype or reduce)
    ac = checkpointing_mode(cfg)

    return ShardingPlan(
        strategy=strategy,
        mesh_shape=mesh_shape,
        mesh_dim_names=names,
        reshard_after_forward=reshard_after_forward,
        storage_dtype=DTYPES[storage],
        param_dtype=DTYPES[param],
        reduce_dtype=DTYPES[reduce],
        cpu_offload=cfg.cpu_offload,
        activation_checkpointing=ac,
        activation_checkpointing_every=cfg.activation_checkpointing_every,
        grad_accumulation=resolve_accumulation(cfg.grad_accumulation, shard_group),
        precision=preset,
        float8=cfg.float8,
        sequence_parallel=tp > 1 and cfg.sequence_parallel,
        embedding_lookup=cfg.embedding_lookup,
        reduce_unused_params=cfg.reduce_unused_params,
    )


def check_tensor_parallel_layout(cfg: StrategyConfig, world_size: int, local_world_size: int) -> int:
    """The tensor-parallel degree, if the world and the nodes can hold it (one line otherwise)."""
    tp = cfg.tensor_parallel
    if tp == 1:
        return tp
    check_tensor_parallel_divides(tp, world_size)
    check_tensor_parallel_in_nodes(cfg, local_world_size)
    return tp


def check_tensor_parallel_divides(tp: int, world_size: int) -> None:
    """The world is data-parallel ranks x ``tp`` (one line otherwise)."""
    if world_size % tp:
        raise LayoutError(f"strategy.tensor_parallel={tp} must divide the world size {world_size} "
                          "(world = data-parallel ranks x tensor_parallel); choose a divisor of "
                          f"{world_size}")


def check_tensor_parallel_in_nodes(cfg: StrategyConfig, local_world_size: int) -> None:
    """A tensor-parallel group stays inside a node of ``local_world_size`` processes (whatever the
    world size: ``plan --world-sizes`` checks this once)."""
    tp = cfg.tensor_parallel
    if tp > local_world_size and not cfg.tensor_parallel_across_nodes:
        raise LayoutError(f"strategy.tensor_parallel={tp} is larger than the {local_world_size} "
                          "processes of a node: its collectives (several per layer) would cross nodes; "
                          "use at most the GPUs of a node, or set "
                          "strategy.tensor_parallel_across_nodes=true to force it")
    if local_world_size % tp and tp < local_world_size:
        raise LayoutError(f"strategy.tensor_parallel={tp} must divide the {local_world_size} processes "
                          "of a node, so that no tensor-parallel group straddles two nodes; choose a "
                          f"divisor of {local_world_size}")


def resolve_accumulation(choice: str, shard_group: int) -> str:
    """auto: sharded whenever there is something to reduce-scatter. Holding full-size gradients
    between micro-batches (about 4 bytes a parameter on every rank) defeats the sharding the run
    asked for; with a shard group of one (NO_SHARD, one rank) gradients are whole anyway, and one
    all-reduce per step is the cheaper choice (DDP's no_sync)."""
    if choice != "auto":
        return choice
    return "sharded" if shard_group > 1 else "unsharded"


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-batches per step that make ``global_batch`` sequences from ``micro_batch`` per rank on
    ``world_size`` data-parallel ranks (``trainer.global_batch_size``)."""
    per_micro_step = micro_batch * world_size
    if global_batch % per_micro_step:
        raise ConfigError(
            f"trainer.global_batch_size={global_batch} is not a multiple of trainer.micro_batch_size="
            f"{micro_batch} x {world_size} ranks = {per_micro_step}; choose a global batch that is, "
            "or another micro-batch size")
    return global_batch // per_micro_step


def check_auto_global_batch(global_batch: int, data_parallel: int) -> None:
    """``micro_batch_size=auto`` splits ``global_batch`` evenly over the data-parallel ranks."""
    if global_batch <= 0 or global_batch % data_parallel:
        raise ConfigError(f"trainer.micro_batch_size=auto: trainer.global_batch_size={global_batch} "
                          f"does not divide over {data_parallel} data-parallel ranks; choose a positive "
                          f"multiple of {data_parallel}")


def with_global_batch(cfg: Config, world_size: int) -> Config:
    """``cfg`` with the accumulation steps its ``trainer.global_batch_size`` gives at ``world_size``
    (as ``train.batch_size.resolve_batch`` sets them at start-up; a ``ConfigError`` where the
    global batch does not divide, or where ``trainer.grad_accum_steps`` says otherwise), unchanged
    without a global batch size."""
    t = cfg.trainer
    if not t.global_batch_size:
        return cfg
    tp = cfg.strategy.tensor_parallel
    check_tensor_parallel_divides(tp, world_size)  # else a division by no data-parallel rank below
    data_parallel = world_size // tp
    if t.micro_batch_size == "auto":  # chosen at start-up; the split over the ranks is known now
        check_auto_global_batch(t.global_batch_size, data_parallel)
        return cfg
    steps = accumulation_steps(t.global_batch_size, t.micro_batch_size, data_parallel)
    if t.grad_accum_steps not in (1, steps):
        raise ConfigError(f"trainer.grad_accum_steps={t.grad_accum_steps} contradicts trainer."
                          f"global_batch_size={t.global_batch_size} ({steps} micro-batches of "
                          f"{t.micro_batch_size} on {data_parallel} data-parallel ranks); set one of them")
    return replace(cfg, trainer=replace(t, grad_accum_steps=steps))


def launch_shape(cfg: Config) -> tuple[int, int]:
    """(processes per node, world size) the config asks for.

    ``trainer.devices=auto`` follows torchrun when running under it, else one process per
    accelerator (one on a CPU-only machine).
    """
    per_node = devices_count(cfg.trainer.devices)
    if per_node is None:
        # Processes started by hand (RANK, LOCAL_RANK, WORLD_SIZE) are one node's unless
        # LOCAL_WORLD_SIZE says otherwise, as the started world is counted (cli/launch.py).
        started = os.environ.get("LOCAL_WORLD_SIZE") or (
            os.environ.get("WORLD_SIZE") if "LOCAL_RANK" in os.environ else None)
        per_node = int(started or 0) or max(1, accelerator_count())
    return per_node, per_node * cfg.trainer.num_nodes


def check_world(cfg: Config, world_size: int, local_world_size: int) -> None:
    """The world that was started (by torchrun, or a process group) must be the one configured."""
    per_node, world = launch_shape(cfg)
    if (local_world_size, world_size) != (per_node, world):
        raise ConfigError(
            f"{world_size} {'process was' if world_size == 1 else 'processes were'} started, "
            f"{local_world_size} per node, but the config asks "
            f"for trainer.devices={cfg.trainer.devices} per node x trainer.num_nodes="
            f"{cfg.trainer.num_nodes}; make them agree (trainer.devices=auto follows torchrun, "
            "torchrun --nproc-per-node N starts N per node)"
        )


def check_tensor_parallel_support(cfg: Config) -> None:
    """What tensor parallelism does not cover yet, refused in one line rather than run wrongly."""
    tp = cfg.strategy.tensor_parallel
    if tp == 1:
        return
    # Both model.name=llama and hf carry plans (the built-in's; the one transformers declares,
    # checked against the model by the preflight); a task brings its own or its model's.
    if cfg.strategy.compile:
        # Measured (docs/parallelism.md): compiled tensor-parallel blocks train without graph breaks
        # but their gradients go wrong from the second step (torch 2.13, gloo).
        raise ConfigError("strategy.compile=true with strategy.tensor_parallel > 1 gives wrong gradients "
                          "from the second step with torch 2.13 (docs/parallelism.md); "
                          "set strategy.compile=false or strategy.tensor_parallel=1")
    if cfg.trainer.loss_chunk_tokens not in (0, "auto"):
        raise ConfigError(f"trainer.loss_chunk_tokens={cfg.trainer.loss_chunk_tokens} (the chunked loss) "
                          "does not take vocabulary-sharded logits; with strategy.tensor_parallel > 1 "
                          "set trainer.loss_chunk_tokens=0 or auto (the loss runs on the sharded logits)")
    not_yet = {"strategy.float8=true": cfg.strategy.float8,
               f"finetune.method={cfg.finetune.method}": cfg.finetune.method != "none"}
    for setting, asked in not_yet.items():
        if asked:
            raise ConfigError(f"{setting} with strategy.tensor_parallel={tp} is not built yet; "
                              "use one or the other")

