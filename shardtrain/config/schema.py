"""The typed configuration schema: the single source of truth for every knob.

YAML presets (``presets/``) and ``key=value`` overrides only ever set fields declared here; anything
else is rejected before a process group exists (see ``shardtrain.config.compose``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

# The models ``model.name`` can select (built by shardtrain.models.registry): the built-in Llama, or
# any local Hugging Face transformers causal LM (``model.path``).
BUILTIN_MODELS = ("llama", "hf")
# Signals that mean "save and exit" (Slurm and Kubernetes send SIGTERM before killing).
DEFAULT_PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
# The longest timeout any key takes: 100 days (a larger one overflowed timedelta, a traceback).
LONGEST_WAIT_S = 100 * 24 * 3600


def knob(default: Any, *, at_least: float | None = None, above: float | None = None,
         at_most: float | None = None, one_of: tuple[str, ...] | None = None, or_auto: bool = False) -> Any:
    """A field and the values it accepts, beside it: ``compose.check_ranges`` enforces them.
    ``or_auto``: also the string "auto" (the framework chooses; the field is typed Any, its other
    values whole numbers)."""
    bounds = {"at_least": at_least, "above": above, "at_most": at_most, "one_of": one_of,
              "or_auto": or_auto or None}
    return field(default=default, metadata={k: v for k, v in bounds.items() if v is not None})


@dataclass
class ModelConfig:
    """llama: the built-in Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention),
    shaped by the fields below. hf: a Hugging Face causal LM, shaped by ``path``'s config.json (the
    Llama fields are then unused)."""

    name: str = knob("llama", one_of=BUILTIN_MODELS)
    # name=hf: a local model directory (config.json, safetensors weights, tokenizer.json). Never
    # downloaded.
    path: str | None = None
    # name=hf: start from the weights in ``path`` (false: random weights from its config, to pretrain).
    pretrained: bool = True
    # auto: the model's own (name=hf: ``path``'s tokenizer.json; llama: bytes) | bytes | a
    # tokenizer.json file or a directory holding one.
    tokenizer: str = "auto"
    vocab_size: int = knob(256, at_least=1)  # 256 = byte-level tokens
    dim: int = knob(256, at_least=1)  # hidden size
    n_layers: int = knob(4, at_least=1)
    n_heads: int = knob(4, at_least=1)  # query heads; dim / n_heads is the head size
    n_kv_heads: int = knob(2, at_least=1)  # key/value heads (grouped-query attention)
    # SwiGLU hidden size; 0 means round(8/3 * dim) up to a multiple of ``ffn_multiple_of``.
    ffn_hidden_dim: int = knob(0, at_least=0)
    ffn_multiple_of: int = knob(32, at_least=1)
    max_seq_len: int = knob(1024, at_least=1)  # RoPE tables and the KV cache are this long
    rope_theta: float = knob(10000.0, above=0)
    norm_eps: float = knob(1e-5, above=0)  # RMSNorm epsilon
    tie_embeddings: bool = False
    # The norms and SwiGLU as autograd functions that keep less for backward (models/lean_ops.py:
    # 47-54% fewer activation bytes a block, same values); false: plain autograd's layers.
    lean_layers: bool = True
    init_std: float = knob(0.02, at_least=0)  # residual projections use std / sqrt(2 * n_layers)
    # Start from these weights only (no optimizer or step): a shardtrain checkpoint directory or a
    # .safetensors file. null = random init.
    init_from: str | None = None
    # finetune=lora: start the adapters from this PEFT adapter directory (adapter_config.json +
    # adapter_model.safetensors); it sets finetune.rank, alpha and targets (docs/finetuning.md).
    adapter: str | None = None

    def weights_source(self) -> str | None:
        """Where a fresh run's weights come from: ``init_from``, else a Hugging Face model's own
        directory (``pretrained``), else None (random initialisation)."""
        if self.init_from:
            return self.init_from
        if self.name == "hf" and self.pretrained:
            return self.path
        return None


@dataclass
class StrategyConfig:
    """How the model is sharded. FSDP1 names are accepted and mapped onto FSDP2 (docs/fsdp1-mapping.md)."""

    # FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD | HYBRID_SHARD_ZERO2 (any case)
    sharding_strategy: str = "FULL_SHARD"
    # null: follow the strategy; true/false; or an int (reshard to that many ranks after forward)
    reshard_after_forward: Any = None
    # Hybrid strategies: ranks per shard group (0 = processes per node). Replicas = world / this.
    shard_group_size: int = knob(0, at_least=0)
    # auto (bf16-mixed on accelerators with bf16 units, fp32 on CPUs) | fp32 | bf16-mixed | bf16-pure
    mixed_precision: str = "auto"
    # fp32 matmuls on accelerators use TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation);
    # false: full fp32. CPUs always compute full fp32.
    tf32: bool = True
    # Explicit overrides of the preset's dtypes (null = from the preset): fp32 | bf16 (fp16: no loss scaling)
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    cpu_offload: bool = False
    # none | selective (per operation: keep matmul and attention outputs, recompute the rest) |
    # every_k (every k-th block in full, with activation_checkpointing_every) | all (every block in full)
    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = knob(2, at_least=1)
    # Dotted class paths of the modules that become FSDP units. "auto": the model's own block classes.
    wrap_policy: list[str] = field(default_factory=lambda: ["auto"])
    # With trainer.grad_accum_steps > 1: "sharded" reduce-scatters every micro-batch and holds only
    # sharded gradients (hybrid strategies all-reduce across replicas on the last one only);
    # "unsharded" communicates once per step but every rank holds full-size gradients in between
    # (FSDP1's no_sync). auto: sharded whenever the shard group has more than one rank.
    grad_accumulation: str = knob("auto", one_of=("auto", "sharded", "unsharded"))
    compile: bool = False
    # float8 matmuls in the blocks' linear layers, with float8 all-gathers of their weights where
    # they are sharded over more than one rank (torchao's float8 training, tensor-wise scaling;
    # ShardingPlan.gathers_float8); GPUs of compute capability 8.9 and up only
    # (H100, L4, ...); the output head keeps the compute dtype. Fast only with compile=true.
    float8: bool = False
    # How a unit holding one nn.Embedding alone meets its table: exchange (each rank fetches the rows
    # its tokens read from the ranks that own them, all-to-all, and sends their gradients back: the
    # table is never gathered) | gather (FSDP gathers the whole table and reduce-scatters its whole
    # gradient). Tied embeddings, tensor parallelism and cpu_offload always gather.
    embedding_lookup: str = knob("exchange", one_of=("exchange", "gather"))
    # Tensor parallelism: ranks per tensor-parallel group, the mesh's innermost ``tp`` dimension
    # (1 = none). The data-parallel dimensions get world / this; shard_group_size then counts
    # data-parallel ranks.
    tensor_parallel: int = knob(1, at_least=1)
    # With tensor_parallel > 1: the norms and the residual stream sharded along the sequence too.
    sequence_parallel: bool = True
    # Allow a tensor-parallel group larger than the processes of a node (its collectives then cross
    # the inter-node network every layer).
    tensor_parallel_across_nodes: bool = False
    # Ranks may use different parameters in one step (a module inside a unit that only some
    # micro-batches run: an image projection, experts no token reached): every rank then reduces a
    # gradient for each trainable parameter, zeros where its step used none, so the reduce-scatter
    # matches (torch's set_reduce_scatter_unused_params). A parameter no rank used in a step then
    # gets a zero gradient, which AdamW steps (momentum, weight decay) where plain PyTorch skips it.
    # Without it such a step fails (gloo: "Received data size doesn't match"; NCCL may hang).
    reduce_unused_params: bool = False


def mixture_weights_valid(weights: Any, datasets: int) -> bool:
    """Whether ``weights`` give each of ``datasets`` datasets one positive, finite weight, their sum
    finite too (an infinite weight made every dataset's share NaN, drawn 1:1)."""
    # numbers.Real: a mixture built in code may weigh by NumPy's numbers (found by review)
    return (len(weights) == datasets
            and all(isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w)
                    and w > 0 for w in weights)
            and math.isfinite(sum(weights)))


