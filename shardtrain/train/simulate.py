"""Simulate one training step of rank 0 at any world size, in one process, without real weights.

``simulate`` builds the configured model on the meta device, shards it with the real ``parallelize``
onto a device mesh over PyTorch's *fake* process group (every collective returns at once), moves it
to fake tensors (``FakeTensorMode``: shapes, dtypes and storages, no data) and runs one steady-state
training step (every micro-batch's forward and backward, the global gradient norm, clipping, AdamW)
under FSDP2's memory tracker. What rank 0 holds at the step's peak is what a real run would hold on
each of its devices, minus allocator fragmentation and the CUDA context.

PyTorch APIs and behaviour this relies on that are not public (pinned by tests/test_simulate.py):
- ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (memory by category at the peak);
  :class:`PhasePeakTracker` overrides its private ``_update_peak_stats`` to keep one peak per phase
  of the step, reading the private ``_curr_mem_snap``, ``_in_opt`` and ``_mod_tracker`` (whose
  ``parents`` and ``is_bw`` are documented attributes of ``ModTracker``).
- the ``"fake"`` process-group backend (``torch.testing._internal.distributed.fake_pg``, registered
  by ``torch.distributed``) with its built-in fake store.
- under tensor parallelism, ``torch._guards.TracingContext`` (DTensor's shape propagation finds its
  fake mode there: ``shapes_worked_out_apart``), and between fake worlds (``fake_world``) DTensor's
  sharding and redistribution caches emptied (``distributed.env.release_dtensor_caches``).

Probe mode: the blocks of a decoder are identical and FSDP units are per block, so within one phase
of the step (say, the backward of the model's last block) every byte the tracker sees is affine in
the number of layers; the step's peak is the largest phase, which may change with depth.
``probe=True`` simulates two shallow depths with the real width, world size and strategy, extends
every phase along the line through them to the configured depth and takes the largest phase; the
tests check it against full-depth simulation.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModMemStats, _FSDPRefType
from torch.distributed.device_mesh import init_device_mesh

from shardtrain.checkpoint import layout
from shardtrain.config.loader import formulas_know
from shardtrain.config.plan import resolve_plan, with_global_batch
from shardtrain.config.schema import Config
from shardtrain.diagnostics.kept import fake_kernel_wants_bf16, fake_tensor_errors_unlogged
from shardtrain.diagnostics.memory import state_bytes
from shardtrain.diagnostics.planner import Estimate, estimate, planned_model
from shardtrain.distributed.env import destroy_distributed
from shardtrain.distributed.parallelize import (
    outermost_blocks,
    parallelize,
    register_forward_methods,
    sum_gradients,
)
from shardtrain.distributed.preconditions import resolve_wrap_classes
from shardtrain.distributed.sharded_model import with_adapters
from shardtrain.errors import ConfigError
from shardtrain.tasks.language_model import LanguageModelTask
from shardtrain.tasks.samples import tensors_of
from shardtrain.tasks.task import Task, run_wrap_policy, task_from_config
from shardtrain.train.ema import WeightAverage
from shardtrain.train.grad import check_gradients_sharded, clip_grads_, clip_scale, global_grad_norm
from shardtrain.train.optim import build_optimizer
from shardtrain.train.step import loss_context, prepare_micro_batch

END_BLOCKS = 3  # blocks at either end of the stack whose forward and backward are phases of their own
OTHER_BLOCKS = "other blocks"  # never above the end blocks: affine in the block index

# Categories of FSDPMemTracker's snapshots, grouped the way the planner reports them.
ACTIVATION_KINDS = ("Activation", "Temp")
GATHERED_KINDS = ("Unsharded Param", "All Gather", "Reduce Scatter", "Unsharded Grad")
# What strategy.cpu_offload keeps in host memory on an accelerator (FSDP2's CPUOffloadPolicy).
OFFLOADED_KINDS = tuple(kind.value for kind in (_FSDPRefType.SHARDED_PARAM, _FSDPRefType.SHARDED_GRAD,
                                                _FSDPRefType.OPT))


class PhasePeakTracker(FSDPMemTracker):
    """FSDPMemTracker that keeps the peak of each phase of the step instead of each module's.

    Phases: forward and backward of each of the three blocks at either end of the stack
    (``blocks[-1]`` is the model's last block; FSDP's prefetch and the reduce-scatter in flight
    make the end blocks differ from the rest) and of the blocks between them; forward before the
    blocks (the embeddings) and after them (the head and the loss); backward before the blocks and
    after them; the gradient norm; the optimizer step. Within one phase the bytes are affine in the
    depth, which probe mode relies on; blocks between the ends are affine in their index too, so
    they never exceed ``blocks[2]`` or ``blocks[-3]``. Keeping no per-module peaks is
    also what makes a deep model fast: the stock tracker loops over every module it has seen on
    every operator.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, blocks: list[str]) -> None:
        super().__init__(model, optimizer)
        # ModTracker names a module by its root's class name and its path.
        prefix = type(model).__name__
        self.block_index = {f"{prefix}.{name}": index for index, name in enumerate(blocks)}
        self.peaks: dict[str, dict[str, int]] = {}
        # The activation peak of a phase need not fall on the moment of its total peak.
        self.activation_peaks: dict[str, int] = {}
        self.activation_kinds = [kind for kind in _FSDPRefType if kind.value in ACTIVATION_KINDS]
        self._blocks_done = {"forward": False, "backward": False}
        # Set by the caller after backward: "gradient norm", then "optimizer" (until zero_grad ends).
        self.stage: str | None = None
        # Set by the caller with several micro-batches: the first, middle and last ones hold
        # different gradients and buffers, so each is a phase of its own.
        self.micro_batch = ""

    def _fsdp_param_group_pre_backward(self, fsdp_mod, orig_pre_backward):
        return self._with_stats(fsdp_mod, super()._fsdp_param_group_pre_backward(fsdp_mod, orig_pre_backward))

    def _fsdp_param_group_post_backward(self, fsdp_mod, orig):
        return self._with_stats(fsdp_mod, super()._fsdp_param_group_post_backward(fsdp_mod, orig))

    def _with_stats(self, fsdp_mod: nn.Module, hook):
        """The stock tracker keys a unit's backward by the module it instrumented last, and makes its
        record only when that module's forward runs. The chunked loss never calls the head module
        (it reads its weight): give such a module its record when its backward comes."""
        def run(*args, **kwargs):
            if fsdp_mod not in self.memory_tracking:
                self.memory_tracking[fsdp_mod] = _FSDPModMemStats(type(fsdp_mod).__name__)
            return hook(*args, **kwargs)
        return run

    def block_phase(self, direction: str, index: int) -> str:
        last = len(self.block_index) - 1
        if last - index < END_BLOCKS:
            return f"{direction} blocks[{index - last - 1}]"
        if index < END_BLOCKS:
            return f"{direction} blocks[{index}]"
        return f"{direction} {OTHER_BLOCKS}"

    def phase(self) -> str:
        phase = self.step_phase()
        return f"{phase} ({self.micro_batch})" if self.micro_batch and self.stage is None else phase

    def step_phase(self) -> str:
        if self._in_opt:
            return "optimizer"
        if self.stage is not None:
            return self.stage
        direction = "backward" if self._mod_tracker.is_bw else "forward"
        if direction == "forward" and self._blocks_done["backward"]:
            self._blocks_done = {"forward": False, "backward": False}  # the next micro-batch
        active = [self.block_index[name] for name in self._mod_tracker.parents & self.block_index.keys()]
        if active:
            # A block's hooks may still be running as the next one starts: the newest is the one
            # that runs (by index, never by the set's order, which changes with string hashing).
            index = max(active) if direction == "forward" else min(active)
            end = len(self.block_index) - 1 if direction == "forward" else 0
            self._blocks_done[direction] = self._blocks_done[direction] or index == end
            return self.block_phase(direction, index)
        return f"{direction} {'end' if self._blocks_done[direction] else 'start'}"

    def _update_peak_stats(self, peak_state) -> None:  # noqa: ARG002 - the base class's signature
        snapshots = self._curr_mem_snap.values()
        total = sum(snapshot["Total"] for snapshot in snapshots)
        phase = self.phase()
        # The optimizer's temporaries are its own, not activations (its phase total counts them).
        activations = 0 if self._in_opt else sum(int(snapshot.get(kind, 0)) for snapshot in snapshots
                                                 for kind in self.activation_kinds)
        if activations > self.activation_peaks.get(phase, -1):
            self.activation_peaks[phase] = activations
        if total > self.peaks.get(phase, {}).get("Total", -1):
            merged: dict[str, int] = {}
            for snapshot in snapshots:
                for kind, n in snapshot.items():
                    name = str(getattr(kind, "value", kind))
                    merged[name] = merged.get(name, 0) + int(n)
            self.peaks[phase] = merged


