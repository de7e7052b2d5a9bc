"""The typed configuration schema: the single source of truth for every knob.

YAML presets (``presets/``) and ``key=value`` overrides only ever set fields declared here; anything
else is rejected before a process group exists (see ``shardtrain.config.loader``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The models ``model.name`` can select (built by shardtrain.models.registry).
BUILTIN_MODELS = ("llama",)
# Signals that mean "save and exit" (Slurm and Kubernetes send SIGTERM before killing).
DEFAULT_PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")


@dataclass
class ModelConfig:
    """A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention)."""

    name: str = "llama"
    vocab_size: int = 256  # byte-level tokens
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    # SwiGLU hidden size; 0 means round(8/3 * dim) up to a multiple of ``ffn_multiple_of``.
    ffn_hidden_dim: int = 0
    ffn_multiple_of: int = 32
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Start from these weights only (no optimizer or step): a shardtrain checkpoint directory or a
    # .safetensors file. null = random init.
    init_from: str | None = None


@dataclass
class StrategyConfig:
    """How the model is sharded. FSDP1 names are accepted and mapped onto FSDP2 (docs/fsdp1-mapping.md)."""

    # FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD | HYBRID_SHARD_ZERO2 (any case)
    sharding_strategy: str = "FULL_SHARD"
    # null: follow the strategy; true/false; or an int (reshard to that many ranks after forward)
    reshard_after_forward: Any = None
    # Hybrid strategies: ranks per shard group (0 = processes per node). Replicas = world / this.
    shard_group_size: int = 0
    # fp32 | bf16-mixed | bf16-pure
    mixed_precision: str = "fp32"
    # Explicit overrides of the preset's dtypes (null = from the preset): fp32 | bf16 | fp16
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    cpu_offload: bool = False
    # none | all | every_k (with activation_checkpointing_every)
    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = 2
    # Dotted class paths of the modules that become FSDP units. "auto": the model's own block classes.
    wrap_policy: list[str] = field(default_factory=lambda: ["auto"])
    compile: bool = False


@dataclass
class DataConfig:
    # stdlib: the running interpreter's standard library .py files | files: ``paths`` below
    source: str = "stdlib"
    paths: list[str] = field(default_factory=list)
    file_glob: str = "*.py"
    # Percentage of files (chosen by a hash of their relative path) held out for validation.
    val_percent: float = 5.0
    # Cap on bytes read (0 = everything); keeps tests and quick runs fast.
    max_bytes: int = 0


@dataclass
class TrainerConfig:
    max_steps: int = 300
    # Processes on this machine: an int, or "auto" (one per GPU; one on a CPU-only machine).
    devices: Any = "auto"
    num_nodes: int = 1
    micro_batch_size: int = 16
    grad_accum_steps: int = 1
    seq_len: int = 128
    seed: int = 1234
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip_norm: float = 1.0  # 0 disables clipping; the global norm is still computed and logged
    max_skipped_steps: int = 5  # consecutive non-finite steps tolerated before the run stops
    log_every: int = 10
    eval_every: int = 100
    eval_samples: int = 128  # validation windows, the same set at any world size
    sample_tokens: int = 200
    sample_prompt: str = "def "
    # Also sample every N steps during training (0 = only at the end); logged as kind=sample.
    sample_every: int = 0
    # CPU threads per process (0 = cores / local processes).
    threads_per_process: int = 0
    progress_bar: bool = True


@dataclass
class DistConfig:
    backend: str = "auto"  # auto | gloo | nccl
    # A step (or a collective) that takes longer than this stops the run on every rank.
    timeout_s: int = 300
    # The same bound for start-up and the first step, which include compilation and warm-up.
    startup_timeout_s: int = 600
    # TORCH_DISTRIBUTED_DEBUG: OFF | INFO | DETAIL
    debug: str = "OFF"
    # NCCL's collective flight recorder (dumped on timeout); ignored on gloo.
    flight_recorder: bool = False


@dataclass
class DiagnosticsConfig:
    enabled: bool = True
    # Steps whose per-phase memory is measured and logged.
    steps: int = 3
    # Build everything, print the report, run one step, exit.
    dry_run: bool = False
    # Dump every rank's Python stacks when a step takes this many times the recent median ...
    stall_factor: float = 10.0
    # ... and at least this long.
    stall_min_s: float = 30.0


@dataclass
class CheckpointConfig:
    enabled: bool = True
    # Save every N steps (0 = only at the end and on preemption). Written under run.dir/checkpoints.
    interval: int = 100
    # Complete checkpoints kept; older ones are deleted only after a newer one is complete.
    keep_last: int = 2
    # checkpoint.async on the command line: overlap the write with training.
    async_save: bool = False
    # auto: newest complete checkpoint in run.dir (if any) | none: start fresh | a path
    resume: str = "auto"
    # Also write model.safetensors (full weights, gathered on rank 0 with CPU offload).
    save_full: bool = False
    preemption_signals: list[str] = field(default_factory=lambda: list(DEFAULT_PREEMPTION_SIGNALS))


@dataclass
class RunConfig:
    dir: str = "runs/default"
    name: str = "shardtrain"
    tensorboard: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    run: RunConfig = field(default_factory=RunConfig)