def val_percent_problem(val_percent: float) -> str | None:
    """Why ``val_percent`` is not a share ``is_validation`` holds out as asked (it holds out whole
    hundredths of a percent: 0.001 held out ten times that, without a word; found by review)."""
    hundredths = round(val_percent * 100, 6)
    if 0 <= hundredths <= 10_000 and hundredths == int(hundredths):
        return None
    if not 0 <= val_percent <= 100:
        return f"the validation share {val_percent:g}% must be between 0 and 100"
    return (f"the validation share {val_percent:g}% is not a whole number of hundredths of a percent (a "
            f"document's key is hashed into one of 10,000 buckets): it would hold out "
            f"{math.ceil(hundredths) / 100:g}%; give a multiple of 0.01, or 0")


@dataclass
class DataConfig:
    # stdlib: the running interpreter's standard library .py files | files: ``paths`` below (text
    # files, directories, .jsonl(.gz), .parquet, save_to_disk directories) | prepared: ``paths`` is
    # one directory written by ``shardtrain prepare``. stdlib and files are prepared into the cache.
    source: str = knob("stdlib", one_of=("stdlib", "files", "prepared"))
    paths: list[str] = field(default_factory=list)
    file_glob: str = "*.py"
    # Percentage of files (chosen by a hash of their relative path) held out for validation.
    val_percent: float = knob(5.0, at_least=0.0, at_most=100.0)
    # Cap on bytes read (0 = everything); keeps tests and quick runs fast.
    max_bytes: int = knob(0, at_least=0)
    # JSON Lines field / Parquet or Arrow column holding the text (source=files).
    text_field: str = "text"
    # source=prepared with several paths: a mixture, each dataset drawn in proportion to its weight
    # ([] = in proportion to their sizes).
    weights: list[float] = field(default_factory=list)
    # Where stdlib and files sources are prepared once and reused (auto: ~/.cache/shardtrain/prepared,
    # or $XDG_CACHE_HOME/shardtrain/prepared).
    cache_dir: str = "auto"
    # Packed windows hold several documents: true keeps attention inside each document and restarts
    # positions at each (the losses are those of the documents run alone); false lets tokens attend
    # across document boundaries, as most pretraining does.
    document_mask: bool = False
    # How documents become windows: stream (the token stream cut every trainer.seq_len tokens, a
    # document running on into the next window) | records (windows of whole documents, padded:
    # a fine-tuning record never loses its prompt to the window before) | auto (records for data
    # with fine-tuning records, whose prompts are no targets; stream otherwise).
    packing: str = knob("auto", one_of=("auto", "stream", "records"))