@dataclass
class Simulation:
    """Rank 0's bytes during one simulated training step (rank 0 holds the largest shard)."""

    strategy: str
    world_size: int
    mesh: tuple[int, ...]
    activation_checkpointing: str
    layers: int
    params: int  # sharded parameters, storage dtype
    grads: int  # sharded gradients after the step's backward
    optimizer: int  # AdamW state
    phases: dict[str, dict[str, int]]  # each phase's peak, by FSDPMemTracker category and "Total"
    activation_peaks: dict[str, int]  # each phase's most activations and backward temporaries
    seconds: float
    probed_layers: tuple[int, ...] = ()
    tensor_parallel: int = 1  # the mesh's tp dimension (its last), 1 without one

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name]["Total"])

    @property
    def peak_by_kind(self) -> dict[str, int]:
        return self.phases[self.peak_phase]

    @property
    def peak(self) -> int:
        return self.peak_by_kind["Total"]

    @property
    def activations(self) -> int:
        """The activation peak: the most saved activations and backward temporaries (the tracker's
        categories) at any moment of the step; at the step's peak they may be lower."""
        return max(self.activation_peaks.values())

    @property
    def gathered(self) -> int:
        """Unsharded parameters and gradients, all-gather and reduce-scatter buffers at the peak."""
        return sum(self.peak_by_kind.get(kind, 0) for kind in GATHERED_KINDS)

    def fits(self, device_memory: int) -> bool:
        return self.peak <= device_memory


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake default process group of ``world_size`` ranks in which this process is rank 0."""
    if dist.is_initialized():
        raise ConfigError("cannot simulate inside a running distributed job; "
                          "run `shardtrain plan --simulate` as a single process")
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        yield
    finally:
        # Also empties DTensor's caches, whose native one keys a mesh by its shape and names, not
        # its process groups: the next fake world's meshes would find this one's destroyed groups.
        destroy_distributed()


def block_names(model: nn.Module, classes: tuple[type, ...]) -> list[str]:
    """The modules the wrap policy made units of, in order, as ``parallelize`` chooses them."""
    return [name for name, _ in outermost_blocks(model, classes)]


@contextmanager
def shapes_worked_out_apart() -> Iterator[None]:
    """DTensor works out each operator's output shapes (tensor parallelism's, and the gradient
    norm's over 2-D gradients) by running it on fake tensors of the unsplit sizes, in the fake mode
    it detects: a ``TracingContext``'s, else the active one, which here is the simulator's own, so
    the tracker would count them (a [tokens, vocabulary] fp32 tensor for the loss). No device ever
    holds them: a fake mode of their own, as in a real run, keeps them out of the tracker's count."""
    with tracing(TracingContext(FakeTensorMode())):
        yield


