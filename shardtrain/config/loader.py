"""A run's configuration, ready to run: ``compose``'s config, checked against the code it names
(the task and its options, wrap-policy classes) and the devices this launch has (the backend, the
world size ``trainer.devices=auto`` means, the sharding plan at that size).

These checks import torch and the task's code, which takes seconds; the command line runs
``compose_config`` first so that a typo never waits for them, then ``check_runtime`` before any
process starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from shardtrain.accelerator import accelerator_count, check_float8, device_type
from shardtrain.config.classpath import import_module_class, import_object, qualified_name
from shardtrain.config.compose import check_ranges, compose_config, overridden
from shardtrain.config.keys import check_overrides
from shardtrain.config.options import read_options
from shardtrain.config.plan import (
    check_base_dtype,
    check_tensor_parallel_in_nodes,
    check_tensor_parallel_support,
    launch_shape,
    planned_param_dtype,
    resolve_plan,
    with_global_batch,
)
from shardtrain.config.schema import LANGUAGE_MODEL_TASK, Config
from shardtrain.config.suggest import closest
from shardtrain.errors import ConfigError, ShardtrainError


def load_config(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The resolved, validated config for these overrides."""
    cfg = compose_config(overrides)
    check_runtime(cfg)
    return cfg


def check_task_section(cfg: Config) -> None:
    """``task.path`` imports, and ``task.options`` fit its ``Options`` dataclass: names, types and
    bounds, each wrong one a ConfigError naming ``task.NAME``. The options are stored back in full,
    defaults included, so config.yaml and checkpoints record every one."""
    cls = import_object(cfg.task.path, "task")
    if not isinstance(cls, type):
        raise ConfigError(f"task={cfg.task.path!r} is not a class")
    cfg.task.path = qualified_name(cls)  # one spelling, whichever was given
    options_cls = getattr(cls, "Options", None)
    if options_cls is None:
        if cfg.task.options:
            raise ConfigError(f"task {cfg.task.path} takes no options (it declares no Options "
                              f"dataclass), got task.{next(iter(cfg.task.options))}")
        return
    if not dataclasses.is_dataclass(options_cls):
        raise ConfigError(f"task {cfg.task.path}: its Options must be a dataclass")
    names = [f.name for f in dataclasses.fields(options_cls)]
    # model_factory: recorded for LanguageModelTask(model=...), so task.model_factory=X is refused
    # before the task is known (found by review: an option so named could not be set)
    reserved = sorted({"path", "options", "model_factory"} & set(names))
    if reserved:
        raise ConfigError(f"task {cfg.task.path}: an option may not be named {' or '.join(reserved)} "
                          "(task.path, task.options and task.model_factory are the task section's own "
                          "keys); rename it")
    for name in cfg.task.options:
        if name not in names:
            raise ConfigError(f"unknown task option 'task.{name}'"
                              f"{closest(f'task.{name}', [f'task.{n}' for n in names])}; "
                              f"{cls.__name__} takes: {', '.join(names) or 'none'}")
    options, cfg.task.options = read_options(options_cls, cfg.task.options)
    check_ranges(options, options_cls, "task.")


# The class every task derives from (tasks/task.py; named, not imported: the config layer is below it).
TASK_BASE = "shardtrain.tasks.task:Task"


def ancestor(task_cls: type, path: str) -> type | None:
    """The class ``path`` (``module:qualname``) names if ``task_cls`` is it or derives from it."""
    return next((c for c in task_cls.__mro__ if qualified_name(c) == path), None)


def built_in_ancestor(task_cls: type) -> type | None:
    """The built-in language-model task's class if ``task_cls`` is it or derives from it."""
    return ancestor(task_cls, LANGUAGE_MODEL_TASK)


def given_model_factory(task: object) -> object | None:
    """The model factory a built-in language-model task was given in code
    (``LanguageModelTask(model=...)``), recorded as ``task.model_factory``; None for any other task,
    whose attribute of that name is its own (found by review: a task's own ``model_factory`` method
    was recorded as one, and a resume from the command line was refused)."""
    return getattr(task, "model_factory", None) if built_in_ancestor(type(task)) is not None else None


def makes_text(task_cls: type) -> bool:
    """A task with a ``text_tokenizer`` of its own (the built-in language model's, or one a task
    defines): what training's text samples decode with."""
    base = ancestor(task_cls, TASK_BASE)
    return base is not None and getattr(task_cls, "text_tokenizer", None) is not base.text_tokenizer