@dataclass
class TrainerConfig:
    max_steps: int = knob(300, at_least=1)
    # Processes on this machine: an int, or "auto" (one per GPU; one on a CPU-only machine).
    devices: Any = "auto"
    num_nodes: int = knob(1, at_least=1)
    # Sequences per rank per micro-step, or "auto" (needs global_batch_size): the largest that the
    # memory planner says fits memory_limit_gib less memory_margin, with the cheapest activation
    # checkpointing from strategy.activation_checkpointing up (none < selective < every_k < all).
    micro_batch_size: Any = knob(16, at_least=1, or_auto=True)
    # Micro-batches per optimizer step. With global_batch_size set it follows from it (1 or that).
    grad_accum_steps: int = knob(1, at_least=1)
    # Sequences per optimizer step over all ranks (0: micro_batch_size x grad_accum_steps x ranks).
    # Set, it must be a multiple of micro_batch_size x ranks, and grad_accum_steps is derived.
    global_batch_size: int = knob(0, at_least=0)
    # micro_batch_size=auto plans against this much memory per process (0: the accelerator's total
    # memory; on a CPU this process's share of the host's available memory).
    memory_limit_gib: float = knob(0.0, at_least=0)
    # ... less this fraction of it, for what the planner does not count (allocator fragmentation,
    # the CUDA context, kernels' workspaces).
    memory_margin: float = knob(0.1, at_least=0.0, at_most=0.9)
    seq_len: int = knob(128, at_least=1)  # tokens per training window
    # The built-in task's output head and loss chunk by chunk, this many tokens at a time, never the
    # full fp32 logits (tasks/losses.py); 0 = the plain full-logits loss; auto = chunks of 256 where
    # the vocabulary has at least 32,000 tokens, else plain (docs/benchmarks.md, "Chunked loss":
    # 1.16x the plain loss's tokens/s at 32k with 59% less step memory; at the default 256-token
    # vocabulary 0.97x-1.06x, within the scatter, so it stays plain).
    loss_chunk_tokens: Any = knob("auto", at_least=0, or_auto=True)
    # weights and data order; the same at any world size. At most 2^63 - 1: torch's and the data
    # order's generators take 64 bits, and mixtures add an offset per dataset.
    seed: int = knob(1234, at_least=0, at_most=2**63 - 1)
    # Deterministic kernels, so two runs on the same hardware and world size match bit for bit on
    # accelerators too (a CPU's already do): torch.use_deterministic_algorithms(True) (an operation
    # without a deterministic kernel then stops the run, naming itself), cuDNN's deterministic
    # convolutions without autotuning, and cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG). Costs
    # speed where atomics-based kernels (scatter-add, some attention backwards) are replaced. Set for
    # the whole process, and left set.
    deterministic: bool = False
    lr: float = knob(3e-3, at_least=0)
    min_lr_ratio: float = knob(0.1, at_least=0.0, at_most=1.0)  # cosine floor, a fraction of lr
    warmup_steps: int = knob(30, at_least=0)  # linear warmup, then the decay to max_steps
    # The decay's shape, from lr to lr * min_lr_ratio at max_steps: cosine, linear, or sqrt (1 minus
    # the square root of the progress: steep first, as torchtitan's).
    lr_decay: str = knob("cosine", one_of=("cosine", "linear", "sqrt"))
    # The share of the steps after warmup that decay; before them the rate stays at lr
    # (warmup-stable-decay: with 0.1-0.2 a run is cheap to extend from a stable-phase checkpoint,
    # which has not decayed yet). 1.0: decay from the end of warmup.
    decay_fraction: float = knob(1.0, above=0.0, at_most=1.0)
    weight_decay: float = knob(0.1, at_least=0)  # not applied to norms, biases and embeddings
    beta1: float = knob(0.9, at_least=0.0, at_most=0.999999)
    beta2: float = knob(0.95, at_least=0.0, at_most=0.999999)
    adam_eps: float = knob(1e-8, above=0)
    # An exponential moving average of the weights, updated after every optimizer step (0: none):
    # average = ema_decay * average + (1 - ema_decay) * weights. Checkpoints carry it (ema.*);
    # `shardtrain consolidate CKPT OUT --key ema` writes it as the model's weights.
    ema_decay: float = knob(0.0, at_least=0.0, at_most=0.99999999)
    # The average's decay at step s is min(ema_decay, s / (9 + s)) (diffusers' EMAModel's ramp, 0.1
    # at step 1): without it the starting weights weigh in for about 1 / (1 - ema_decay) steps.
    ema_warmup: bool = False
    # AdamW's kernels: fused (one kernel per parameter group and device; skips a non-finite step on
    # the device, so the step's host read comes after the update) where torch has it for the
    # parameters' device, else foreach; or either by name.
    optimizer_kernel: str = knob("auto", one_of=("auto", "fused", "foreach"))
    # 0 disables clipping; the global norm is still computed and logged.
    grad_clip_norm: float = knob(1.0, at_least=0)
    max_skipped_steps: int = knob(5, at_least=0)  # consecutive non-finite steps before stopping
    # The validation value that decides the best checkpoints (checkpoint.keep_best) and early
    # stopping: val_loss, ema_val_loss (with ema_decay), or a task's metric as val_<name> /
    # ema_val_<name>; the best is its least (min) or its most (max).
    monitor: str = "val_loss"
    monitor_mode: str = knob("min", one_of=("min", "max"))
    # Stop when this many evaluations in a row have not improved monitor's best by more than
    # early_stop_min_delta (0: never).
    early_stop_patience: int = knob(0, at_least=0)
    early_stop_min_delta: float = knob(0.0, at_least=0.0)
    log_every: int = knob(10, at_least=1)
    eval_every: int = knob(100, at_least=0)  # 0 = only at the end
    eval_samples: int = knob(128, at_least=1)  # validation windows, the same set at any world size
    sample_tokens: int = knob(200, at_least=0)  # generated at the end of training (0 = none)
    sample_prompt: str = "def "
    # Also sample every N steps during training (0 = only at the end); logged as kind=sample.
    sample_every: int = knob(0, at_least=0)
    # CPU threads per process (0 = cores / local processes).
    threads_per_process: int = knob(0, at_least=0, at_most=4096)
    progress_bar: bool = True
    # Built-in launcher (trainer.devices=N): torchrun restarts the workers this many times after a
    # failure (a lost rank); each restart resumes from the newest complete checkpoint.
    max_restarts: int = knob(0, at_least=0)