@contextmanager
def collector_paused() -> Iterator[None]:
    """No garbage collection inside: storages in reference cycles are freed whenever the collector
    happens to run, which the tracker would see at a random moment of the step; without it every
    run gives the same bytes."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _simulate_depth(cfg: Config, world_size: int, local_world_size: int, task: Task) -> Simulation:
    """One step of ``task`` (bound to ``cfg``) on its example batch."""
    started = time.perf_counter()
    plan = resolve_plan(cfg.strategy, world_size, min(local_world_size, world_size), accelerated=True)
    # Fake tensors hold no token ids, so a row exchange has no split sizes: the simulated step
    # gathers the embedding table and reduces its whole gradient, which an exchanging run never
    # holds (an upper bound for that unit).
    plan = replace(plan, embedding_lookup="gather")
    trainer = cfg.trainer
    # Real tensors, made before the fake mode: a task's collate and draws may read values.
    batch = task.example_batch(trainer.micro_batch_size)
    count = task.count(batch)  # the language model's: a plain number, known ahead
    with collector_paused(), fake_world(world_size):
        mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
        # Shard on the meta device: FSDP2 chunks every parameter into world-size pieces, which
        # meta tensors do in C++ and fake tensors in Python (minutes at 1,024 ranks).
        with torch.device("meta"):
            model = with_adapters(task.build_model, cfg, torch.device("meta"))()  # finetune=lora
        policy = run_wrap_policy(task, cfg)
        blocks = block_names(model, resolve_wrap_classes(model, policy))
        parallelize(model, mesh, plan, policy, task.tensor_parallel_hook())
        register_forward_methods(model, task.forward_methods)
        sum_gradients(model)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            if hasattr(model, "init_buffers"):
                model.init_buffers()
            # The kernel a GPU runs (fused by default; foreach's temporaries, a group's square-rooted
            # second moments, can be the peak of a step).
            optimizer = build_optimizer(model, trainer)
            # A steady-state step: the optimizer's state exists before it starts, as from step 2 on.
            for param in model.parameters():
                if param.requires_grad:  # a LoRA run's frozen base has none
                    param.grad = torch.zeros_like(param)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if trainer.ema_decay:
                # The weights' average, held beside each parameter's AdamW state: the tracker counts
                # it with the optimizer's (its own track_external does nothing), as the planner
                # does. Its update is in place, with no temporaries of its own. After the warm-up
                # step: AdamW makes a parameter's state only where it finds none.
                average = WeightAverage(model, trainer.ema_decay)
                for param, averaged in zip(average.parameters, average.averages, strict=True):
                    optimizer.state[param][layout.AVERAGE_KEY] = averaged
            tracker = PhasePeakTracker(model, optimizer, blocks)
            tracker.track_inputs(tuple(tensors_of(batch)))
            steps = trainer.grad_accum_steps
            with tracker, shapes_worked_out_apart():
                for index in range(steps):
                    if steps > 1:
                        tracker.micro_batch = ("first micro-batch" if index == 0 else "last micro-batch"
                                               if index == steps - 1 else "middle micro-batches")
                    prepare_micro_batch(model, index, steps, plan.grad_accumulation == "sharded")
                    with loss_context(plan.tensor_parallel):
                        out = task.loss(model, batch)
                        (out.loss / (count if count is not None else out.count)).backward()
                tracker.stage = "gradient norm"
                grads = state_bytes(model, None).grads
                params = [p for p in model.parameters() if p.grad is not None]
                check_gradients_sharded(model, params)
                norm = global_grad_norm(params, mesh)
                if trainer.grad_clip_norm > 0:
                    clip_grads_(params, clip_scale(trainer.grad_clip_norm, norm))
                tracker.stage = "optimizer"
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            held = state_bytes(model, optimizer)
    # The fake step runs on "cpu", where CPUOffloadPolicy moves nothing: on the accelerator it plans
    # for, the sharded states are host memory (found by review: the peak counted them, and said
    # "no" where the planner, which moves them, said it fits). Each phase's peak less them, at the
    # moment of the phase's peak with them (through a phase they change only by the gradients made).
    phases = {name: on_device(kinds) for name, kinds in tracker.peaks.items()} if plan.cpu_offload \
        else tracker.peaks
    return Simulation(
        strategy=plan.strategy, world_size=world_size, mesh=plan.mesh_shape,
        activation_checkpointing=cfg.strategy.activation_checkpointing, layers=len(blocks),
        params=held.params, grads=grads, optimizer=held.optimizer, phases=phases,
        activation_peaks=tracker.activation_peaks,
        seconds=time.perf_counter() - started, tensor_parallel=plan.tensor_parallel,
    )


def on_device(kinds: dict[str, int]) -> dict[str, int]:
    """A phase's bytes by category without those ``strategy.cpu_offload`` holds in host memory."""
    host = sum(kinds.get(kind, 0) for kind in OFFLOADED_KINDS)
    return {kind: 0 if kind in OFFLOADED_KINDS else value for kind, value in kinds.items()} | {
        "Total": kinds["Total"] - host}


