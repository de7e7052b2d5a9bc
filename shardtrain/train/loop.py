"""The training loop: one readable ``fit`` over the components ``build`` made."""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from shardtrain import faults
from shardtrain.accelerator import (
    device_peak_flops,
    is_out_of_memory,
    peak_memory_mib,
    phase_peak_bytes,
    pin_offloaded_memory,
    set_fp32_matmul,
    use_deterministic_kernels,
)
from shardtrain.checkpoint.best import BestEvaluations
from shardtrain.checkpoint.checkpointer import Checkpointer, random_streams_kept, seed_random_streams
from shardtrain.checkpoint.layout import refuse_checkpointless_start, refuse_run_inside_checkpoint
from shardtrain.checkpoint.peft_adapter import load_peft_adapter, resolve_adapter_settings
from shardtrain.checkpoint.preemption import PreemptionFlag, handled_by_the_agent
from shardtrain.checkpoint.run_lock import RunLock, take_run_lock
from shardtrain.checkpoint.state import (
    ADAPTER_SCALE_KEYS,
    MODEL_FUNCTION_KEYS,
    OPTIMIZER_SETTING_KEYS,
    TrainState,
)
from shardtrain.checkpoint.weights import load_model_weights, resolved_weights_source
from shardtrain.config.compose import run_identity_hash, to_yaml
from shardtrain.config.loader import check_built_in_task_settings
from shardtrain.config.plan import ShardingPlan, check_world
from shardtrain.config.schema import Config, TrainerConfig
from shardtrain.config.sizes import counted
from shardtrain.config.strategy import PRECISION_PRESETS
from shardtrain.data.batches import (
    BatchLayout,
    MixtureWindows,
    SampleSource,
    TrainBatches,
    eval_batches,
    packing_of,
    part_sample_counts,
)
from shardtrain.diagnostics.failures import is_failure, record_exception
from shardtrain.diagnostics.memory import PhaseMemory, adapter_summary, state_bytes
from shardtrain.diagnostics.planner import BatchChoice
from shardtrain.diagnostics.profiler import StepProfiler
from shardtrain.diagnostics.rails import (
    check_optimizer_factory,
    check_same_counts,
    settings_a_factory_ignores,
)
from shardtrain.diagnostics.report import (
    DtypeProbe,
    dtype_lines,
    gather_rank_entries,
    rank_lines,
    settings_lines,
)
from shardtrain.diagnostics.watchdog import STOP_WAIT_S, Watchdog
from shardtrain.distributed.agreement import run_agreed
from shardtrain.distributed.env import (
    DistEnv,
    apply_debug_switches,
    check_manual_launch_shape,
    check_not_one_of_many,
    check_restarts_resume,
    check_shared_run_dir,
    init_distributed,
    set_cpu_threads,
)
from shardtrain.distributed.parallelize import ShardingReport, refresh_float8_scales
from shardtrain.distributed.qlora import full_value, nf4_summary, quantize_base
from shardtrain.distributed.running_stats import average_running_statistics, running_statistics
from shardtrain.distributed.sharded_model import deferred_initialization, with_adapters
from shardtrain.errors import ConfigError, TrainingError
from shardtrain.generation.generate import (
    gathered_copy,
    generate,
    generation_mode,
    positions_needed,
    prompt_ids,
)
from shardtrain.tasks.task import Task, check_task, parameters_outside, task_config_of, task_from_config
from shardtrain.train.batch_size import resolve_batch
from shardtrain.train.build import Built, OptimizerFactory, build
from shardtrain.train.console import Console
from shardtrain.train.ema import WeightAverage
from shardtrain.train.flops import counted_flops_per_sample
from shardtrain.train.metrics import DRY_RUN_FILE, METRICS_FILE, MetricsWriter, Throughput
from shardtrain.train.optim import SCHEDULE_SHAPE, follow_schedule, optimizer_kind, schedule_cautions
from shardtrain.train.step import (
    StepStats,
    compile_failure,
    evaluate,
    failing_part,
    graph_break_counts,
    graph_breaks_note,
    ratio,
    train_step,
)

log = logging.getLogger("shardtrain")


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    # The task's metrics (LossOutput.metrics): each step's, and each evaluation's with its step.
    metrics: list[dict[str, float]] = field(default_factory=list)
    val_metrics: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    # trainer.ema_decay: the validation loss of the weights' average, at each evaluation's step.
    average_val_losses: list[tuple[int, float]] = field(default_factory=list)
    # trainer.early_stop_patience ended the run before max_steps (in this start, or in the one it
    # resumed, which left it nothing to do)
    stopped_early: bool = False
    skipped_steps: int = 0
    # The task's count summed over the steps run (target tokens for a language model): the metrics
    # record's ``<count_unit>_seen``; checkpoints carry it as ``tokens_seen`` (their format's name).
    count_seen: int = 0
    sample: str | None = None
    resumed_from: str | None = None
    preempted: bool = False
    checkpoint_blocked_s: list[float] = field(default_factory=list)
    # strategy.compile: the wall time of this start's first compiled step, compilation included
    first_compiled_step_s: float | None = None

    @property
    def tokens_seen(self) -> int:
        """``count_seen`` under its name before tasks counted other units (kept for callers of it)."""
        return self.count_seen


def precision_cautions(model: nn.Module, plan: ShardingPlan, data_parallel_ranks: int,
                       micro_batches: int = 1) -> list[str]:
    """What a bf16 choice costs, said at start-up: gradients summed over ranks, or over a step's
    ``micro_batches`` where the whole gradient is held between them, in bf16, and trainable weights
    (and so AdamW's state) kept in bf16 without fp32 master weights."""
    cautions = []
    if plan.reduce_dtype == torch.bfloat16 and data_parallel_ranks > 1:
        cautions.append(f"gradients are reduced in bf16 over {data_parallel_ranks} data-parallel ranks: a "
                        "sum of many ranks' gradients keeps 8 bits of mantissa; strategy.reduce_dtype=fp32 "
                        "reduces in fp32 (bf16-mixed's default)")
    if plan.reduce_dtype == torch.bfloat16 and plan.grad_accumulation == "unsharded" and micro_batches > 1:
        # FSDP2 holds each parameter's whole gradient in the reduce dtype between micro-batches: the
        # sum is rounded to bf16 at every one, at one rank too (found by review: unsaid there)
        cautions.append(f"gradients are accumulated in bf16 over {micro_batches} micro-batches "
                        "(strategy.grad_accumulation=unsharded holds each whole gradient in the reduce "
                        "dtype between them); strategy.reduce_dtype=fp32 accumulates in fp32")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if any(p.dtype == torch.bfloat16 for p in trainable):
        cautions.append("trainable weights are stored in bf16 (no fp32 master weights): an update below a "
                        "weight's bf16 resolution (1/256 of it) is lost, and AdamW's moments are bf16 too; "
                        "strategy.mixed_precision=bf16-mixed keeps fp32 weights and computes in bf16")
    return cautions


# The share of the parameters the root unit may hold before the start-up says what that costs.
ROOT_SHARE_LIMIT = 0.5


def root_unit_caution(report: ShardingReport, plan: ShardingPlan) -> str | None:
    """Where the root unit holds most of the parameters (a wrap policy matching only small modules,
    or most of the model outside every unit): FSDP gathers the root's parameters at the start of
    forward and keeps them whole through it, so that share is not sharded while it is used."""
    total = sum(report.unit_params.values())
    root = report.unit_params.get("<root>", 0)
    if plan.shard_group < 2 or not total or root / total <= ROOT_SHARE_LIMIT:
        return None
    return (f"the root unit holds {root / total:.0%} of the parameters ({root:,}): outside every unit of "
            f"the wrap policy ({', '.join(report.wrap_classes) or 'none'}), they are gathered whole on every "
            "rank for all of forward and backward, so memory for them does not fall with the ranks; put "
            f"their modules in units ({report.wrap_source} naming the model's block class, or the "
            "model's extra_shard_groups())")


def release(version: str) -> tuple[str, ...]:
    """A torch version's major and minor release (2.11.0+cu130 -> ('2', '11')): patch releases and
    builds for other devices save and read checkpoints alike."""
    return tuple(version.split("+")[0].split(".")[:2])