@dataclass
class DistConfig:
    backend: str = knob("auto", one_of=("auto", "gloo", "nccl"))
    # A step (or a collective) that takes longer than this stops the run on every rank.
    timeout_s: int = knob(300, at_least=1, at_most=LONGEST_WAIT_S)
    # The same bound for start-up and the first step, which include compilation and warm-up.
    startup_timeout_s: int = knob(600, at_least=1, at_most=LONGEST_WAIT_S)
    # TORCH_DISTRIBUTED_DEBUG: OFF | INFO | DETAIL
    debug: str = knob("OFF", one_of=("OFF", "INFO", "DETAIL"))
    # The collective flight recorder (NCCL's, or torch's own on gloo), dumped to
    # run.dir/flight_recorder/ when the watchdog stops a hung run.
    flight_recorder: bool = False


@dataclass
class DiagnosticsConfig:
    enabled: bool = True
    # Steps whose per-phase memory is measured and logged.
    steps: int = knob(3, at_least=0)
    # Build everything, print the report, run one step, exit.
    dry_run: bool = False
    # Dump every rank's Python stacks when a step takes this many times the recent median ...
    stall_factor: float = knob(10.0, at_least=1)
    # ... and at least this long.
    stall_min_s: float = knob(30.0, at_least=0, at_most=LONGEST_WAIT_S)
    # Trace profile_steps steps from step profile_at with torch's profiler (0: never): each rank's
    # Chrome trace in run.dir/profiles/, the costliest operators in rank 0's log.
    profile_at: int = knob(0, at_least=0)
    profile_steps: int = knob(2, at_least=1)
    # With profile_at: the ranks that trace (empty: every rank). Each writes a trace of its own, up
    # to hundreds of MB for a large model: at hundreds of ranks, name a few.
    profile_ranks: list[int] = field(default_factory=list)
    # With profile_at, on CUDA: the caching allocator's history over those steps, a snapshot per
    # rank beside the traces (https://pytorch.org/memory_viz). Refused on other devices.
    memory_snapshot: bool = False


