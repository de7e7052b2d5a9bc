"""The task: the one place a user's code enters training (model, units, data, loss).

A task says how to build the model, which of its module classes are the FSDP units, which datasets
to train and validate on, and how to compute the loss of a batch. Everything else (sharding, mixed
precision, accumulation with the global normalisation, clipping, checkpoints with exact resume at
any world size, preemption, diagnostics, metrics, validation) is the framework's, the same for every
task. The built-in language model is a task on this contract (``tasks/language_model.py``).

Required: ``build_model``, ``train_dataset`` and ``loss``. Everything else is optional; see
docs/tasks.md for the whole contract and what the framework guarantees.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import logging
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from shardtrain.config.classpath import import_object, qualified_name
from shardtrain.config.loader import given_model_factory
from shardtrain.config.options import plain_options, read_options, same_value
from shardtrain.config.schema import Config, TaskConfig
from shardtrain.data.batches import SampleSource
from shardtrain.data.tokenizer import Tokenizer
from shardtrain.errors import ConfigError, ModelError
from shardtrain.tasks.samples import MapSamples

log = logging.getLogger("shardtrain")

# What the framework looks up on a task beside Task's own methods and attributes (docs/tasks.md).
OPTIONAL_HOOKS = ("draw", "init_parameter", "init_parameter_elementwise", "init_parameter_constants",
                  "parallelize_tensors")

Number = torch.Tensor | float | int


@dataclass
class LossOutput:
    """What ``Task.loss`` returns for one micro-batch.

    ``loss``: the loss *summed* over the micro-batch (a scalar tensor with a gradient). ``count``:
    what it is normalised by (tokens, samples, valid positions, elements: the task decides). The
    framework divides the sum over all ranks and micro-batches by the count over all ranks and
    micro-batches, so any split of the global batch gives the same gradient. ``metrics``: extra
    named values to log, each a sum normalised by the same global count, or a ``(sum, count)`` pair
    with a count of its own.
    """

    loss: torch.Tensor
    count: Number
    metrics: Mapping[str, Number | tuple[Number, Number]] = field(default_factory=dict)


class Task:
    """Subclass it; see the module docstring and docs/tasks.md.

    ``Options``: a dataclass of the task's typed options, set from the command line as
    ``task.NAME=VALUE`` and validated like every other key (``None``: the task has none).
    ``count_unit``: what ``LossOutput.count`` counts, for the throughput line (``<unit>_per_s``).
    ``forward_methods``: the model's methods ``loss`` calls in place of ``model(...)`` (CLIP's
    ``encode_image``, a VAE's ``encode``): FSDP gathers a unit's parameters around its forward only,
    and for these too once they are named.
    """

    Options: ClassVar[type | None] = None
    count_unit: ClassVar[str] = "samples"
    forward_methods: ClassVar[tuple[str, ...]] = ()

    def __init__(self, options: Any = None, **overrides: Any) -> None:
        if self.Options is None:
            if options is not None or overrides:
                raise ConfigError(f"{type(self).__name__} takes no options (it declares no Options "
                                  "dataclass)")
            self.options = None
        else:
            base = options if options is not None else self.Options()
            self.options = dataclasses.replace(base, **overrides) if overrides else base
        self.cfg: Config | None = None

    # ---- set by the framework ---------------------------------------------------------------

    def bind(self, cfg: Config) -> None:
        """Called once, before anything is built, with the run's configuration (the same object:
        the accumulation steps and an auto micro-batch, derived after the data is read, are in
        ``self.cfg`` from the model's build on, not yet here)."""
        self.cfg = cfg

    @property
    def seed(self) -> int:
        return self.cfg.trainer.seed if self.cfg is not None else 0

    # ---- the model ----------------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        """The unsharded model. Called with parameters on the meta device (buffers are computed as
        the module constructs them, and restored after materialisation) when the task or the model
        has ``init_parameter(name, tensor, generator)`` (filling whole tensors, or chunks of the
        flattened parameter for those ``init_parameter_elementwise`` names: True for all, or a
        method asked per name; ``models/initializer.py``); otherwise called a second time on the
        CPU, seeded, on every rank, and that model is sharded (so it may be called more than once:
        keep it free of side effects)."""
        raise NotImplementedError(f"{type(self).__name__} must define build_model()")

    def wrap_policy(self) -> Sequence[type | str] | None:
        """The module classes (or names) that become FSDP units; None: ``strategy.wrap_policy``."""
        return None

    def tensor_parallel_hook(self):
        """``parallelize_tensors(model, tp_mesh, sequence_parallel)`` when the task defines it: its
        own tensor-parallel plan, applied (with ``torch.distributed.tensor.parallel``) to the
        unsharded model on the ``tp`` sub-mesh before FSDP shards it, instead of the model's own
        ``parallelize_tensors(tp_mesh, sequence_parallel)`` (the built-in Llama's plan, a Hugging
        Face model's declared one). Used only with ``strategy.tensor_parallel`` > 1."""
        return getattr(self, "parallelize_tensors", None)

    # ---- data ---------------------------------------------------------------------------------

    def train_dataset(self) -> Any:
        """A map-style dataset (``len`` and ``[i]``) of tensors or dicts of tensors."""
        raise NotImplementedError(f"{type(self).__name__} must define train_dataset()")

    def val_dataset(self) -> Any | None:
        """The validation dataset, or None for no validation."""
        return None

    def collate(self, items: list[Any]) -> Any:
        """One micro-batch from its items; the default stacks tensors (``default_collate``)."""
        return torch.utils.data.default_collate(items)

    def train_samples(self) -> SampleSource:
        """The training data as the framework reads it; a task with its own batching (the language
        model's token windows) overrides this instead of ``train_dataset``."""
        return MapSamples(self.train_dataset(), self.collate, "the training dataset",
                          draw=self.draw_hook("train"), seed=self.seed,
                          if_empty=f" ({type(self).__name__}.train_dataset() returned no items)")

    def val_samples(self) -> SampleSource | None:
        dataset = self.val_dataset()
        if dataset is None:
            return None
        # (found by a new-user trial: the fix, a None, was not named)
        return MapSamples(dataset, self.collate, "the validation dataset", draw=self.draw_hook("val"),
                          seed=self.seed, salt=1,
                          if_empty=f"; {type(self).__name__}.val_dataset() returns None to train without "
                                   "validation")

    def example_batch(self, micro_batch_size: int) -> Any:
        """A micro-batch as training makes them, for ``shardtrain plan --simulate``: by default the
        first training items, collated (with their draws)."""
        return leading_batch(self.train_samples(), micro_batch_size)

    def draw_hook(self, split: str = "train"):
        """``draw(item, generator) -> item`` when the task defines it: per-sample randomness (noise,
        masking, augmentation) from a generator seeded by the run's seed and the sample's position in
        the global order, so a sample gets the same draw at any world size and micro-batch split, and
        a resumed run draws what the uninterrupted run drew. A draw that declares a ``split``
        parameter gets ``split="train"`` or ``"val"`` (to leave the validation set unaugmented, say);
        its signature is read here, once per dataset, not per item."""
        draw = getattr(self, "draw", None)
        if draw is None or "split" not in inspect.signature(draw).parameters:
            return draw
        return functools.partial(draw, split=split)

    # ---- the loss -----------------------------------------------------------------------------

    def loss(self, model: nn.Module, batch: Any) -> LossOutput:
        """The summed loss of a micro-batch (on the device), its count and optional metrics. Call
        ``model(...)``, never ``model.forward(...)``: FSDP's hooks live on ``__call__``."""
        raise NotImplementedError(f"{type(self).__name__} must define loss(model, batch)")

    def count(self, batch: Any) -> float | None:
        """The count of a micro-batch (still on the CPU) when it is known before the forward (the
        language model's target tokens): the loss is then divided by the global count before
        backward. None: it is known only from ``loss``, and the accumulated gradients are divided
        once after the last micro-batch instead. Either way the gradient is the global mean."""
        return None

    def flops(self, batch: Any) -> float | None:
        """Training FLOPs (forward and backward) of a micro-batch, for MFU. Not overridden (this
        default's None): counted with torch's FLOP counter at start-up (the forward and the
        backward, each counted); an override
        returns a number for every micro-batch."""
        return None

    def describe(self) -> str:
        """One line on the data, for the start-up report."""
        return type(self).__name__

    def text_tokenizer(self) -> Tokenizer | None:
        """The tokenizer of a task whose model maps token ids to next-token logits
        (``model(ids)``): training's text samples (``trainer.sample_tokens``, ``sample_every``)
        decode with it. None (this default): the task's model makes no text, and nothing is sampled."""
        return None

    def empty_count_hint(self, throughout: bool) -> str:
        """Why ``loss`` counted 0 on every rank: a short guess for one skipped step, or, with
        ``throughout`` (every step in a row skipped for it, and the run stopped), what to fix."""
        name = type(self).__name__
        if throughout:
            return (f"{name}.loss returned a count of 0 for every micro-batch; check what it counts, "
                    "and its data")
        return f"{name}.loss counted 0"


# Every model a task's build_model has returned in this process (weakly: a model dropped leaves).
BUILT_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def model_factory(task: Task) -> Callable[[], nn.Module]:
    """``task.build_model``, whose result is checked to be a module (a ``return`` forgotten gave
    the framework's own AttributeError, deep in sharding) and a new one: a model built once and
    returned again (held by the task, cached) was sharded in place, then turned into fake tensors
    by the FLOP counter's call (found by a trial: an error from inside the step at 2 ranks, every
    update skipped at one)."""
    return lambda: checked_model(task, task.build_model())


def checked_model(task: Task, model: Any) -> nn.Module:
    """``model``, what ``task.build_model`` returned, if it is a module it never returned before
    (see ``model_factory``); a ModelError otherwise."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"{type(task).__name__}.build_model returned {type(model).__name__}; return "
                         "the model, an nn.Module")
    if model in BUILT_MODELS:
        what = "a model it had returned before"
    elif not {id(p) for built in BUILT_MODELS for p in built.parameters()}.isdisjoint(
            map(id, model.parameters())):  # a teacher kept and reused (found by review)
        what = "a model holding parameters of one it returned before (a module kept and reused)"
    else:
        BUILT_MODELS.add(model)
        return model
    raise ModelError(f"{type(task).__name__}.build_model returned {what}; construct every module anew in "
                     "each call (the framework calls it more than once: to shard it, and to count its "
                     "FLOPs on a fake copy)")


def parameters_outside(task: Task, model: nn.Module) -> dict[str, int]:
    """Trainable parameters ``task`` holds in its own attributes (a parameter, or a module's) that
    are not ``model``'s, by attribute: elements. The optimizer and the checkpoints know the model's
    alone: a temperature kept on the task got its gradient and never moved (found by a trial)."""
    # Any model build_model returned is the framework's (the FLOP counter's fake copy among them,
    # which a task keeping a handle on what it builds holds: found by review, warned of)
    owned = {id(param) for built in [model, *BUILT_MODELS] for param in built.parameters()}
    found: dict[str, int] = {}
    for name, value in vars(task).items():
        params = ([value] if isinstance(value, nn.Parameter)
                  else list(value.parameters()) if isinstance(value, nn.Module) else [])
        outside = sum(p.numel() for p in params if p.requires_grad and id(p) not in owned)
        if outside:
            found[name] = outside
    return found


def leading_batch(samples: SampleSource, micro_batch_size: int) -> Any:
    """A micro-batch of the first samples (wrapping round a source smaller than it): the default
    example batch."""
    return samples.batch(np.arange(micro_batch_size) % samples.num_samples)


def wrap_policy_of(task: Task) -> list[type | str] | None:
    """``task.wrap_policy()`` as a list: one class or name alone is taken as a list of one (a string
    was iterated character by character, a class was not iterable); anything else is one line."""
    policy = task.wrap_policy()
    if policy is None:
        return None
    if isinstance(policy, (str, type)):
        return [policy]
    try:
        policy = list(policy)
    except TypeError:
        policy = None
    if policy is None or not all(isinstance(entry, (str, type)) for entry in policy):
        raise ConfigError(f"{type(task).__name__}.wrap_policy() must return module classes or their names "
                          "(a list, e.g. [Block]), or None for strategy.wrap_policy")
    return policy


class WrapPolicy(list):
    """A run's wrap policy (module classes or names) and ``source``, what set it (for messages)."""

    def __init__(self, entries: Sequence[type | str], source: str) -> None:
        super().__init__(entries)
        self.source = source


DEFAULT_WRAP_POLICY = ["auto"]  # strategy.wrap_policy's default (and every strategy preset's)


def run_wrap_policy(task: Task, cfg: Config) -> WrapPolicy:
    """The policy a run shards by: the task's own (``wrap_policy_of``), else strategy.wrap_policy.
    Both given is one line: the task's decided, and the command line's was shown as the policy
    (found by a trial)."""
    policy = wrap_policy_of(task)
    if policy is None:
        return WrapPolicy(cfg.strategy.wrap_policy, "strategy.wrap_policy")
    if list(cfg.strategy.wrap_policy) != DEFAULT_WRAP_POLICY:
        raise ConfigError(f"strategy.wrap_policy={list(cfg.strategy.wrap_policy)} and "
                          f"{type(task).__name__}.wrap_policy() both name the FSDP units; drop "
                          "strategy.wrap_policy to shard by the task's, or have wrap_policy() return None "
                          "to shard by the configuration's")
    return WrapPolicy(policy, f"{type(task).__name__}.wrap_policy()")


def check_task(task: Any) -> Task:
    """``task`` is a Task whose required methods are defined; a ConfigError naming what is missing."""
    if isinstance(task, type) and issubclass(task, Task):
        raise ConfigError(f"the task is the class {task.__name__}; pass an instance, {task.__name__}()")
    if not isinstance(task, Task):
        raise ConfigError(f"the task must be a shardtrain.tasks.Task, not {type(task).__name__}")
    cls = type(task)
    hooks = {name for name in dir(Task) if not name.startswith("_")} | {*OPTIONAL_HOOKS, "options", "cfg"}
    for name in sorted(vars(cls)):
        near = difflib.get_close_matches(name, hooks, n=1, cutoff=0.85)
        if not name.startswith("_") and name not in hooks and near:
            # A misspelt hook is never called: said, not silently ignored.
            log.warning(f"task {cls.__name__} defines {name!r}, which the framework does not call; did you "
                        f"mean {near[0]!r}?")
    if not hasattr(task, "options"):  # what Task.__init__ sets
        raise ConfigError(f"{cls.__name__}.__init__ does not call super().__init__(); call it (with the "
                          "task's options, if any) before setting attributes of its own")
    if unrecorded := unrecorded_parameters(cls):
        # Kept by the object, recorded nowhere: a resume, plan and every worker built the task
        # without them, and trained another one without a word (found by review).
        raise ConfigError(f"{cls.__name__}.__init__ takes {', '.join(unrecorded)}, which the run does not "
                          "record (a run's task is rebuilt from task.path and task.options alone: resume, "
                          "plan, every worker); declare them as fields of the task's Options dataclass "
                          "(docs/tasks.md), set with task.NAME=VALUE")
    missing = [name for name in ("build_model", "loss")
               if getattr(cls, name) is getattr(Task, name)]
    if cls.train_samples is Task.train_samples and cls.train_dataset is Task.train_dataset:
        missing.append("train_dataset")
    if missing:
        raise ConfigError(f"task {cls.__module__}.{cls.__qualname__} lacks {', '.join(missing)}(); "
                          "see docs/tasks.md for the contract")
    unit = task.count_unit
    if not (isinstance(unit, str) and re.fullmatch(r"[a-z][a-z0-9_]*", unit)):
        # It names metrics (<unit>_per_s, <unit>_seen) in metrics.jsonl, the trackers and the report.
        raise ConfigError(f"task {cls.__qualname__}: count_unit={unit!r} names metrics (<unit>_per_s); use "
                          "lowercase letters, digits and underscores, such as 'tokens' or 'frames'")
    return task


def unrecorded_parameters(cls: type[Task]) -> list[str]:
    """The named parameters of ``cls.__init__`` that are neither its options (``options``) nor fields
    of its Options. The framework's own tasks are left alone: the language model's ``model=`` and
    ``corpus=`` are objects given in code, which it records as such."""
    if cls.__init__ is Task.__init__ or cls.__init__.__module__.startswith("shardtrain."):
        return []
    # what the framework's own __init__ below it takes (a LanguageModelTask subclass's model=, which
    # the run records as its model factory) passes too
    framework = next(base.__init__ for base in cls.__mro__
                     if base.__init__.__module__.startswith("shardtrain."))
    declared = {p.name for p in inspect.signature(framework).parameters.values()}
    if dataclasses.is_dataclass(cls.Options):
        declared |= {f.name for f in dataclasses.fields(cls.Options)}
    return [p.name for p in inspect.signature(cls).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in {"options", *declared}]


def task_config_of(task: Task) -> TaskConfig:
    """The config section that names ``task`` and its options (recorded in config.yaml and every
    checkpoint, also for a task handed to ``run_training`` as an object)."""
    options = plain_options(task.options) if dataclasses.is_dataclass(task.options) else {}
    if options and dataclasses.is_dataclass(type(task).Options):
        # As the command line's: a value of another type (depth="2") failed deep in the model, or
        # trained and was recorded as what a resume then refused (found by review)
        read, _ = read_options(type(task).Options, options)
        # Compared as recorded (a tuple read back as a list, in a nested dataclass, is the same value)
        held, typed = plain_options(task.options), plain_options(read)
        if wrong := [name for name, value in typed.items() if not same_value(held.get(name), value)]:
            raise ConfigError(f"{type(task).__name__}'s options are not of their declared types: "
                              f"{', '.join(f'{name}={held[name]!r}' for name in wrong)} (read as its type: "
                              f"{', '.join(f'{name}={typed[name]!r}' for name in wrong)}); give each option "
                              "the type its Options field declares")
    factory = given_model_factory(task)
    return TaskConfig(path=qualified_name(type(task)), options=options,
                      model_factory=None if factory is None else qualified_name(factory))


def task_from_config(cfg: Config) -> Task:
    """The task ``cfg.task.path`` names, with ``cfg.task.options`` (already validated by the config
    loader)."""
    cls = import_object(cfg.task.path, "task")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"task={cfg.task.path!r} is not a shardtrain.tasks.Task subclass")
    if cls.Options is None:
        required = [p.name for p in inspect.signature(cls).parameters.values()
                    if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if required:  # a TypeError from inside the user's class otherwise, on every worker
            raise ConfigError(f"task {cfg.task.path}: {cls.__name__}.__init__ needs {', '.join(required)}, "
                              "and a run's task is built from task.path and task.options alone (resume, "
                              "plan, every worker): declare them as fields of an Options dataclass on the "
                              "class (docs/tasks.md), set with task.NAME=VALUE")
        return check_task(cls())
    options, _ = read_options(cls.Options, cfg.task.options)
    return check_task(construct(cls, options))


CONSTRUCTION_RULE = ("must accept the task's Options as its one argument, or each option as a keyword, "
                     "and pass them on to Task.__init__ unchanged (or leave __init__ to Task): a run's "
                     "task is rebuilt from task.path and task.options alone (resume, plan, every worker)")


def construct(cls: type[Task], options: Any) -> Task:
    """``cls`` holding ``options``, built the way its ``__init__`` takes them: as its one argument
    (Task's own, or one whose first parameter is ``options`` or ``*args``), else as keywords, one
    per option (``__init__(self, depth=2, **kw)`` forwarding them to Task's ``**overrides``, the
    style ``MyTask(depth=4)`` invites). Handing the Options object to such an ``__init__`` would
    bind it to its first option; a ConfigError naming the rule instead of a TypeError deep inside
    the user's model."""
    signature = inspect.signature(cls)
    params = list(signature.parameters.values())
    shown = f"{cls.__name__}.__init__({', '.join(str(p.replace(annotation=p.empty)) for p in params)})"
    if params and (params[0].name == "options" or params[0].kind is inspect.Parameter.VAR_POSITIONAL):
        args, keywords = (options,), {}
    else:
        args, keywords = (), {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.init}
    try:
        signature.bind(*args, **keywords)
    except TypeError as exc:  # checked before the call: a TypeError from inside it is the user's
        raise ConfigError(f"{shown} {CONSTRUCTION_RULE} ({exc})") from exc
    task = cls(*args, **keywords)
    differ = options_differ(getattr(task, "options", None), options)
    if differ:
        raise ConfigError(f"{shown} {CONSTRUCTION_RULE}; built from the config, the task holds {differ}")
    return task


def options_differ(held: Any, given: Any) -> str:
    """Where the options a task holds differ from those it was built with ("" where they agree)."""
    if not dataclasses.is_dataclass(held):
        return f"options {held!r}, not {type(given).__qualname__}"
    have, want = dataclasses.asdict(held), dataclasses.asdict(given)
    # NaN as itself (found by review: an option defaulting to NaN always differed, and the task could
    # not be built from the config)
    return ", ".join(f"{name}={have.get(name)!r} where the config says {name}={value!r}"
                     for name, value in want.items() if not same_value(have.get(name), value))