def due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv, built: Built, task: Task, train: SampleSource,
                 val: SampleSource | None, requested_hash: str) -> None:
        self.cfg = cfg
        self.env = env
        self.built = built
        self.task = task
        t = cfg.trainer
        # The ranks of a tensor-parallel group (neighbours: tp is the mesh's innermost dimension)
        # are one data-parallel rank: they read the same micro-batches.
        tp = built.plan.tensor_parallel
        dp_rank, dp_world = env.rank // tp, env.world_size // tp
        self.layout = BatchLayout(t.micro_batch_size, t.grad_accum_steps, dp_world)
        # Agreed: a rank whose copy of the data is too small for the global batch, or whose first
        # validation batch does not collate, stops every rank (alone, its peers waited in the next
        # collective for the process group's timeout).
        pin = pin_offloaded_memory(env.device.type)
        self.train_data, self.val_batches = run_agreed(lambda: (
            TrainBatches(train, self.layout, dp_rank, t.seed, pin_memory=pin),
            [] if val is None else eval_batches(val, t.eval_samples, t.micro_batch_size, dp_world, dp_rank)))
        self.val_available = 0 if val is None else val.num_samples
        # A fresh run's streams (a resume at the same layout restores each rank's from its checkpoint).
        # Tensor-parallel peers share one: they compute on the same micro-batches.
        seed_random_streams(t.seed, dp_rank)
        self.step = 0
        self.result = TrainResult()
        # A dry run checks a configuration: it leaves the run's records (metrics.jsonl, config.yaml)
        # as they were, and writes its own beside them.
        self.writer = run_agreed(lambda: MetricsWriter(
            Path(cfg.run.dir), env.is_main, DRY_RUN_FILE if cfg.diagnostics.dry_run else METRICS_FILE))
        self.console = Console(env.is_main, t.progress_bar, t.max_steps)
        self.profiler = StepProfiler(cfg.diagnostics, Path(cfg.run.dir), env.rank, env.device, t.max_steps,
                                     env.world_size)
        self.throughput = Throughput(task.count_unit, env.world_size, device_peak_flops(env.device))
        # FLOPs per sample counted once when the task cannot say (Task.flops); why not, if they
        # cannot be, said after the first step.
        self.counted_flops_per_sample, self.flops_unknown = (
            counted_flops_per_sample(task, t.micro_batch_size, train) if type(task).flops is Task.flops
            else (None, None))
        # The logging interval's sums (of the steps not skipped), divided once when the record is
        # written: the loss and each metric are means over the interval's counts, not means of the
        # steps' means (docs/metrics.md).
        self.interval_loss_sum = 0.0
        self.interval_count = 0.0
        # The counts summed unrounded (a weighted count below 0.5 a step added nothing when each
        # step's was rounded: found by review); ``result.count_seen`` is it rounded
        self.count_total = 0.0
        self.interval_metrics: dict[str, list[float]] = {}  # name: [sum, divisor]
        # The task's metrics as the first step returned them: every later step must return the same.
        self.metric_kinds: tuple[tuple[str, bool], ...] | None = None
        self.consecutive_skips = 0
        self.last_skip_empty = False  # the last skipped step's count was 0 (not a non-finite loss)
        # strategy.compile: the graph breaks are said once, after the first compiled step
        self.graph_breaks_said = not cfg.strategy.compile
        self.graph_breaks_before = graph_break_counts()  # an earlier compile's in this process
        # trainer.ema_decay: set from the weights once they are drawn or read (restore).
        self.average = WeightAverage(built.model, t.ema_decay, t.ema_warmup) if t.ema_decay else None
        # trainer.monitor judged at each evaluation: one that ranks among checkpoint.keep_best's saves
        # its step, and trainer.early_stop_patience evaluations without improving stop the run.
        keep = cfg.checkpoint.keep_best if cfg.checkpoint.enabled else 0
        validation = {"seq_len": t.seq_len, "document_mask": cfg.data.document_mask,
                      "windows": self.val_available, "packing": packing_of(val) if val is not None else None}
        self.best = (BestEvaluations(t, keep, min(t.eval_samples, self.val_available), validation)
                     if keep or t.early_stop_patience else None)
        self.best_save_due = False
        self.stop_early = False  # trainer.early_stop_patience ran out (now, or before the resume)
        # The initial weights' path, a link (another run's checkpoints/best, which that run may move)
        # resolved once for the LoRA base's identity, its checks and each rank's read.
        self.weights_source = resolved_weights_source(cfg.model)
        self.checkpointer = (
            Checkpointer(cfg, built.plan, built.model, built.optimizer, built.scheduler, env.rank,
                         env.world_size, requested_hash,
                         average=None if self.average is None else self.average.average, best=self.best,
                         stop_margin_s=STOP_WAIT_S, base_source=self.weights_source)
            if cfg.checkpoint.enabled else None
        )
        self.last_saved_step: int | None = None
        # The evaluation due at this step was skipped for a preemption's save (then saved as
        # due, and run first by the resume).
        self.evaluation_due = False
        # The resumed checkpoint lies in this run's checkpoints directory (what a ranking names).
        self.resumed_here = True
        # trainer.micro_batch_size=auto: what the planner chose, and its figures (Trainer.create).
        self.batch_choice: BatchChoice | None = None
        self.preemption: PreemptionFlag | None = None
        # Rank 0's hold on run.dir for this training (checkpoint/run_lock.py), let go when it ends.
        self.run_lock: RunLock | None = None
        # What the diagnostics count with the optimizer state, as the planner does.
        self.average_tensors = () if self.average is None else tuple(self.average.averages)
        self.phases = PhaseMemory(built.model, built.optimizer, env.device, self.average_tensors)
        # Started by fit(); beats are harmless without the thread (benchmarks drive steps directly).
        self.watchdog = Watchdog(Path(cfg.run.dir), env.rank, cfg.dist.timeout_s,
                                 cfg.dist.startup_timeout_s, cfg.diagnostics.stall_factor,
                                 cfg.diagnostics.stall_min_s, flight_recorder=cfg.dist.flight_recorder)
        waiting = "the ranks with fewer would leave the others waiting in a collective forever"
        # Each rank read (or prepared) its own copy of the data: copies that differ would give the
        # ranks different global orders, repeating some samples and skipping others, silently.
        different = ("the ranks read different data (data.paths, data.cache_dir or the Python install "
                     "differs between nodes); give every node the same files")
        # A mixture's datasets each (their sum may agree where two differ)
        parts = {f"training samples of mixture dataset {index}": (count, different)
                 for index, count in enumerate(part_sample_counts(train) or [])}
        check_same_counts({
            "micro-batches per step": (len(self.layout.rank_slices(
                np.zeros(self.layout.global_batch, dtype=np.int64), dp_rank)), waiting),
            "validation batches": (len(self.val_batches), waiting),
            "training samples": (train.num_samples, different), **parts,
            "validation samples": (self.val_available, different)}, env.device)

    @classmethod
    def create(cls, cfg: Config, *, task: Task | None = None,
               optimizer_factory: OptimizerFactory | None = None) -> Trainer:
        """Everything a run needs, for ``task`` (default: the one ``cfg.task`` names).

        ``cfg`` itself is left as given: what start-up resolves (the task's settings, an adapter's,
        the batch ``micro_batch_size=auto`` chooses) goes into the trainer's copy, ``trainer.cfg``,
        so one config can start several runs (at other world sizes, ``auto`` chooses afresh)."""
        # A shallow copy suffices: start-up replaces the config's sections, never edits one in place.
        cfg = replace(cfg)
        check_optimizer_factory(optimizer_factory)  # before any process group
        check_not_one_of_many()  # the library's entry to training, as the command's
        check_manual_launch_shape(cfg.trainer.num_nodes)
        check_restarts_resume(cfg.checkpoint.enabled)
        apply_debug_switches(cfg.dist, Path(cfg.run.dir))
        # The process group's own timeout is the longest bound of a phase with collectives on it plus
        # the longest the watchdog's stop takes (from the diagnostics review: equal to it, a slow
        # evidence write let the backend's timeout overtake the watchdog's stop, its record and status
        # 124). The save's bound too: reading the initial weights and the end's wait for rank 0's
        # deletions run default-group collectives under it (a later review: a node reading a base 12
        # minutes slower than its peers ended in the backend's timeout, not the watchdog's 124). The
        # per-step bound is enforced by the watchdog (see diagnostics/watchdog.py).
        longest = max(cfg.dist.timeout_s, cfg.dist.startup_timeout_s, cfg.checkpoint.save_timeout_s)
        env = init_distributed(cfg.dist.backend, longest + STOP_WAIT_S, cpu_offload=cfg.strategy.cpu_offload)
        check_world(cfg, env.world_size, env.local_world_size)
        run_lock = None
        if cfg.checkpoint.enabled:  # saves and the resume choice need one run.dir; logs do not
            check_shared_run_dir(Path(cfg.run.dir), env)
        if not cfg.diagnostics.dry_run:  # a dry run changes no file of the run: it may run beside
            # Without checkpoints too: rank 0 writes the run's config.yaml and metrics.jsonl (found by
            # review: a second training rewrote a live run's config and joined its metrics)
            def take() -> RunLock | None:
                if not env.is_main:
                    return None
                refuse_run_inside_checkpoint(Path(cfg.run.dir))
                if not cfg.checkpoint.enabled:
                    refuse_checkpointless_start(Path(cfg.run.dir) / "checkpoints")
                return take_run_lock(Path(cfg.run.dir))

            run_lock = run_agreed(take)
        try:
            trainer = cls.assemble(cfg, env, task, optimizer_factory)
        except BaseException:
            if run_lock is not None:  # a start that failed holds nothing (a library process goes on)
                run_lock.release()
            raise
        trainer.run_lock = run_lock
        if run_lock is not None:  # let go with the trainer too, if it is dropped without fit()
            weakref.finalize(trainer, run_lock.release)
        return trainer

    @classmethod
    def assemble(cls, cfg: Config, env: DistEnv, task: Task | None,
                 optimizer_factory: OptimizerFactory | None) -> Trainer:
        """``create``'s trainer, once the process group and the run directory are settled."""
        set_cpu_threads(env, cfg.trainer.threads_per_process)
        set_fp32_matmul(env.device, cfg.strategy.tf32)
        if cfg.trainer.deterministic:
            use_deterministic_kernels()
        if task is not None:
            cfg.task = task_config_of(check_task(task))
        else:
            task = task_from_config(cfg)
        # The task object itself (load_config checked the class task= names): a LanguageModelTask
        # with a model of its own, or a config built without load_config.
        check_built_in_task_settings(cfg, task)
        # Each rank reads its own tokenizer, data and adapter files (node-local copies, perhaps): one
        # that cannot stops every rank, not itself alone while the others wait in a collective.
        task.cfg = cfg  # what Task.seed reads, also where an overriding bind() skips super().bind()
        run_agreed(lambda: task.bind(cfg))
        adapter_notes = run_agreed(lambda: resolve_adapter_settings(cfg))  # before the model is built
        # The data first: a data error is reported before the model is built.
        train, val = run_agreed(lambda: (task.train_samples(), task.val_samples()))
        run_agreed(lambda: check_something_to_judge(cfg, val))
        # The run's identity in its checkpoints: the config as asked for, not the accumulation steps
        # (or auto micro-batch) resolved from this world, which a requeue at another size changes.
        requested_hash = run_identity_hash(cfg)
        batch_choice = resolve_batch(cfg, env)  # before anything reads the batch size
        with deferred_initialization() as draws:  # a resume reads every weight: no draw for it
            built = build(cfg, env, task, optimizer_factory)
        check_sample_fits(cfg.trainer, task, built.model)
        trainer = cls(cfg, env, built, task, train, val, requested_hash)
        for note in adapter_notes:
            trainer.info(note)
        trainer.batch_choice = batch_choice
        if optimizer_factory is not None and (ignored := settings_a_factory_ignores(cfg.trainer)):
            if env.is_main:
                log.warning(ignored)
        trainer.restore(draws.draw)
        return trainer

    @property
    def model(self) -> torch.nn.Module:
        return self.built.model

    def info(self, message: str) -> None:
        if self.env.is_main:
            log.info(message)

    # ---- start and end -------------------------------------------------------------------

    def restore(self, draw: Callable[[], None] = lambda: None) -> None:
        """Resume (checkpoint.resume), or start from given weights (model.init_from, a Hugging Face
        model's own), else from the random initialisation: ``draw`` it, if the build deferred it."""
        with self.resume_watched():
            path = self.checkpointer.resume_path() if self.checkpointer is not None else None
        if path is not None:
            if self.cfg.finetune.method != "none":  # the checkpoint holds the adapters only
                self.load_base_weights(draw)
            asked_lrs = list(self.built.scheduler.base_lrs)  # the load replaces them with the saved
            with self.resume_watched():
                state = self.checkpointer.load(path)
            self.step = self.last_saved_step = state.step
            self.evaluation_due = state.evaluation_due
            self.result.count_seen = state.tokens_seen
            self.count_total = float(state.tokens_seen)
            self.train_data.consumed_samples = state.consumed_samples
            if since := state.logged_since:  # the next record covers the steps before the save too
                self.interval_loss_sum, self.interval_count = float(since["loss_sum"]), float(since["count"])
                self.interval_metrics = {name: [float(total), float(divisor)]
                                         for name, (total, divisor) in since["metrics"].items()}
            self.result.resumed_from = str(path)
            self.info(f"resumed from {path}: step {self.step}, {state.consumed_samples} samples "
                      f"consumed (saved at world size {state.world_size}, {state.strategy}, "
                      f"mesh [{state.mesh}])")
            if self.env.is_main:
                for change in self.resume_changes(state, asked_lrs):
                    log.warning(change)
            saved_lr = state.config.get("trainer", {}).get("lr")
            if saved_lr is not None and asked_lrs != list(self.built.scheduler.base_lrs):
                # The checkpoint's rate runs on: config.yaml, the trackers and later checkpoints record
                # it, not the one asked for (found by review: config.yaml named a rate never used).
                self.cfg.trainer.lr = saved_lr
            follow_schedule(self.built.scheduler)  # after the warnings, which name the saved rate
            if self.cfg.model.init_from and self.cfg.finetune.method == "none":
                self.info("model.init_from is ignored: resuming from a checkpoint")
            if self.cfg.model.adapter:
                self.info("model.adapter is ignored: the adapters are the checkpoint's (resuming from it)")
            if self.best is not None:
                with self.resume_watched():
                    self.restore_evaluations(path, state)
            self.weight_average_changes(path, state.config.get("trainer", {}))
        else:
            self.load_base_weights(draw)
            if self.cfg.model.adapter:  # a fresh run's adapters from PEFT's directory (a resume's: saved)
                run_agreed(lambda: load_peft_adapter(self.model, self.cfg))  # each rank reads its copy
                self.info(f"adapters started from {self.cfg.model.adapter}")
        if self.average is not None and not (path is not None and self.checkpointer.average_restored):
            self.average.restart_from_weights()
        if self.built.report.float8_scales_precomputed:
            # Scales of the weights just read: reading a checkpoint first initialises the optimizer's
            # state with a zero-learning-rate step (torch's DCP), whose hook computed them from the
            # weights before the read.
            refresh_float8_scales(self.model)

    def resume_changes(self, state: TrainState, asked_lrs: list[float]) -> list[str]:
        """What a resume does with settings changed since the checkpoint was saved, one warning each
        (the weight average's are weight_average_changes', which needs the load's outcome)."""
        warnings = []
        if order := state.data_order_changes(self.cfg, self.train_data.windows.num_samples,
                                             packing_of(self.train_data.windows),
                                             part_sample_counts(self.train_data.windows)):
            if all(change.startswith("task.") for change in order):
                # A task's options may shape its model alone: the order is not known to have changed
                # (found by a trial: "the data order differs" for a model-only option).
                # (not a new ranking: an option may change nothing the evaluation reads, and a new
                # ranking would prune the best checkpoints; found by a new-user trial, the warning)
                warnings.append(f"the task's options differ from the checkpoint's ({'; '.join(order)}): "
                                "where they change its data, the saved position is read in the new order, "
                                "so samples may repeat or be skipped, and where they change its validation "
                                "data, checkpoint.keep_best and trainer.early_stop_patience compare its "
                                "values with the saved best's")
            else:
                warnings.append(f"the data order differs from the checkpoint's ({'; '.join(order)}): the "
                                "saved position is read in the new order, so samples may repeat or be "
                                "skipped")
        if state.tokenizer is not None and self.tokenizer_name is not None and (
                state.tokenizer != self.tokenizer_name):
            warnings.append(f"the tokenizer differs from the checkpoint's ({state.tokenizer} -> "
                            f"{self.tokenizer_name}): the model's token ids stand for other text from here "
                            "on (edited or replaced since the checkpoint was saved?)")
        if schedule := self.schedule_changes(state.config.get("trainer", {}), asked_lrs):
            warnings.append("the learning-rate schedule differs from the checkpoint's "
                            f"({'; '.join(schedule)})")
        # LoRA's base is checked by its fingerprint instead.
        if self.cfg.model.name == "hf" and self.cfg.finetune.method == "none":
            for moved in state.setting_changes(self.cfg, ("model.path",)):
                warnings.append(f"{moved}: the weights are the checkpoint's; the new directory's config.json "
                                "and tokenizer are read from now on (and export-hf copies them)")
        if computed := state.setting_changes(self.cfg, MODEL_FUNCTION_KEYS):
            warnings.append(f"the model's settings differ from the checkpoint's ({', '.join(computed)}): the "
                            "weights are the checkpoint's, computed with the new values from now on")
        saved, now = state.mixed_precision.lower(), self.built.plan.precision
        if saved != now:
            before, after = PRECISION_PRESETS.get(saved, (None,))[0], PRECISION_PRESETS[now][0]
            kept = (f"its weights and optimizer state are read into {after} (stored in {before} before)"
                    if before != after else
                    f"its weights and optimizer state stay {after}; the compute dtype changes")
            warnings.append(f"the precision differs from the checkpoint's ({saved} -> {now}): {kept}")
        if state.global_batch != self.layout.global_batch:
            warnings.append(f"the global batch differs from the checkpoint's ({state.global_batch} -> "
                            f"{self.layout.global_batch} samples a step): the learning rate and schedule are "
                            "as configured, not scaled with it")
        if settings := state.setting_changes(self.cfg, OPTIMIZER_SETTING_KEYS):
            warnings.append(f"the optimizer's settings differ from the checkpoint's ({', '.join(settings)}): "
                            f"its moments are the checkpoint's, the new values apply from step "
                            f"{self.step + 1}")
        if adapters := state.setting_changes(self.cfg, ADAPTER_SCALE_KEYS):
            warnings.append(f"the adapters' settings differ from the checkpoint's ({', '.join(adapters)}): "
                            "the adapters trained so far are scaled and dropped out by the new values from "
                            f"step {self.step + 1} on, and the checkpoints record them")
        saved_numpy = state.versions.get("numpy", "")
        if (isinstance(self.train_data.windows, MixtureWindows) and saved_numpy
                and release(saved_numpy) != release(np.__version__)):
            warnings.append(f"the checkpoint was saved under NumPy {saved_numpy}, this run has "
                            f"{np.__version__}: a mixture's order within each block is drawn by NumPy's "
                            "Generator.permutation, which NumPy does not promise the same across releases; "
                            "if it changed, the saved position points into another order")
        saved_torch = state.versions.get("torch", "")
        if saved_torch and release(saved_torch) != release(torch.__version__):
            warnings.append(f"the checkpoint was saved under torch {saved_torch}, this run has "
                            f"{torch.__version__}: Distributed Checkpoint promises no compatibility across "
                            "torch releases; it loaded, and the first steps' loss should go on from the "
                            "saved run's")
        return warnings

    def resume_watched(self, phase: str = "resume from a checkpoint") -> AbstractContextManager[None]:
        """A resume's checks, reads and checkpoint-group collectives, bounded as a save is: the
        group's own timeout is as long, and gloo's first connection to a peer waits five times it."""
        return self.watchdog.watching(phase, self.cfg.checkpoint.save_timeout_s, "checkpoint.save_timeout_s")

    def restore_evaluations(self, path: Path, state: TrainState) -> None:
        """The resumed checkpoint's best evaluations (trainer.monitor), and whether the run had
        stopped early there with the patience it still has."""
        held = self.checkpointer.steps_held(path)
        self.resumed_here = held is not None
        if (unranked := self.best.restore(state.best, held)) is not None:
            self.info(f"trainer.monitor: {unranked}")
        patience = self.cfg.trainer.early_stop_patience
        self.stop_early = bool(patience) and self.best.stopped_at == self.step and self.best.stale >= patience
        self.result.stopped_early = self.stop_early

    def weight_average_changes(self, path: Path, saved: dict) -> None:
        """Rank 0 says what a resume does with the checkpoint's weight average (trainer.ema_decay),
        ``saved`` the checkpoint's trainer settings."""
        decay, restored = self.cfg.trainer.ema_decay, self.checkpointer.average_restored
        saved_decay, saved_warmup = saved.get("ema_decay", 0.0), saved.get("ema_warmup", False)
        if not self.env.is_main:
            return
        if decay and not restored:
            log.info(f"trainer.ema_decay: {path} holds no weight average; it starts from the resumed weights")
        elif restored and not decay:
            log.warning(f"{path} holds a weight average (trainer.ema_decay={saved_decay}), which this run "
                        "does not keep: its checkpoints will hold none; resume with trainer.ema_decay="
                        f"{saved_decay} to keep it")
        elif restored and decay != saved_decay:
            log.warning(f"trainer.ema_decay {saved_decay!r} -> {decay!r}: the resumed average goes on with "
                        "the new decay")
        if restored and decay and saved_warmup != self.cfg.trainer.ema_warmup:
            log.warning(f"trainer.ema_warmup {saved_warmup} -> {self.cfg.trainer.ema_warmup}: the resumed "
                        "average's decay follows the new setting from here on")

    def schedule_changes(self, saved: dict, asked_lrs: list[float] | None = None) -> list[str]:
        """What a resume does with schedule settings changed since the checkpoint, one phrase each:
        the scheduler's state (its base learning rate, its step) is the checkpoint's, while warmup,
        max_steps, min_lr_ratio and the decay's shape and share shape the schedule from the next step
        on. ``asked_lrs``: the scheduler's base rates as this run built them, before the load."""
        t, changes = self.cfg.trainer, []
        if "max_steps" in saved:  # a checkpoint from before a shape key existed ran with its default
            defaults = TrainerConfig()
            saved = {**{key: getattr(defaults, key) for key in SCHEDULE_SHAPE}, **saved}
        base_lrs = self.built.scheduler.base_lrs
        # Against the rates in effect, not the saved config's: a run resumed with another lr records
        # that one, and its next resume named a change from a rate it never ran at.
        if "lr" in saved and saved["lr"] != t.lr and asked_lrs != list(base_lrs):  # older ones lack keys
            base = ", ".join(f"{lr:g}" for lr in dict.fromkeys(base_lrs))
            changes.append(f"trainer.lr {saved['lr']!r} -> {t.lr!r}: the resumed run keeps the checkpoint's "
                           f"base learning rate {base}; start a new run to change it")
        moved = [f"trainer.{key} {saved[key]!r} -> {getattr(t, key)!r}"
                 for key in SCHEDULE_SHAPE
                 if key in saved and saved[key] != getattr(t, key)]
        if moved:
            lr = self.built.optimizer.param_groups[0]["lr"]
            changes.append(f"{', '.join(moved)}: the schedule follows the new values from step "
                           f"{self.step + 1} on, so the learning rate ({lr:g} at the save) may jump")
        return changes

    def load_base_weights(self, draw: Callable[[], None]) -> None:
        """The weights a fresh run starts from (with LoRA: the frozen base, and the adapters' draw)."""
        if source := self.weights_source:
            if source != (given := self.cfg.model.weights_source()):
                self.info(f"model.init_from: {given} is {source}")
            # Each rank reads its own rows: a file missing or damaged on one node stops every rank.
            # Watched as a resume's reads are (it ran unwatched: a read stuck on one node's
            # filesystem left the others a bare collective timeout, and the stuck rank never
            # stopped; found by a scale review), and agreed on the checkpoint's group, whose timeout
            # is as long: a large base read slowly on every rank is no hang.
            def load() -> None:
                faults.inject("init_from", self.env.rank, 0)
                load_model_weights(self.model, source, self.cfg.model, self.cfg.checkpoint.verify_checksums)

            group = self.checkpointer.group if self.checkpointer is not None else None
            with self.resume_watched("reading the initial weights"):
                run_agreed(load, group)
            self.info(f"initialised weights from {source}")
        if source is None or self.cfg.finetune.method != "none":
            draw()  # with a base read from files, only the adapters are still to be drawn
        if self.cfg.finetune.method == "qlora":  # the base is in place: quantise it, weight by weight
            quantize_base(self.model)
            self.info(nf4_summary(self.model, self.env.device))

    def beat_save(self, phase: str) -> None:
        """Saves get their own bound: a large synchronous save may take far longer than a step, and
        one stopped half-way is lost. The next step's beat returns to the step bound."""
        self.watchdog.beat(phase, self.step, self.cfg.checkpoint.save_timeout_s,
                           "checkpoint.save_timeout_s")

    def save_checkpoint(self, blocking: bool = False, phase: str = "checkpoint save") -> None:
        """Every save goes through here (periodic, final, preemption), under ``beat_save``: the wait
        for an async save still in flight under a bound of its own, then this save under another
        (sharing one, a final save after a slow async one was stopped with each within the bound:
        found by review)."""
        # Training is blocked from here: the wait for the save before counts (found by review:
        # blocked_s left it out, near zero where async saves overlapped, the case it is there to show)
        started = time.perf_counter()
        pending = self.checkpointer.pending
        if pending is not None and not pending.future.done():
            self.beat_save(f"waiting for the async save of step {pending.step}")
            self.checkpointer.wait()
        self.beat_save(phase)
        self.agree_running_statistics()  # the checkpoint keeps the ranks' mean, not one rank's
        blocked = self.checkpointer.save(
            self.step, started=started, tokens_seen=self.result.count_seen,
            consumed_samples=self.train_data.consumed_samples, global_batch=self.layout.global_batch,
            blocking=blocking, evaluation_due=self.evaluation_due,
            train_samples=self.train_data.windows.num_samples,
            train_part_samples=part_sample_counts(self.train_data.windows),
            train_packing=packing_of(self.train_data.windows), tokenizer=self.tokenizer_name,
            logged_since={"loss_sum": self.interval_loss_sum, "count": self.interval_count,
                          "metrics": {name: list(sums) for name, sums in self.interval_metrics.items()}},
        )
        self.best_save_due = False  # a save at this step keeps what the evaluation ranked
        self.result.checkpoint_blocked_s.append(blocked)
        self.writer.write(self.step, "checkpoint", {"blocked_s": blocked,
                                                    "async": self.cfg.checkpoint.async_save and not blocking})
        self.last_saved_step = self.step

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered in full (a collective; for tests and small models only)."""
        return {
            name: full_value(p).detach().cpu().float()
            for name, p in self.model.named_parameters()
        }

    def open_run_records(self) -> None:
        self.write_run_files()
        if not self.cfg.diagnostics.dry_run:  # a dry run leaves no run in W&B or MLflow
            # A resumed training continues its tracker runs (their ids are kept in run.dir).
            self.writer.start_trackers(self.cfg, resuming=self.result.resumed_from is not None,
                                       start_step=self.step)
        self.write_start_record()  # the trackers get it too

    def write_run_files(self) -> None:
        if not self.env.is_main or self.cfg.diagnostics.dry_run:
            return
        run_dir = Path(self.cfg.run.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(self.cfg), encoding="utf-8")

    def write_start_record(self) -> None:
        """Where this attempt starts: ``shardtrain report`` marks resumes and restarts with it, and
        drops what an abandoned attempt logged after the step this one resumed from."""
        self.writer.write(self.step, "start", {
            "resumed": self.result.resumed_from is not None, "resumed_from": self.result.resumed_from,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "world_size": self.env.world_size})

    def log_setup(self) -> None:
        t, env, b = self.cfg.trainer, self.env, self.built
        n_params = sum(p.numel() for p in b.model.parameters())
        frozen = sum(p.numel() for p in b.model.parameters() if not p.requires_grad)
        deterministic = "; deterministic kernels" if torch.are_deterministic_algorithms_enabled() else ""
        self.info(f"world size {env.world_size} ({env.backend}, {env.device.type}); {b.plan.describe()}"
                  f"{deterministic}")
        float8 = f", {len(b.report.float8_linears)} float8 linear layers" if b.report.float8_linears else ""
        # LoRA's frozen base has a line of its own (adapter_summary)
        count = f"{frozen / 1e6:.2f}M" if frozen >= 5_000 else f"{frozen:,}"
        held = f" ({count} frozen)" if frozen and self.cfg.finetune.method == "none" else ""
        # units holds the root, counted apart as the diagnostics' module tree counts it
        self.info(f"model: {n_params / 1e6:.2f}M parameters{held}, {len(b.report.units) - 1} FSDP units + "
                  f"root ({len(b.report.checkpointed)} activation-checkpointed{float8}); optimizer "
                  f"{optimizer_kind(b.optimizer)}")
        if self.cfg.finetune.method != "none":
            self.info(adapter_summary(b.model, self.cfg.finetune))
        for caution in schedule_cautions(t) if env.is_main else ():
            log.warning(f"schedule: {caution}")
        if env.is_main and t.memory_limit_gib and self.batch_choice is None:
            # Not a cap: torch is never told of it, and a fixed micro-batch is not planned against it.
            log.warning(f"memory: trainer.memory_limit_gib={t.memory_limit_gib:g} is the budget "
                        "trainer.micro_batch_size=auto plans against (in training and in `shardtrain plan`); "
                        f"this run's micro-batch is fixed at {t.micro_batch_size}, and nothing holds its "
                        "memory to it")
        if env.is_main:
            for caution in precision_cautions(b.model, b.plan, self.layout.dp_world_size,
                                              self.layout.grad_accum_steps):
                log.warning(f"precision: {caution}")
            if root := root_unit_caution(b.report, b.plan):
                log.warning(f"sharding: {root}")
            for name, count in parameters_outside(self.task, b.model).items():
                log.warning(f"{type(self.task).__name__}.{name} holds trainable parameters ({count:,} "
                            "elements) outside the model: the optimizer never updates them and "
                            "checkpoints leave them out; build them into the model (build_model), or "
                            "freeze them (requires_grad_(False)) if they are not to train")
            agent = handled_by_the_agent(list(self.cfg.checkpoint.preemption_signals))
            if self.checkpointer is not None and agent:
                log.warning(f"torchrun's agent handles {', '.join(agent)} itself (its --signals-to-handle): "
                            "it stops the workers as a failure and SIGKILLs them after its shutdown timeout "
                            "(30 s), cutting a preemption's save short; start torchrun with those signals "
                            "ignored and left out of --signals-to-handle (docs/checkpoints.md, Preemption; "
                            "on one node trainer.devices=N starts torchrun so, on Slurm "
                            "examples/slurm/train.sbatch)")
        if (statistics := running_statistics(b.model)) and self.layout.dp_world_size > 1:
            self.info(f"{len(statistics)} running statistics (BatchNorm-style buffers each rank updates "
                      "from its own batches): averaged over the data-parallel ranks before each "
                      "evaluation and save; nn.SyncBatchNorm normalises with the global batch's")
        ranks = "data-parallel rank" if b.plan.tensor_parallel > 1 else "rank"
        self.info(f"task {type(self.task).__name__}; data: {self.task.describe()}; global batch "
                  f"{self.layout.global_batch} samples ({t.micro_batch_size} per micro-batch x "
                  f"{counted(t.grad_accum_steps, 'micro-batch')} x "
                  f"{counted(self.layout.dp_world_size, ranks)})")
        if self.batch_choice is not None:
            self.info(self.batch_choice.describe(self.layout.dp_world_size, t.memory_margin))
        if self.val_batches:
            used = min(t.eval_samples, self.val_available)
            when = f"every {t.eval_every} steps and at the end" if t.eval_every else "at the end"
            self.info(f"validation: the first {used} of {self.val_available} samples "
                      f"(trainer.eval_samples), {when}")
        if not self.cfg.diagnostics.dry_run:  # a dry run leaves the run's files as they are
            self.info(f"config: every key, resolved, in {Path(self.cfg.run.dir) / 'config.yaml'}")
        if self.throughput.peak_flops is None:
            self.info(f"MFU is not reported: no peak FLOP/s is known for this device ({env.device.type})")
        diag = self.cfg.diagnostics
        if diag.enabled or diag.dry_run:
            self.info("\n".join(settings_lines(self.cfg, b.plan, b.report, env)))

    # ---- the loop ------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        if (left := self.nothing_left()) is not None:
            return self.finished_already(left)
        outcome = "failed"
        try:
            # Rank 0's files and trackers: a failure there (a tracker not logged in, a full disk)
            # stops every rank, not rank 0 alone while the others wait in the first step.
            run_agreed(self.open_run_records)
            self.log_setup()
            self.train()
            outcome = "preempted" if self.result.preempted else "finished"
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):  # the user's stop, no failure: MLflow's KILLED
                outcome = "interrupted"
            if is_failure(exc):
                # Before the trackers close (up to run.tracker_timeout_s): the launcher names the
                # first record as the root cause, and a peer's fallout must not come first.
                record_exception(Path(self.cfg.run.dir), self.env.rank, self.step, exc)
            raise
        finally:
            try:
                self.writer.close(outcome, self.step)
            finally:
                self.release_run_dir()
        return self.result

    def release_run_dir(self) -> None:
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None

    def nothing_left(self) -> str | None:
        """Why this start has no step, evaluation or dry run to do (the same command run again after
        its run finished, or stopped early), else None."""
        t = self.cfg.trainer
        if self.cfg.diagnostics.dry_run or self.evaluation_due:
            return None
        if self.step >= t.max_steps:
            return f"step {self.step} >= trainer.max_steps={t.max_steps}"
        if self.stop_early:
            return (f"the run stopped early at step {self.step} (trainer.early_stop_patience="
                    f"{t.early_stop_patience} evaluations without improving {t.monitor}); raise "
                    "trainer.early_stop_patience to go on")
        return None

    def finished_already(self, left: str) -> TrainResult:
        """One line, and the run's files as its training left them: no start and end records, no
        tracker run, no sample, the config.yaml of the run that trained (each re-run of a finished
        command counted as an attempt in the report, opened a W&B/MLflow run that logged nothing,
        and generated the end-of-training sample again)."""
        self.info(f"nothing to do: {left}")
        try:
            self.train_data.close()
        finally:
            self.writer.close()
            self.release_run_dir()
            if self.preemption is not None:
                self.preemption.restore()
                self.preemption = None
        return self.result

    def train(self) -> None:
        """Steps until ``max_steps`` (or one, for a dry run, or until preempted), then the final save."""
        self.console.open(self.step)
        self.throughput.reset()
        if 0 < self.cfg.diagnostics.profile_at <= self.step:
            self.info(f"profiler: diagnostics.profile_at={self.cfg.diagnostics.profile_at} is before the "
                      f"resumed step {self.step + 1}: nothing is traced")
        if self.checkpointer is not None and self.preemption is None:  # else installed at start-up
            self.preemption = PreemptionFlag(self.cfg.checkpoint.preemption_signals)
        self.watchdog.start()
        try:
            self.check_monitor_logged()
            if self.cfg.diagnostics.dry_run:
                if self.step >= self.cfg.trainer.max_steps:  # its console line reads "step 13/12"
                    self.info(f"dry run of a finished run (step {self.step} >= trainer.max_steps="
                              f"{self.cfg.trainer.max_steps}): its one step runs past the end, as a check")
                self.run_step()
                self.info("dry run complete: the configuration builds, shards and trains one step")
                return
            if self.evaluation_due:
                self.evaluate_skipped()
            first = self.step
            while self.step < self.cfg.trainer.max_steps and not self.stop_early and self.iteration():
                pass
            if self.step > first and self.consecutive_skips >= self.step - first and self.last_skip_empty:
                # Fewer than max_skipped_steps in all, every one with nothing to learn from: nothing
                # trained, which the run ended as if finished, its checkpoint saved (found by a trial)
                raise TrainingError(self.skipped_throughout(
                    f"all {self.step - first} of this run's steps", "no update at all"))
            if self.profiler.writes_after(self.cfg.trainer.max_steps):  # the window, cut short
                self.beat_trace()
            self.profiler.close(self.step)  # before the final save and sample
            if self.checkpointer is not None:
                if not self.result.preempted and self.last_saved_step != self.step:
                    self.save_checkpoint(blocking=True, phase="final checkpoint")
                self.beat_save("waiting for the last async save")
                # waits for it, then frees the staging buffers (a preempted run not for deletions)
                self.checkpointer.close(wait_deletions=not self.result.preempted)
            # Inside the watchdog's watch: gathering the copy is a collective like any other.
            if not self.result.preempted and self.cfg.trainer.sample_tokens > 0 and self.samples_text():
                if self.preempted_anywhere():  # signalled during the last step's save: stop now
                    self.info("preemption during the final save: the end-of-training sample is skipped")
                else:
                    self.result.sample = self.sample()
        except BaseException as exc:
            if isinstance(exc, Exception):
                # On gloo a peer stopped by its watchdog ends this rank's collectives at once, before
                # this rank's own watchdog fires: dump this rank's flight recorder too, so the dumps
                # can be compared rank by rank.
                dumped = self.watchdog.dump_flight_recorder()
                if dumped:
                    log.error("rank %d: training failed%s", self.env.rank, dumped)
            # Ctrl-C too (it reaches every rank): the save in flight is the newest state, as a
            # blocking save of its step would have kept it; a second Ctrl-C leaves it.
            self.commit_pending_save()
            raise
        finally:
            self.profiler.close(self.step)
            # Watched: closing waits for the batches being made ahead, and a read stuck on a stalled
            # filesystem would keep the process from exiting, unbounded, after the last step.
            self.watchdog.beat("closing the training data", self.step)
            try:
                self.train_data.close()
            finally:  # a close that raises (or Ctrl-C in its wait) must not leave the watch running
                self.watchdog.stop()
                self.console.close()
                if self.preemption is not None:
                    self.preemption.restore()
                    self.preemption = None

    def commit_pending_save(self) -> None:
        """After a failure, an async save still in flight commits before the ranks stop, as a
        blocking save of that step would have: it is the newest state saved before the failure, and
        unwinding would tear its process group down under it and leave an abandoned directory. Its
        own failure is a warning; the failure that stopped training is the error."""
        if self.checkpointer is None or self.checkpointer.pending is None:
            return
        step = self.checkpointer.pending.step
        self.info(f"training stopped with the async save of step {step} in flight: letting it commit")
        self.beat_save("committing the async save after a failure")
        try:
            self.checkpointer.wait()
        except Exception as exc:  # noqa: BLE001 - the training failure is the one to raise
            log.warning(f"checkpoint: the async save of step {step} did not commit either: {exc}")

    def iteration(self) -> bool:
        """One iteration of ``fit``: a step, then checkpointing and preemption. False: stop."""
        stats = self.run_step()
        if self.checkpointer is None:
            return True
        self.checkpointer.poll(stats.save_in_flight_anywhere)
        if self.preemption is not None and stats.stop_agreed:
            self.info(f"preemption ({self.preemption.signal_name or 'signal on another rank'}): "
                      f"saving at step {self.step} and stopping")
            self.save_checkpoint(blocking=True, phase="preemption save")
            self.result.preempted = True
            return False
        if (due(self.step, self.cfg.checkpoint.interval) and self.step < self.cfg.trainer.max_steps
                or self.best_save_due):
            self.save_checkpoint()
        return True

    def run_step(self) -> StepStats:
        """The next global batch, one optimizer step, and what is due after it."""
        self.profiler.before_step(self.step + 1)
        stats = self.train_on_next_batch()
        self.account(stats)
        self.after_step(stats)
        self.write_trace_if_due(self.step)
        return stats

    def write_trace_if_due(self, step: int) -> None:
        """The profiler's trace, once its window is over, under a watchdog phase of its own: a
        large model's trace is hundreds of MB, on every rank, and was timed as the step's."""
        if self.profiler.writes_after(step):
            self.beat_trace()
        self.profiler.after_step(step)

    def beat_trace(self) -> None:
        # A write of large files on every rank, as a save is, and bounded as one (not by the step's
        # median and dist.timeout_s).
        self.watchdog.beat("writing the profiler trace", self.step, self.cfg.checkpoint.save_timeout_s,
                           "checkpoint.save_timeout_s")

    def train_on_next_batch(self) -> StepStats:
        diag, b = self.cfg.diagnostics, self.built
        self.watchdog.beat("training step", self.step + 1, under_way=True)
        batches = self.train_data.next_step()
        steps_run = len(self.result.losses)
        phases = self.phases if (diag.enabled or diag.dry_run) and steps_run < diag.steps else None
        compiled = self.cfg.strategy.compile
        # A dry run's one step must exercise compilation, so with compile it goes without the probe;
        # so does a resumed run's first step, which the uninterrupted run took compiled (eager and
        # compiled kernels differ in the last bits: the resume was no longer bitwise identical).
        probe = (DtypeProbe(b.model) if phases is not None and steps_run == 0
                 and not (compiled and (diag.dry_run or self.step > 0)) else None)
        # The dtype probe's hooks must not be traced into compiled blocks: a hook's side effect inside
        # an activation-checkpointed block makes dynamo give up on that block for the rest of the run
        # (measured: compile + AC ran at eager speed), and even without AC they cost a recompile.
        # The probed first step therefore runs eagerly; compilation starts with the next one.
        eager_first = probe is not None and compiled
        stance = torch.compiler.set_stance("force_eager") if eager_first else nullcontext()
        start = time.perf_counter()
        try:
            with stance, self.out_of_memory_explained():
                stats = train_step(b.model, self.task, b.optimizer, b.scheduler, batches, b.mesh,
                                   self.cfg.trainer.grad_clip_norm, self.env.device, step=self.step + 1,
                                   phases=phases,
                                   sharded_accumulation=b.plan.grad_accumulation == "sharded",
                                   stop_requested=self.stop_requested,
                                   save_in_flight=None if self.checkpointer is None
                                   else self.checkpointer.save_in_flight,
                                   flops_per_sample=self.counted_flops_per_sample,
                                   metric_kinds=self.metric_kinds,
                                   reserved_names=self.record_fields() if self.metric_kinds is None
                                   else frozenset())
        finally:
            if probe is not None:
                probe.close()
        self.metric_kinds = stats.metric_kinds
        if self.flops_unknown:
            if self.env.is_main:  # the same on every rank
                log.warning(self.flops_unknown)
            self.flops_unknown = None
        if self.average is not None and not stats.skipped:
            self.average.update(self.step + 1)
        seconds = time.perf_counter() - start
        if not (self.graph_breaks_said or eager_first):
            self.graph_breaks_said = True
            self.result.first_compiled_step_s = seconds
            if self.env.is_main:  # what compilation cost, beside the step times that follow
                log.info(f"strategy.compile: the first compiled step took {seconds:.1f} s, compilation "
                         "included")
                if note := graph_breaks_note(self.graph_breaks_before):
                    log.warning(note)
        if not eager_first:
            # An eager first step is not counted: the compiling step after it keeps the start-up
            # bound (dist.startup_timeout_s) and is not judged against an eager step's time.
            self.watchdog.done(seconds)
        self.step += 1
        if phases is not None:
            self.report_phases(phases, probe, first=steps_run == 0)
        faults.inject("step", self.env.rank, self.step)
        return stats

    @contextmanager
    def out_of_memory_explained(self) -> Iterator[None]:
        """An out-of-memory error says which of the planner's estimates was wrong: an accelerator's,
        or the CPU allocator's refusal of one allocation (a CPU that runs out otherwise has the
        operating system kill the process)."""
        try:
            with self.compile_failures_explained():
                yield
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            # The CPU allocator's refusal is the host's memory, on an accelerated run too
            host = not isinstance(exc, torch.OutOfMemoryError)
            raise TrainingError(self.out_of_memory_message(failing_part(exc), host)) from exc

    @contextmanager
    def compile_failures_explained(self) -> Iterator[None]:
        """A failure of torch.compile (a missing C++ compiler or Triton, an operation it cannot
        trace) in a step or an evaluation: one line naming the way out, not inductor's traceback of a
        hundred lines on every rank."""
        try:
            yield
        except Exception as exc:
            if not (self.cfg.strategy.compile and compile_failure(exc)):
                raise
            inner = getattr(exc, "inner_exception", None)  # what the backend raised
            if inner is not None and is_out_of_memory(inner):  # autotuning ran out: the memory message
                raise inner from exc
            cause = inner if inner is not None else exc
            first = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
            raise TrainingError(f"strategy.compile=true: torch.compile failed ({type(cause).__name__}: "
                                f"{first[:300]}); set strategy.compile=false to train without it") from exc

    def out_of_memory_message(self, part: str, host: bool = False) -> str:
        """``part``: where in the step it failed (``failing_part``); ``host``: the host's memory ran
        out (the CPU allocator refused an allocation), whatever the run's device."""
        gib = 2**30
        device = torch.device("cpu") if host else self.env.device
        allocator_peak = phase_peak_bytes(device)
        # A CPU has no allocator statistics: its process's peak resident memory stands in for them
        peak = (allocator_peak if allocator_peak is not None else peak_memory_mib(device) * 2**20) / gib
        peak_name = "the allocator's peak" if allocator_peak is not None else "the peak resident memory"
        held = state_bytes(self.model, self.built.optimizer, self.average_tensors)
        states = (held.params + held.optimizer) / gib
        where = f"step {self.step + 1} ran out of {device} memory in {part} (rank {self.env.rank})"
        if self.batch_choice is None:
            return (f"{where} at {peak_name} of {peak:.2f} GiB; `shardtrain plan` "
                    "estimates the step's memory, trainer.micro_batch_size=auto (with "
                    "trainer.global_batch_size) chooses a batch that fits")
        planned = self.batch_choice.estimate
        planned_states = (planned.params + planned.optimizer) / gib
        if part == "the optimizer step":  # AdamW's state is made there, at the first step
            wrong = "the optimizer step's estimate (AdamW's state and its temporaries)"
        elif not planned.host and states > planned_states * 1.05:  # host: offloaded, off the device
            wrong = "the parameter and optimizer state estimate"
        else:
            wrong = ("the activation and communication-buffer estimate (or memory outside the allocator's "
                     "view: fragmentation, other processes)")
        measured_states = (f"parameters and optimizer state {states:.2f} GiB (planned {planned_states:.2f})"
                           if not planned.host else "parameters and optimizer state in host memory "
                           "(strategy.cpu_offload)")
        return (f"{where}: trainer.micro_batch_size=auto chose {self.batch_choice.micro_batch_size} "
                f"with activation_checkpointing={self.batch_choice.activation_checkpointing} for a "
                f"planned peak of {planned.peak / gib:.2f} GiB ({planned.peak_phase}); measured: "
                f"{measured_states}, "
                f"{peak_name} before the failure {peak:.2f} GiB (planned activations "
                f"{planned.activations / gib:.2f} GiB, gathered {planned.gathered / gib:.2f} GiB): "
                f"{wrong} was wrong; lower trainer.memory_limit_gib or raise trainer.memory_margin")

    def agree_running_statistics(self) -> None:
        """BatchNorm-style running statistics averaged over the data-parallel ranks
        (distributed/running_stats.py)."""
        average_running_statistics(self.model, self.built.mesh, self.built.plan.data_parallel_dims)

    def preempted_anywhere(self) -> bool:
        """Whether any rank has been signalled to stop (one all-reduce; outside the steps, which
        carry the flag in their own)."""
        if self.preemption is None:
            return False
        flag = torch.tensor([float(self.preemption.requested)], device=self.env.device)
        if dist.is_initialized():
            dist.all_reduce(flag)
        return bool(flag.item())

    def stop_requested(self) -> bool:
        """This rank was signalled to stop (read by the step just before its loss all-reduce)."""
        return self.preemption is not None and self.preemption.requested

    def account(self, stats: StepStats) -> None:
        """Results, throughput, and the skip policy for non-finite steps."""
        self.throughput.add(self.layout.global_batch, stats.count, stats.flops, self.train_data.wait_s)
        if (not self.result.losses and self.task.count_unit == "samples"
                and stats.count > self.layout.global_batch and self.env.is_main):
            # More than one a sample is not samples (fewer may be: samples left out of a loss).
            log.warning(f"{type(self.task).__name__}.loss counts {stats.count:g} for a step of "
                        f"{self.layout.global_batch} samples, and its count_unit is 'samples': set "
                        "count_unit (e.g. 'tokens') so that the records name what it counts "
                        "(<count_unit>_per_s, <count_unit>_seen)")
        self.result.losses.append(stats.loss)
        self.result.metrics.append(dict(stats.metrics))
        self.result.grad_norms.append(stats.grad_norm)
        self.count_total += stats.count
        self.result.count_seen = round(self.count_total)
        if not stats.skipped:  # a skipped step's loss is non-finite: it has its own `skip` record
            self.consecutive_skips = 0
            self.interval_loss_sum += stats.loss * stats.count
            self.interval_count += stats.count
            for name, (total, divisor) in stats.metric_sums.items():
                sums = self.interval_metrics.setdefault(name, [0.0, 0.0])
                sums[0] += total
                sums[1] += divisor
            return
        limit = self.cfg.trainer.max_skipped_steps
        self.result.skipped_steps += 1
        self.consecutive_skips += 1
        empty = stats.count == 0
        if empty:
            self.info(f"step {self.step}: no {self.task.count_unit} to learn from on any rank "
                      f"({self.task.empty_count_hint(throughout=False)}); update skipped")
        else:
            self.info(f"step {self.step}: non-finite loss or grad norm "
                      f"(loss={stats.loss}, grad_norm={stats.grad_norm}); update skipped")
        # the count tells an empty step (0) from a non-finite one; a text field would be a file per
        # step in MLflow
        self.writer.write(self.step, "skip", {"loss": stats.loss, "grad_norm": stats.grad_norm,
                                              "count": stats.count})
        self.last_skip_empty = empty
        if self.consecutive_skips > limit:
            raise TrainingError(self.skipped_throughout(f"{self.consecutive_skips} consecutive steps",
                                                        f"limit trainer.max_skipped_steps={limit}"))

    def skipped_throughout(self, steps: str, limit: str) -> str:
        """Why ``steps`` in a row were all skipped as the last one was (``limit``: what stopped it)."""
        if not self.last_skip_empty:
            return (f"{steps} had a non-finite loss or gradient norm ({limit}); lower trainer.lr, keep "
                    "trainer.grad_clip_norm on, or check the data")
        return (f"{steps} had no {self.task.count_unit} to learn from ({limit}): "
                f"{self.task.empty_count_hint(throughout=True)}")

    def after_step(self, stats: StepStats) -> None:
        """Progress, the metrics record, evaluation and sampling, each when it is due."""
        t, step = self.cfg.trainer, self.step
        last = step == t.max_steps
        self.console.advance(stats.loss, self.throughput)
        record: dict = {}
        # A preemption's save comes next: evaluation and samples would eat the grace period the
        # scheduler gives before its SIGKILL (every rank agrees on stop_agreed: all skip alike).
        preempting = stats.stop_agreed
        # The steps since the last record are logged at a preemption's step too: the resume's
        # interval starts after it, and they would be in no record.
        if due(step, t.log_every) or last or preempting:
            record.update(self.train_record(stats))
        if (due(step, t.eval_every) or last) and self.val_batches:
            if preempting:  # saved as due: the resume runs it first, on these same weights
                self.evaluation_due = True
            else:
                record.update(self.validate())
        if due(step, t.sample_every) and step < t.max_steps and self.samples_text() and not preempting:
            self.sample()
        try:
            if "val_loss" in record and self.best is not None:
                self.judge_evaluation(record)
        finally:  # logged all the same when trainer.monitor names no logged value (it stops here)
            if self.stop_early and "loss" not in record:
                # The run ends at this step: its steps since the last record in none (found by review)
                record.update(self.train_record(stats))
            if record:
                self.log_record(record)

    def evaluate_skipped(self) -> None:
        """The evaluation a preemption's save skipped at the resumed step, before any further step:
        the weights are those it would have evaluated (the resume is exact), so its record, its
        rank among the best and its early-stop count are the uninterrupted run's. The resumed
        checkpoint is this step's: one that ranks is already saved, and the best link is moved to it."""
        self.evaluation_due = False
        self.info(f"step {self.step}: the evaluation the preemption skipped runs now")
        record = self.validate()
        self.log_record(record)
        if self.best is not None:
            # Another run's checkpoint (resumed from its directory) is not this run's to rank or
            # link: counted for early stopping only, as its own run counted it.
            self.judge_evaluation(record, rank=self.resumed_here, saved=True)
            self.best_save_due = False  # saved: the checkpoint just resumed
            if self.env.is_main and self.checkpointer is not None and self.best.ranking:
                self.checkpointer.point_best_at(self.best.ranking[0][0], f"step {self.step} was evaluated")
        if self.env.is_main and self.checkpointer is not None and self.result.resumed_from:
            self.checkpointer.mark_evaluated(Path(self.result.resumed_from))
            if self.best is not None and self.resumed_here:
                # A step this evaluation put out of the ranking goes, as a save's commit prunes: at
                # trainer.max_steps no save follows, and it stayed beyond keep_last and keep_best for
                # good (found by review)
                self.checkpointer.prune(self.step, {step for step, _ in self.best.ranking})

    def log_record(self, record: dict) -> None:
        """This step's train record, to the metrics log and the console."""
        self.writer.write(self.step, "train", record)
        # Before the first step (a skipped evaluation run first) the task's metrics are not known yet.
        self.console.show(self.step, record, tuple(name for name, _ in self.metric_kinds or ()))

    def check_monitor_logged(self) -> None:
        """A task's metric named by trainer.monitor, looked for in an evaluation of one validation
        micro-batch before the first step: misspelt (val_acc for val_accuracy), it stopped the run at
        its first evaluation, which may be hours in. val_loss (and its average's) is always logged."""
        t = self.cfg.trainer
        if (self.best is None or not self.val_batches or self.evaluation_due or self.stop_early
                or self.step >= t.max_steps or t.monitor.removeprefix("ema_") == "val_loss"):
            return
        self.watchdog.beat("evaluation", self.step)
        # A task that draws noise in its loss or collation (diffusion) leaves the run's random
        # streams as they were, so that a resumed run draws what the uninterrupted one does. Eager
        # under compile: compiled first for this one no-grad micro-batch, the blocks' training graph
        # would be a recompile, with any dimension the two differ in made dynamic for the run.
        eager = torch.compiler.set_stance("force_eager") if self.cfg.strategy.compile else nullcontext()
        with random_streams_kept(), eager:
            metrics = evaluate(self.model, self.task, [self.val_batches[0]], self.env.device,
                               self.built.mesh).metrics
        logged = ["val_loss", *(f"val_{name}" for name in metrics)]
        if t.monitor.removeprefix("ema_") not in logged:
            raise TrainingError(f"trainer.monitor={t.monitor} is not among the values the evaluation "
                                f"logs ({', '.join(sorted(logged))}); choose one of them")
        self.throughput.reset()  # the first interval's rates are the steps

    def validate(self) -> dict[str, float]:
        """The validation loss and the task's metrics (``val_*``), and with a weight average the
        same of the average (``ema_val_*``), as the metrics record's entries."""
        step = self.step
        # Each batch's forward is bounded (dist.timeout_s), not the whole pass: a large eval_samples
        # took longer than one step's bound and a healthy evaluation was stopped as a hang. Under
        # compile the first evaluation compiles its no-grad graphs: the start-up bound, as the first
        # compiled step has, not a step's (nor a stall at ten times a step's median).
        compiling = self.cfg.strategy.compile and not self.result.val_losses
        bound = ((self.cfg.dist.startup_timeout_s, "dist.startup_timeout_s (the first compiled evaluation)")
                 if compiling else (None, "the phase's own limit"))

        def beat(phase: str = "evaluation") -> None:
            self.watchdog.beat(phase, step, *bound)

        beat()
        self.agree_running_statistics()  # every rank evaluates the same model
        with self.compile_failures_explained():
            val, val_metrics, _ = evaluate(self.model, self.task, self.val_batches, self.env.device,
                                           self.built.mesh, beat)
        self.result.val_losses.append((step, val))
        self.result.val_metrics.append((step, dict(val_metrics)))
        record = {"val_loss": val, **{f"val_{name}": value for name, value in val_metrics.items()}}
        # A training metric named like a validation one's form (its val_acc beside an evaluation's
        # acc) would be overwritten in the record without a word (found by review); every rank has
        # the same names
        trained = {name for name, _ in self.metric_kinds or ()}
        if clashes := sorted(key for name in val_metrics for key in (f"val_{name}", f"ema_val_{name}")
                             if key in trained):
            raise TrainingError(f"{type(self.task).__name__}: training metrics {clashes} are named like "
                                "its validation metrics' record fields (val_<metric>, ema_val_<metric>), "
                                "which would overwrite them; rename them")
        if self.average is not None:
            beat("evaluation of the weights' average")  # a bound of its own
            with self.average.swapped_in(), self.compile_failures_explained():
                val, val_metrics, _ = evaluate(
                    self.model, self.task, self.val_batches, self.env.device, self.built.mesh,
                    lambda: beat("evaluation of the weights' average"))
            self.result.average_val_losses.append((step, val))
            record["ema_val_loss"] = val
            record.update({f"ema_val_{name}": value for name, value in val_metrics.items()})
        return record

    def judge_evaluation(self, record: dict[str, float], rank: bool = True, saved: bool = False) -> None:
        """trainer.monitor's value of this evaluation: saved at its step when it ranks among
        checkpoint.keep_best's (``saved``: its checkpoint is the one just resumed), and counted
        towards trainer.early_stop_patience when it does not improve on the best."""
        t, step = self.cfg.trainer, self.step
        if t.monitor not in record:
            logged = ", ".join(sorted(name for name in record if name.startswith(("val_", "ema_val_"))))
            raise TrainingError(f"trainer.monitor={t.monitor} is not among the values the evaluation "
                                f"logged ({logged}); choose one of them")
        value = record[t.monitor]
        if self.best.judge(step, value, rank):
            self.best_save_due = True
            kept = "its checkpoint, just resumed, is kept" if saved else "saving it"
            self.info(f"checkpoint.keep_best: {t.monitor} {value:.6g} at step {step} ranks among the "
                      f"{self.best.keep} best; {kept} ({self.best.describe()})")
        patience = t.early_stop_patience
        if patience and self.best.stale >= patience and step < t.max_steps:  # at max_steps: finished
            best_step, best_value = self.best.best or (0, float("nan"))
            self.best.stopped_at = step  # before this step's save, which records it
            self.stop_early = self.result.stopped_early = True
            self.info(f"early stop at step {step}: {t.monitor} has not improved on {best_value:.6g} "
                      f"(step {best_step}) by more than {t.early_stop_min_delta:g} in {self.best.stale} "
                      f"evaluations (trainer.early_stop_patience={patience})")

    def record_fields(self) -> frozenset[str]:
        """The names a train record (with validation) has of its own: a task's metric may not take one."""
        return frozenset({"step", "kind", "time", "loss", "val_loss", "ema_val_loss", "grad_norm", "lr",
                          "peak_memory_mib", *self.throughput.field_names()})

    def train_record(self, stats: StepStats) -> dict:
        """The logged means since the last record, over the steps not skipped (NaN if every one
        was), and the counters they cover are reset."""
        names = [name for name, _ in self.metric_kinds or ()]
        metric_sums = {name: self.interval_metrics.get(name, (0.0, 0.0)) for name in names}
        record = {
            "loss": ratio(self.interval_loss_sum, self.interval_count),
            **{name: ratio(total, divisor) for name, (total, divisor) in metric_sums.items()},
            "grad_norm": stats.grad_norm,
            "lr": stats.lr,
            "peak_memory_mib": peak_memory_mib(self.env.device),
            self.throughput.seen_field(): self.result.count_seen,
            **self.throughput.report(),
        }
        self.interval_loss_sum = self.interval_count = 0.0
        self.interval_metrics.clear()
        self.throughput.reset()
        return record

    @cached_property
    def tokenizer_name(self) -> str | None:
        """The name of the tokenizer the model's text is read with (the task's text_tokenizer()),
        which checkpoints record."""
        return getattr(self.task.text_tokenizer(), "name", None)  # None without one

    def samples_text(self) -> bool:
        """Text is sampled during training for a task that has a tokenizer to decode it with."""
        return self.task.text_tokenizer() is not None

    def sample(self) -> str:
        """A sample from the current weights (all ranks take part; gathered once, see generation).

        Skipped, with one line saying why, when the gathered copy would not fit beside the training
        state: sampling is a convenience and must never be what runs a job out of memory.
        """
        t = self.cfg.trainer
        self.watchdog.beat("sampling", self.step)
        faults.inject("sample", self.env.rank, self.step)
        tokenizer = self.task.text_tokenizer()
        prompt = prompt_ids(tokenizer, t.sample_prompt)
        choice = generation_mode(self.model, self.built.plan.param_dtype, self.env.device,
                                 local_processes=self.env.local_world_size,
                                 positions=positions_needed(len(prompt), t.sample_tokens))
        if choice.mode != "gathered":
            self.info(f"sample at step {self.step} skipped: {choice.reason()} (`shardtrain generate` "
                      "runs a checkpoint unit by unit)")
            return ""
        # The copy is built as the trained model was: with finetune=lora/qlora, adapters on the base.
        plain = gathered_copy(self.model, with_adapters(self.task.build_model, self.cfg, self.env.device),
                              self.env.device, self.built.plan.param_dtype)
        ids = generate(plain, prompt, t.sample_tokens, temperature=0.8, top_k=40, seed=t.seed,
                       vocab_limit=tokenizer.vocab_size, device=self.env.device,
                       stop_tokens=tokenizer.stop_ids)
        del plain
        text = tokenizer.decode(prompt + ids)
        self.writer.write(self.step, "sample", {"text": text})
        self.info(f"sample at step {self.step}:\n{text}")
        return text

    def report_phases(self, phases: PhaseMemory, probe: DtypeProbe | None, first: bool) -> None:
        """Per-phase memory to the metrics log; after this process's first step, the per-rank table
        and, where its dtypes were probed (not a compiled run's resumed first step), the dtype table."""
        record = {f"{phase}.{key}": value for phase, entry in phases.record.items()
                  for key, value in entry.items()}
        self.writer.write(self.step, "memory", record)
        if not first:
            return
        after = phases.record
        entry = {"rank": self.env.rank, "params_mib": after["backward"]["params_mib"],
                 "grads_mib": after["backward"]["grads_mib"],
                 "optimizer_mib": after["optimizer"]["optimizer_mib"], "phases": after}
        ranks = gather_rank_entries(entry)
        if ranks is None:  # rank 0 writes and reports every rank's
            return
        self.writer.write(self.step, "memory_ranks", {"ranks": ranks})
        dtypes = dtype_lines(probe, phases.grad_dtypes, self.built.plan) if probe is not None else []
        self.info("\n".join(dtypes + rank_lines(ranks, list(PhaseMemory.PHASES), self.step)))