@dataclass
class CheckpointConfig:
    enabled: bool = True
    # Save every N steps (0 = only at the end, on preemption and when an evaluation ranks among
    # keep_best's). Written under run.dir/checkpoints.
    interval: int = knob(100, at_least=0)
    # Complete checkpoints kept; older ones are deleted only after a newer one is complete.
    keep_last: int = knob(2, at_least=1)
    # Also keep the N checkpoints with the best trainer.monitor value (0: keep_last alone). An
    # evaluation whose value ranks among them saves a checkpoint at its step, due or not.
    keep_best: int = knob(0, at_least=0)
    # checkpoint.async on the command line: overlap the write with training.
    async_save: bool = False
    # Async saves copy the state into host buffers kept for the whole run (pinned on accelerators):
    # a faster copy, for one host copy of this rank's state held between saves.
    reuse_staging: bool = True
    # auto: newest complete checkpoint in run.dir (if any) | none: start fresh | a path
    resume: str = "auto"
    # Also write model.safetensors (full weights, gathered on rank 0 with CPU offload).
    save_full: bool = False
    # Check the recorded checksums before resuming, and of what model.init_from reads (inspect always does).
    verify_checksums: bool = True
    # A checkpoint save may take this long before the watchdog stops the run (saves are not bound by
    # dist.timeout_s, which is meant for one training step).
    save_timeout_s: int = knob(1800, at_least=1, at_most=LONGEST_WAIT_S)
    preemption_signals: list[str] = field(default_factory=lambda: list(DEFAULT_PREEMPTION_SIGNALS))