def language_model_task(task_cls: type) -> bool:
    """The built-in language-model task, or a task derived from it that keeps its loss (which
    honours ``trainer.loss_chunk_tokens``)."""
    built_in = built_in_ancestor(task_cls)
    return built_in is not None and getattr(task_cls, "loss", None) is built_in.loss


def planned_by_formulas(task_cls: type, tensor_parallel: int = 1) -> bool:
    """A language-model task that builds the built-in models from ``model.*`` and, under
    ``tensor_parallel`` > 1, splits them by the model's own plan: what the memory planner's formulas
    (``shardtrain plan``, ``micro_batch_size=auto``) know. A task's own ``parallelize_tensors`` is
    not: the formulas split by the model's plan (found by review: 1.8x low for a task splitting only
    the feed-forward)."""
    built_in = built_in_ancestor(task_cls)
    return built_in is not None and getattr(task_cls, "build_model", None) is built_in.build_model and not (
        tensor_parallel > 1 and own_tensor_plan(task_cls))


def own_tensor_plan(task: object) -> bool:
    """A task (class or object: one set on the object counts too) with a tensor-parallel plan of its
    own (``Task.tensor_parallel_hook``)."""
    return getattr(task, "parallelize_tensors", None) is not None


def formulas_know(task: object, tensor_parallel: int = 1) -> bool:
    """A task object whose model the planner's formulas know: ``planned_by_formulas`` and no model
    of its own (``LanguageModelTask(model=...)``)."""
    return (planned_by_formulas(type(task)) and given_model_factory(task) is None
            and not (tensor_parallel > 1 and own_tensor_plan(task)))


def check_built_in_task_settings(cfg: Config, task: object | None = None) -> None:
    """Settings that only the built-in language-model task acts on, refused for any other task
    (``task``: a task object; default, the class ``task=`` names), whose model or loss are its own,
    rather than ignored."""
    task_cls = type(task) if task is not None else import_object(cfg.task.path, "task")
    name = task_cls.__name__
    own_model = given_model_factory(task) is not None
    tp = cfg.strategy.tensor_parallel
    known = formulas_know(task, tp) if task is not None else planned_by_formulas(task_cls, tp)
    if cfg.trainer.micro_batch_size == "auto" and not known:
        planned = task if task is not None else task_cls
        own = (" with a model of its own" if own_model else
               " with a tensor-parallel plan of its own" if tp > 1 and own_tensor_plan(planned) else "")
        raise ConfigError(f"trainer.micro_batch_size=auto needs the memory planner, whose formulas know "
                          f"the built-in language-model task's models, split by their own plans, only; set "
                          f"trainer.micro_batch_size=N for {name}{own} (shardtrain plan --simulate "
                          "measures its memory)")
    if cfg.trainer.sample_every and not makes_text(task_cls):
        raise ConfigError(f"trainer.sample_every={cfg.trainer.sample_every} samples text, and {name} has "
                          "no text_tokenizer() to decode it with: drop the setting")
    reads_data = built_in_ancestor(task_cls) is not None and getattr(task, "given_corpus", None) is None
    if reads_data and cfg.data.source in ("files", "prepared") and not cfg.data.paths:
        # Found by a review: said by the data's loader, after the workers had started.
        example = "DIR, ..." if cfg.data.source == "prepared" else "FILE_OR_DIR, ..."
        raise ConfigError(f"data.source={cfg.data.source} needs data.paths=[{example}]")
    # What the language-model task alone reads (its windows' document positions).
    text_only = {"data.document_mask": cfg.data.document_mask,
                 "data.packing": cfg.data.packing if cfg.data.packing != "auto" else None}
    for key, value in text_only.items():
        if value and built_in_ancestor(task_cls) is None:
            shown = str(value).lower() if isinstance(value, bool) else value
            raise ConfigError(f"{key}={shown} acts on the built-in language-model task's text only; "
                              f"{name} has data and a model of its own: drop the setting")
    if cfg.trainer.loss_chunk_tokens != "auto" and not language_model_task(task_cls):
        raise ConfigError(f"trainer.loss_chunk_tokens={cfg.trainer.loss_chunk_tokens} sets the built-in "
                          f"language-model task's loss; {name} computes its own (a task can call "
                          "shardtrain.tasks.losses.chunked_cross_entropy in its loss); drop the setting")


# What the built-in language-model task builds its model and data from: shardtrain reads these for no
# other task (model.init_from and model.adapter are read for every task: the weights and adapters
# a run starts from).
BUILT_IN_TASK_KEYS = ("model", "data", "trainer.seq_len")
EVERY_TASK_KEYS = ("model.init_from", "model.adapter")
# Training's text samples, for a task with a text_tokenizer() (makes_text).
SAMPLE_KEYS = ("trainer.sample_tokens", "trainer.sample_prompt")