def _extrapolate(probes: list[Simulation], layers: int) -> Simulation:
    """Every phase's bytes at ``layers`` on the line through two probes' (depth, bytes)."""
    low, high = probes
    span = high.layers - low.layers

    def at(a: int, b: int) -> int:
        return a + (b - a) * (layers - low.layers) // span

    # The blocks between the ends are never above them; a phase only the deeper probe has is one
    # of those.
    extended = [phase for phase in high.phases if OTHER_BLOCKS not in phase and phase in low.phases]
    phases = {phase: {kind: at(low.phases[phase].get(kind, 0), n) for kind, n in high.phases[phase].items()}
              for phase in extended}
    activation_peaks = {phase: at(low.activation_peaks[phase], high.activation_peaks[phase])
                        for phase in extended}
    return replace(high, layers=layers, phases=phases, activation_peaks=activation_peaks,
                   seconds=low.seconds + high.seconds,
                   probed_layers=(low.layers, high.layers), params=at(low.params, high.params),
                   grads=at(low.grads, high.grads), optimizer=at(low.optimizer, high.optimizer))


def probe_depths(cfg: Config) -> tuple[int, int] | None:
    """Two depths to probe, or None: simulate in full (a model not deeper than the probes,
    activation checkpointing of every k-th block, where blocks differ, or a Hugging Face model,
    whose depth is its config.json's, not ``model.n_layers``)."""
    first = 2 * END_BLOCKS  # the three blocks at each end, none in between
    if (cfg.model.name != "llama" or cfg.strategy.activation_checkpointing == "every_k"
            or cfg.model.n_layers <= first + 1):
        return None
    return first, first + 1