# What ``finetune.method`` can select (models/lora.py).
FINETUNE_METHODS = ("none", "lora", "qlora")


@dataclass
class FinetuneConfig:
    """Parameter-efficient fine-tuning: low-rank adapters (LoRA, injected by PEFT) train in fp32 on
    a frozen base; checkpoints hold the adapters only (docs/finetuning.md)."""

    # none: every parameter trains | lora | qlora (LoRA on a base whose linear weights are 4-bit NF4)
    method: str = knob("none", one_of=FINETUNE_METHODS)
    rank: int = knob(16, at_least=1)  # the adapters' rank r
    alpha: float = knob(32.0, above=0)  # the update is scaled by alpha / rank
    # Dropout on the adapters' input; it draws from each rank's own RNG (0: runs are identical at any
    # world size).
    dropout: float = knob(0.0, at_least=0.0, at_most=0.9)
    # Module names (or ends of them) that get adapters; [] = the attention and MLP projections of the
    # built-in Llama and the common Hugging Face families.
    targets: list[str] = field(default_factory=list)
    # How the frozen base is stored: fp32 | bf16 (half the base's memory; needs a bf16 compute dtype,
    # strategy.mixed_precision=bf16-mixed). The adapters stay fp32.
    base_dtype: str = knob("fp32", one_of=("fp32", "bf16"))


# The experiment trackers ``run.trackers`` can name (shardtrain.train.trackers); wandb and mlflow are
# the optional extra ``shardtrain[trackers]``.
TRACKERS = ("tensorboard", "wandb", "mlflow")


@dataclass
class WandbConfig:
    project: str = "shardtrain"
    entity: str | None = None  # null: the logged-in user's default entity


@dataclass
class MlflowConfig:
    # null: $MLFLOW_TRACKING_URI if set, else a file store in run.dir/mlruns.
    tracking_uri: str | None = None
    experiment: str = "shardtrain"


@dataclass
class RunConfig:
    dir: str = "runs/default"
    name: str = "shardtrain"  # the run's name in W&B and MLflow
    # Where every metrics record also goes (rank 0): tensorboard | wandb | mlflow ([] = metrics.jsonl only).
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    # Trackers log locally instead of to a server: W&B in offline mode (run.dir/wandb, `wandb sync`
    # uploads it later), MLflow to the file store run.dir/mlruns.
    offline: bool = False
    # A tracker's start (connecting, creating or resuming its run) and its final flush may take this
    # long: past it, start-up fails with one line, and at the end the tracker is left behind.
    tracker_timeout_s: float = knob(60.0, above=0, at_most=LONGEST_WAIT_S)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


# The built-in task: a causal language model over token windows (model.*, data.*).
LANGUAGE_MODEL_TASK = "shardtrain.tasks.language_model:LanguageModelTask"


@dataclass
class TaskConfig:
    """What is trained: ``task=pkg.module:Class`` names a ``shardtrain.tasks.Task`` subclass
    (docs/tasks.md); its typed options are set as ``task.NAME=VALUE`` and checked against the
    task's ``Options`` dataclass."""

    path: str = LANGUAGE_MODEL_TASK
    options: dict[str, Any] = field(default_factory=dict)
    # Recorded, not set: the model factory a LanguageModelTask was given in code
    # (``LanguageModelTask(model=...)``, as module:qualname), whose checkpoints model.* cannot
    # describe; None: the model is built from model.*.
    model_factory: str | None = None


@dataclass
class Config:
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