def check_something_to_judge(cfg: Config, val: SampleSource | None) -> None:
    """checkpoint.keep_best and trainer.early_stop_patience judge validation values: a run without
    validation data is refused before its model is built."""
    keep_best = cfg.checkpoint.enabled and cfg.checkpoint.keep_best
    judged = [key for key, on in (("checkpoint.keep_best", keep_best),
                                  ("trainer.early_stop_patience", cfg.trainer.early_stop_patience)) if on]
    if judged and (val is None or not val.num_samples):
        verb = "judges" if len(judged) == 1 else "judge"
        raise ConfigError(f"{' and '.join(judged)} {verb} a validation value, and this run has no validation "
                          "data; give it some (data.val_percent, or the task's validation set) or set "
                          f"{'=0 and '.join(judged)}=0")


def check_sample_fits(trainer: TrainerConfig, task: Task, model: torch.nn.Module) -> None:
    """The text samples (at the end, and every ``sample_every`` steps) fit the model's positions:
    refused at start-up, not after the run has trained. The prompt's length is known only once the
    task has its tokenizer, and a Hugging Face model's positions only from its config."""
    max_len = getattr(model, "max_seq_len", None)
    tokenizer = task.text_tokenizer()
    if tokenizer is None and trainer.sample_every:  # a class defining it, returning None (review)
        raise ConfigError(f"trainer.sample_every={trainer.sample_every} samples text, and "
                          f"{type(task).__name__}.text_tokenizer() returned None: no tokenizer to decode it "
                          "with; return one, or drop the setting")
    if trainer.sample_tokens == 0 or max_len is None or tokenizer is None:
        return
    prompt = prompt_ids(tokenizer, trainer.sample_prompt)
    if (needed := positions_needed(len(prompt), trainer.sample_tokens)) > max_len:
        fix = (f"set trainer.sample_tokens to at most {max_len - len(prompt) + 1}" if len(prompt) <= max_len
               else "shorten trainer.sample_prompt")
        raise ConfigError(
            f"trainer.sample_tokens={trainer.sample_tokens} after trainer.sample_prompt ({len(prompt)} "
            f"tokens) needs {needed} positions, the model has {max_len}; {fix} (trainer.sample_tokens=0: "
            "no sample)")


def run_training(cfg: Config, *, task: Task | None = None,
                 optimizer_factory: OptimizerFactory | None = None) -> TrainResult:
    """The library entry point: build, train, return the per-step results (on every rank).

    ``task`` holds the user's model, data and loss (docs/tasks.md; default: the task ``cfg.task``
    names, the built-in language model unless set); ``optimizer_factory(model)`` receives the
    sharded model (default: AdamW with the config's settings).
    """
    return Trainer.create(cfg, task=task, optimizer_factory=optimizer_factory).fit()