def bound_task(cfg: Config, task: Task | None = None) -> Task:
    """``task`` (default: the one ``cfg`` names), bound to ``cfg``."""
    task = task if task is not None else task_from_config(cfg)
    task.cfg = cfg  # as the trainer sets it (an overriding bind() may skip super().bind())
    task.bind(cfg)
    return task


def simulate(cfg: Config, world_size: int, local_world_size: int, *, probe: bool = True,
             task: Task | None = None) -> Simulation:
    """Rank 0's memory during one training step of ``cfg``'s task (or ``task``) at ``world_size``
    ranks, on the task's example batch.

    ``probe``: simulate two shallow copies of the built-in model (6 and 7 blocks) and extend every
    phase's bytes along the line through them (exact for a stack of identical blocks); the full
    depth where that does not apply, or for any other task.
    """
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be at least 1")
    if cfg.strategy.float8:
        raise ConfigError("the simulator cannot run strategy.float8 (torchao's float8 matmuls need a GPU); "
                          "`shardtrain plan` without --simulate counts it")
    if cfg.finetune.method == "qlora":
        # Its base is quantised to NF4 by torchao as FSDP shards it, from real weights: the meta
        # model here would be simulated with an fp32 base, four times and more the bytes.
        raise ConfigError("the simulator cannot run finetune=qlora (it would simulate the base in fp32, "
                          "not NF4); `shardtrain plan` without --simulate counts the 4-bit base")
    plan = resolve_plan(cfg.strategy, world_size, min(local_world_size, world_size), accelerated=True)
    # Replicas, not the mesh's first dimension: FULL_SHARD x tp's is its shard dimension (found by
    # a trial: refused for nothing)
    accumulates = cfg.trainer.grad_accum_steps > 1 and plan.grad_accumulation == "sharded"
    if plan.size("dp_replicate") > 1 and accumulates:
        # FSDP2's accumulation of partial reductions across replicas fails on the fake process
        # group (the reduce-scatter output is not shaped like the shard there).
        raise ConfigError(
            f"the simulator cannot run {plan.strategy} with more than one micro-batch a step "
            f"({cfg.trainer.grad_accum_steps}) and sharded accumulation; simulate with "
            "trainer.grad_accum_steps=1 and without trainer.global_batch_size (micro-batches after the "
            "first add only the sharded gradients, which the planner counts)")
    task = bound_task(cfg, task)
    builtin = formulas_know(task, cfg.strategy.tensor_parallel)
    depths = probe_depths(cfg) if probe and builtin else None
    with fake_step_failures_explained(task):
        if depths is None:
            return _simulate_depth(cfg, world_size, local_world_size, task)
        probes = [_simulate_depth(c, world_size, local_world_size, bound_task(c, LanguageModelTask()))
                  for c in (replace(cfg, model=replace(cfg.model, n_layers=d)) for d in depths)]
    return _extrapolate(probes, cfg.model.n_layers)