def settings_left_to_the_task(cfg: Config, overrides: list[str] | tuple[str, ...]) -> str | None:
    """A warning naming the keys given in ``overrides`` that shardtrain reads for the built-in
    language-model task only, when ``cfg.task`` is another task: they reach that task as
    ``self.cfg`` and nothing else reads them (found by review: ``model.dim=512`` beside a task with
    a model of its own trained the task's model as it was, without a word). None when there are
    none. Not refused: a task may read them there."""
    task_cls = import_object(cfg.task.path, "task")
    spelled = check_overrides(overrides)
    read = list(EVERY_TASK_KEYS)
    if cfg.model.path and cfg.model.weights_source() == cfg.model.path:
        # a Hugging Face directory's weights, read into any task's model as model.init_from's are
        # (found by the diff review: named as unread)
        read += ["model.name", "model.path", "model.pretrained"]
    keys = []
    if built_in_ancestor(task_cls) is None:
        keys += [key for prefix in BUILT_IN_TASK_KEYS for key in overridden(spelled, prefix)
                 if not any(key == k or key.startswith(k + ".") for k in read)]
    if not makes_text(task_cls):
        keys += [key for prefix in SAMPLE_KEYS for key in overridden(spelled, prefix)]
    keys = list(dict.fromkeys(keys))
    if not keys:
        return None
    one = len(keys) == 1
    them = "it" if one else "them"
    return (f"{', '.join(keys)} set{'s' if one else ''} what the built-in language-model task builds (its "
            f"model, data, windows and text samples); {task_cls.__name__} has its own, so shardtrain "
            f"{'does not read it' if one else 'reads none of them'}: "
            f"{'it reaches' if one else 'they reach'} the task only as self.cfg (drop {them} unless the "
            f"task reads {them} there)")


def check_runtime(cfg: Config, runs_here: bool = True, rows_judge_layouts: bool = False) -> None:
    """What a composed config needs torch, the task's code or the devices to check; completes
    ``cfg.task`` (one spelling of its path, every option). ``runs_here=False`` (``shardtrain plan``,
    which plans for other machines, often from a login node without GPUs) skips what only this
    machine's devices and packages decide: NCCL's GPUs, float8's tensor cores, torchao.
    ``rows_judge_layouts`` (``plan --world-sizes``): the layout is judged at each world size planned
    for, not at the launch's."""
    if runs_here:
        check_devices(cfg)
    for entry in cfg.strategy.wrap_policy:
        if entry != "auto" and "." in entry:  # a bare class name is looked up in the model itself
            try:
                import_module_class(entry)
            except ShardtrainError as exc:
                raise ConfigError(f"strategy.wrap_policy: {exc}") from exc
    check_task_section(cfg)
    check_built_in_task_settings(cfg)
    # The strategy against the world size the launch will have.
    per_node, world = launch_shape(cfg)
    # auto: the planned machines' choice, unless strategy.param_dtype decides it on any machine
    if runs_here or cfg.strategy.mixed_precision != "auto" or cfg.strategy.param_dtype is not None:
        # whatever the layout: plan's rows too (found by review: they planned a run train refuses)
        check_base_dtype(cfg, planned_param_dtype(cfg.strategy))
    if rows_judge_layouts:
        check_tensor_parallel_in_nodes(cfg.strategy, per_node)  # the nodes' size is the same in each row
    else:
        resolve_plan(cfg.strategy, world, per_node)
        with_global_batch(cfg, world)  # a global batch the micro-batches do not divide, before any launch
    check_tensor_parallel_support(cfg)


def check_devices(cfg: Config) -> None:
    """What this machine must have for the run: GPUs for NCCL, float8 tensor cores and torchao."""
    if cfg.dist.backend == "nccl" and not accelerator_count():
        raise ConfigError(
            "dist.backend=nccl needs GPUs and none is visible; use dist.backend=auto (gloo on CPU)"
        )
    if cfg.diagnostics.memory_snapshot and device_type() != "cuda":
        raise ConfigError("diagnostics.memory_snapshot records the CUDA caching allocator's history, and "
                          f"this machine's device is {device_type()}; set diagnostics.memory_snapshot=false")
    if cfg.strategy.float8:
        check_float8()
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError("strategy.float8=true needs torchao (pip install 'shardtrain[float8]')")
