"""A Hugging Face model's initial weights from scratch, as its family's own ``_init_weights`` makes
them, drawn parameter by parameter so that a rank draws only its shard.

transformers initialises a model by calling its family's ``_init_weights`` on every module, children
first, each module by the nearest ``PreTrainedModel`` at or above it (``initialize_weights``), and
ties the head to the embeddings afterwards. Families differ: Gemma's RMSNorms compute
``x * (1 + weight)`` and start at zero, GPT-2 scales its residual projections' std by
1/sqrt(2 n_layer), Mamba mixers set ``A_log`` to log(1..N) and ``D`` to ones. That code cannot run on
the model shardtrain trains (sharded, and the same at every world size), so it runs once on a
stand-in: the model built again on the meta device, every parameter and buffer replaced by a fake
tensor (``FakeTensorMode``: shapes, no data; not meta tensors, which ``trunc_normal_`` and
``orthogonal_`` skip without a write), and every write to a parameter recorded (found by storage, so
through ``.data`` and views too). From the last write that sets the whole parameter on, it is:

- ``Draw``: writes that set each element alone from numbers (``normal_``, ``uniform_``, ``fill_``,
  scaling: what ``kaiming_uniform_``, ``constant_`` and GPT-2's scaled ``normal_`` come to; a copy
  back of such ops on its own value, as Nemotron-H rescales its ``out_proj``), replayed on any chunk
  of the flattened parameter with the chunk's generator: elementwise, so a rank draws only its
  shard's chunks;
- ``Compute``: anything else (Mamba's log-arange ``A_log``, a ``dt`` bias drawn log-uniformly through
  softplus's inverse): the family's calls that wrote it run again on the stand-in with this one
  parameter real (on CPU, the others on meta), under a seed from the generator: the family's exact
  values where they are fixed, its distribution where they are random. Computed whole on every
  rank, so only up to ``COMPUTE_LIMIT`` elements;
- ``Refused``: a ``ModelError`` when it is asked for: parameters no write sets whole (they keep their
  constructor's value, which a model built on the meta device does not have), whose family code reads
  data (``trunc_normal_``'s rejection loop) or that are too large to compute whole.

Whole rows set to a constant after the last whole write (the ``padding_idx`` row of an embedding,
which transformers zeroes) are element ranges the framework sets after the draw
(``init_parameter_constants``), as a chunk alone does not know which rows it holds. A tied parameter
is initialised as the one it is tied to (transformers' tie source, the input embeddings), as
transformers ties after initialising.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import PreTrainedModel

from shardtrain.errors import ModelError

aten = torch.ops.aten
# Writes that set every element whatever it held.
OVERWRITES = {aten.normal_, aten.uniform_, aten.fill_, aten.zero_, aten.copy_}
# Writes that set each element from itself alone (or from nothing) when their other arguments are
# numbers: replayable on any chunk of the flattened parameter.
ELEMENTWISE = {aten.normal_, aten.uniform_, aten.fill_, aten.zero_, aten.mul_, aten.div_, aten.add_,
               aten.sub_, aten.clamp_, aten.clamp_min_, aten.clamp_max_, aten.erfinv_, aten.exp_,
               aten.log_, aten.neg_, aten.sqrt_}
# The same, computing a new tensor: a parameter copied back from such ops on itself (Nemotron-H's
# ``init.copy_(p, p / math.sqrt(n_layers))``) is written elementwise too.
ELEMENTWISE_OUT = {aten.mul, aten.div, aten.add, aten.sub, aten.clamp, aten.clamp_min, aten.clamp_max,
                   aten.erfinv, aten.exp, aten.log, aten.neg, aten.sqrt}
CONSTANT_FILLS = {aten.fill_, aten.zero_}
# Elements of a ``Compute`` parameter, built whole on every rank (Jamba's A_log, intermediate x
# state, is 131k).
COMPUTE_LIMIT = 1 << 24
LOAD_WEIGHTS = ("load weights instead (model.pretrained=true with weights in model.path, or "
                "model.init_from=)")

Call = tuple[PreTrainedModel, nn.Module]  # model._init_weights(module)


Step = tuple[OpOverload, tuple, dict]  # an op, its arguments but the tensor it acts on, its keywords


def numbers_only(step: Step) -> bool:
    _, args, kwargs = step
    values = [*args, *(value for key, value in kwargs.items() if key != "generator")]
    return all(value is None or isinstance(value, bool | int | float) for value in values)


@dataclass(frozen=True)
class Write:
    """One write to a parameter, or to a view of part of it, made by ``call``."""

    call: Call
    step: Step
    whole: bool  # the parameter itself, not part of it
    # A copy from the parameter's own value: the ops (ELEMENTWISE_OUT) that computed the copied tensor.
    derived: tuple[Step, ...] = ()
    # Whole rows of it (a view along its first dimension, or all of it): the range of the flattened
    # parameter they are.
    span: tuple[int, int] | None = None

    def overwrites(self) -> bool:
        return self.whole and self.step[0].overloadpacket in OVERWRITES and not self.derived

    def replayable(self) -> bool:
        if self.derived:
            return all(op.overloadpacket in ELEMENTWISE_OUT and numbers_only((op, args, kwargs))
                       for op, args, kwargs in self.derived)
        return self.step[0].overloadpacket in ELEMENTWISE and numbers_only(self.step)

    def constant_rows(self) -> bool:
        return (not self.whole and self.span is not None and self.step[0].overloadpacket in CONSTANT_FILLS
                and numbers_only(self.step))

    def constant(self) -> tuple[int, int, float]:
        """A ``constant_rows`` write as (begin, end, value) of the flattened parameter."""
        op, args, kwargs = self.step
        value = 0.0 if op.overloadpacket is aten.zero_ else float(args[0] if args else kwargs["value"])
        return (*self.span, value)

    def replay(self, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if self.derived:
            value = tensor
            for op, args, kwargs in self.derived:
                value = op(value, *args, **kwargs)
            tensor.copy_(value)
            return
        op, args, kwargs = self.step
        if any(argument.name == "generator" for argument in op._schema.arguments):
            kwargs = {**kwargs, "generator": generator}
        op(tensor, *args, **kwargs)


@dataclass(frozen=True)
class Draw:
    """Elementwise writes with number arguments, replayed on a chunk, random ones with its generator;
    then ``constants``, (begin, end, value) ranges of the flattened parameter, set by the caller,
    which knows where a chunk lies (``fill_elements``)."""

    writes: tuple[Write, ...]
    constants: tuple[tuple[int, int, float], ...] = ()

    def fill(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        for write in self.writes:
            write.replay(tensor, generator)


@dataclass(frozen=True)
class Compute:
    """The family's calls that wrote the parameter, run again with it real and the others on meta."""

    calls: tuple[Call, ...]
    holder: nn.Module
    attr: str

    def fill(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        stand_in = self.holder._parameters[self.attr]
        tensor.fill_(math.nan)  # to tell whether the calls wrote all of it
        self.holder._parameters[self.attr] = tensor
        try:
            # Family code draws from the global CPU generator: seeded from ours, and put back after
            # (the CPU's alone: torch.manual_seed would seed every accelerator's too, for good).
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.default_generator.manual_seed(generator.initial_seed())
                for model, module in self.calls:
                    model._init_weights(module)
        except Exception as exc:  # the family's code, on a stand-in it was not written for
            raise ModelError(f"{name}: {describe(self.calls)} fails with only this parameter real "
                             f"({first_line(exc)}); {LOAD_WEIGHTS}") from exc
        finally:
            self.holder._parameters[self.attr] = stand_in
        if tensor.isnan().any():
            raise ModelError(f"{name}: {describe(self.calls)} leaves part of it unset; {LOAD_WEIGHTS}")


@dataclass(frozen=True)
class Refused:
    reason: str

    def fill(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        raise ModelError(f"{name}: {self.reason}; {LOAD_WEIGHTS}")


Rule = Draw | Compute | Refused


def first_line(exc: BaseException) -> str:
    if isinstance(exc, DataDependentOutputException):  # the op is torch's, not what the user wrote
        return "it reads tensor values, as trunc_normal_'s rejection loop does"
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def describe(calls: tuple[Call, ...]) -> str:
    return ", ".join(f"{type(model).__name__}._init_weights({type(module).__name__})"
                     for model, module in calls)


def init_calls(module: nn.Module, model: PreTrainedModel, seen: set[int]) -> Iterator[Call]:
    """The calls transformers' ``initialize_weights`` makes, in its order: ``model._init_weights``
    on every module, children first, ``model`` the nearest PreTrainedModel at or above it; a module
    reached twice only once (transformers marks it initialised)."""
    for child in module.children():
        yield from init_calls(child, child if isinstance(child, PreTrainedModel) else model, seen)
    if id(module) not in seen:
        seen.add(id(module))
        yield model, module


def replace_tensors(model: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Every parameter and buffer of ``model`` replaced by ``make(it)`` (a parameter as a parameter,
    for family code that asks), each module's its own: a tied parameter comes apart, as it is while
    transformers initialises (it ties afterwards)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = nn.Parameter(make(param), requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = make(buffer)


def covers_rows(view: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether ``view`` is whole rows (along the first dimension) of the 2-D or larger ``param``."""
    if param.dim() < 2 or not (param.is_contiguous() and view.is_contiguous()) or view.numel() == 0:
        return False
    row = param.stride(0)
    return (view.storage_offset() - param.storage_offset()) % row == 0 and view.numel() % row == 0


class WriteRecorder(TorchDispatchMode):
    """Every write to the parameters ``params`` names, found by storage (through ``.data``, views and
    the tensor alike), as made by the current ``call``; and which tensors were computed elementwise
    from a parameter's value (by storage: the parameter's name, its writes so far, the ops)."""

    def __init__(self, params: dict[StorageWeakRef, tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self.params = params
        self.writes: dict[str, list[Write]] = {}
        self.derived: dict[StorageWeakRef, tuple[str, int, tuple[Step, ...], torch.Tensor]] = {}
        self.call: Call | None = None

    def __torch_dispatch__(self, func: OpOverload, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            positional = index < len(args)
            tensor = args[index] if positional else kwargs.get(argument.name)
            if isinstance(tensor, torch.Tensor):
                others = args[:index] + args[index + 1:] if positional else args
                self.record(tensor, (func, others, {k: v for k, v in kwargs.items() if k != argument.name}))
        if func.overloadpacket in ELEMENTWISE_OUT and args and isinstance(args[0], torch.Tensor):
            self.derive(out, args[0], (func, args[1:], kwargs))
        return out

    def whole_parameter(self, tensor: torch.Tensor) -> tuple[str | None, bool, tuple[int, int] | None]:
        """(the parameter ``tensor`` is part of, or None; whether all of it; the range of the
        flattened parameter it is, where it is whole rows of it)."""
        found = self.params.get(StorageWeakRef(tensor.untyped_storage()))
        if found is None:
            return None, False, None
        name, param = found
        whole = (tensor.shape == param.shape and tensor.stride() == param.stride()
                 and tensor.storage_offset() == param.storage_offset())
        begin = tensor.storage_offset() - param.storage_offset()
        rows = whole or covers_rows(tensor, param)
        return name, whole, (begin, begin + tensor.numel()) if rows else None

    def derive(self, out: Any, source: torch.Tensor, step: Step) -> None:
        if not isinstance(out, torch.Tensor) or not numbers_only(step):
            return
        name, whole, _ = self.whole_parameter(source)
        if name is not None and whole:
            steps: tuple[Step, ...] = ()
            version = len(self.writes.get(name, []))
        elif (known := self.derived.get(StorageWeakRef(source.untyped_storage()))) is not None:
            name, version, steps, _ = known
        else:
            return
        # The tensor is kept, so that its storage is not reused by another while this is recorded.
        self.derived[StorageWeakRef(out.untyped_storage())] = (name, version, (*steps, step), out)

    def record(self, tensor: torch.Tensor, step: Step) -> None:
        name, whole, span = self.whole_parameter(tensor)
        if name is None:
            return
        writes = self.writes.setdefault(name, [])
        derived: tuple[Step, ...] = ()
        op, args, _ = step
        source = args[0] if op.overloadpacket is aten.copy_ and args else None
        if isinstance(source, torch.Tensor) and source.shape == tensor.shape:
            known = self.derived.get(StorageWeakRef(source.untyped_storage()))
            # From this parameter's value as it is now (no write since), not another's.
            if known is not None and known[0] == name and known[1] == len(writes):
                derived = known[2]
        writes.append(Write(self.call, step, whole, derived, span))


def record_writes(stand_in: PreTrainedModel) -> tuple[dict[str, list[Write]], dict[str, str]]:
    """What the family's initialisation writes to each parameter of ``stand_in`` (its tensors made
    fake here), and why it could not be followed for some (by parameter name)."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        replace_tensors(stand_in, lambda tensor: torch.empty(tensor.shape, dtype=tensor.dtype))
    params = dict(stand_in.named_parameters(remove_duplicate=False))
    by_storage: dict[StorageWeakRef, tuple[str, torch.Tensor]] = {}
    for name, param in params.items():
        by_storage.setdefault(StorageWeakRef(param.untyped_storage()), (name, param))
    recorder = WriteRecorder(by_storage)
    failed: dict[str, str] = {}
    with fake, recorder, torch.no_grad():
        for call in init_calls(stand_in, stand_in, set()):
            recorder.call = call
            try:
                call[0]._init_weights(call[1])
            except Exception as exc:  # the family's code on tensors without data
                reason = (f"{describe((call,))} cannot be followed on a stand-in without data "
                          f"({first_line(exc)})")
                # What it wrote before failing, and what it may have been about to write.
                written = {name for name, writes in recorder.writes.items()
                           if any(write.call == call for write in writes)}
                for name in written | subtree_names(stand_in, call[1]):
                    failed.setdefault(name, reason)  # the first call that failed on it
    family = type(stand_in).__name__
    for name, param in stand_in.named_parameters(remove_duplicate=False):
        if param is not params[name]:
            failed.setdefault(name, f"{family}._init_weights replaces the parameter instead of writing it")
    # A parameter a module shares under several names: its writes under each (recorded under one).
    for name, param in params.items():
        first, _ = by_storage[StorageWeakRef(param.untyped_storage())]
        if name != first and first in recorder.writes:
            recorder.writes[name] = recorder.writes[first]
    return recorder.writes, failed


def subtree_names(model: nn.Module, module: nn.Module) -> set[str]:
    """The names (in ``model``) of the parameters of ``module`` and its descendants."""
    prefixes = [name for name, candidate in model.named_modules(remove_duplicate=False)
                if candidate is module]
    return {f"{prefix}.{name}" if prefix else name for prefix in prefixes
            for name, _ in module.named_parameters(remove_duplicate=False)}


def rule_of(name: str, writes: list[Write], stand_in: nn.Module) -> Rule:
    """How to initialise parameter ``name`` of ``stand_in``, which the family's code writes so."""
    starts = [index for index, write in enumerate(writes) if write.overwrites()]
    if not starts:
        return Refused(f"{type(stand_in).__name__}._init_weights does not set all of it (it keeps its "
                       "constructor's value, which a model built on the meta device does not have)")
    tail = writes[starts[-1]:]
    last_whole = max(index for index, write in enumerate(tail) if write.whole)
    drawn, after = tail[:last_whole + 1], tail[last_whole + 1:]
    # Whole elementwise writes, then constant rows (set after the draw, as the family sets them);
    # a part written in between (or rows before a later whole write) is computed instead.
    if all(write.whole and write.replayable() for write in drawn) and all(
            write.constant_rows() for write in after):
        return Draw(tuple(drawn), tuple(write.constant() for write in after))
    calls = tuple(dict.fromkeys(write.call for write in tail))
    module_name, _, attr = name.rpartition(".")
    holder = stand_in.get_submodule(module_name)
    numel = holder._parameters[attr].numel()
    if numel > COMPUTE_LIMIT:
        return Refused(f"{describe(calls)} computes its {numel} elements otherwise than one by one, too "
                       f"many to compute whole on every rank (at most {COMPUTE_LIMIT})")
    return Compute(calls, holder, attr)


def tie_sources(model: PreTrainedModel) -> dict[str, str]:
    """Per name of a parameter shared under several names: the name whose initialisation it keeps,
    transformers' tie source where it names one (it ties after initialising), else the first."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    declared = getattr(model, "all_tied_weights_keys", None) or {}
    sources = {}
    for group in names.values():
        source = next((declared[name] for name in group if declared.get(name) in group), group[0])
        sources.update(dict.fromkeys(group, source))
    return sources


class FamilyInitialisation:
    """Per parameter of a transformers model (by its transformers name): how to initialise it from
    scratch as its family does."""

    def __init__(self, build: Callable[[], PreTrainedModel]) -> None:
        with torch.device("meta"):  # transformers skips initialising on meta: no time, no memory
            stand_in = build()
        sources = tie_sources(stand_in)
        writes, failed = record_writes(stand_in)
        # The other parameters while a Compute runs: meta, so that the family's writes to them cost
        # nothing and a use of their values fails loudly.
        replace_tensors(stand_in, lambda tensor: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
        rules = {name: Refused(failed[name]) if name in failed else
                 rule_of(name, writes.get(name, []), stand_in) for name in set(sources.values())}
        self.rules: dict[str, Rule] = {name: rules[source] for name, source in sources.items()}

    def rule(self, name: str) -> Rule:
        rule = self.rules.get(name)
        if rule is None:
            raise ModelError(f"no initialisation rule for parameter {name!r}: not a parameter of this model")
        return rule

    def elementwise(self, name: str) -> bool:
        """Whether ``fill`` sets each element of ``name`` alone (so it may fill chunks); a refused
        parameter raises its ModelError here already."""
        rule = self.rule(name)
        if isinstance(rule, Refused):
            rule.fill(name, torch.empty(0), torch.Generator())
        return isinstance(rule, Draw)

    def constants(self, name: str) -> tuple[tuple[int, int, float], ...]:
        """(begin, end, value) ranges of an elementwise parameter's flattened elements the family sets
        to a constant after its draw (an embedding's padding row)."""
        rule = self.rule(name)
        return rule.constants if isinstance(rule, Draw) else ()

    def fill(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """``tensor``: all of parameter ``name`` in its shape, or for an elementwise one any chunk of
        it, flattened (without its ``constants``, which the caller sets)."""
        self.rule(name).fill(name, tensor, generator)