@contextmanager
def fake_step_failures_explained(task: Task) -> Iterator[None]:
    """A kernel whose fake version refuses what the real one takes (torch's grouped_mm, transformers'
    MoE experts: bf16 only) is one line naming what to simulate instead; any other error is the
    task's or the model's own, raised as it is (its traceback says where)."""
    try:
        with fake_tensor_errors_unlogged():  # torch logs the error with its traceback, then raises it
            yield
    except RuntimeError as exc:
        if not fake_kernel_wants_bf16(exc):
            raise
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(f"the simulator could not run a step of {type(task).__name__} on fake tensors "
                          f"({first[:200]}): a mixture-of-experts model's grouped_mm experts run on fake "
                          "tensors in bf16 only; simulate with strategy.mixed_precision=bf16-mixed") from exc


def simulation_rows(cfg: Config, world_sizes: list[int], strategies: list[str],
                    checkpointing: list[str], local_world_size: int, probe: bool = True,
                    ) -> list[tuple[Simulation, Estimate | None]]:
    """The simulation and the planner's estimate (the language model's only; None for other
    tasks) of every combination of world size, strategy and activation checkpointing mode
    (``strategy.activation_checkpointing``'s values), in the order given."""
    # With trainer.global_batch_size, the accumulation steps of each world size (as the run's).
    cases = [(replace(with_global_batch(cfg, world), strategy=replace(
        cfg.strategy, sharding_strategy=strategy, activation_checkpointing=ac)), world)
             for world in world_sizes for strategy in strategies for ac in checkpointing]
    task = task_from_config(cfg)
    sims = [simulate(case, world, local_world_size, probe=probe, task=task) for case, world in cases]
    if not formulas_know(task, cfg.strategy.tensor_parallel):
        return [(sim, None) for sim in sims]
    model = planned_model(cfg)
    if cfg.strategy.tensor_parallel > 1 and not hasattr(model, "tensor_parallel_plan"):
        # The planner splits parameters by the model's own plan; without one it has no figures.
        return [(sim, None) for sim in sims]
    # The planner asked about the run simulated: one that gathers the embedding table (above).
    gathering = [replace(case, strategy=replace(case.strategy, embedding_lookup="gather"))
                 for case, _ in cases]
    return [(sim, estimate(case, model, case.strategy.sharding_strategy, world, local_world_size))
            for sim, case, (_, world) in zip(sims, gathering, cases)]


def planned(plan: Estimate | None, what: str) -> str:
    """The planner's figure in GiB, or "n/a" where its formulas do not apply (other tasks)."""
    return f"{getattr(plan, what) / 2**30:.1f}" if plan is not None else "n/a"


def simulation_table(rows: list[tuple[Simulation, Estimate | None]], device_memory: int | None,
                     markdown: bool = False) -> str:
    """Per-rank GiB of each simulation, the planner's activation peak and peak beside it."""
    gib = 2**30
    head = ["ranks", "strategy", "AC", "params", "grads", "optimizer", "activation peak (planner)",
            "peak (planner)", "peak phase"] + (["fits"] if device_memory else []) + ["seconds"]
    lines = []
    for sim, plan in rows:
        strategy = sim.strategy + (f" x TP {sim.tensor_parallel}" if sim.tensor_parallel > 1 else "")
        cells = [str(sim.world_size), strategy, {"none": "no", "all": "yes"}.get(
                     sim.activation_checkpointing, sim.activation_checkpointing),
                 f"{sim.params / gib:.2f}", f"{sim.grads / gib:.2f}", f"{sim.optimizer / gib:.2f}",
                 f"{sim.activations / gib:.1f} ({planned(plan, 'activations')})",
                 f"{sim.peak / gib:.1f} ({planned(plan, 'peak')})", sim.peak_phase]
        if device_memory:
            cells.append("yes" if sim.fits(device_memory) else "no")
        cells.append(f"{sim.seconds:.1f}")
        lines.append(cells)
    if markdown:
        rule = ["---"] * len(head)
        return "\n".join("| " + " | ".join(r) + " |" for r in [head, rule, *lines])
    widths = [max(len(r[i]) for r in [head, *lines]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *lines])
