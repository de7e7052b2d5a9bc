"""A task's options: its ``Options`` dataclass filled from ``task.options``, and written back as the
plain values config.yaml and every checkpoint's JSON record.

OmegaConf types the values, but it refuses ``typing.Literal`` (the annotation a researcher writes for
``mode: Literal["mean", "sum"]``): such a field is read as its values' type and checked against them
here. Enums are recorded by name and paths as strings, the spellings OmegaConf reads back at a resume.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import pathlib
import types
import typing
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from shardtrain.config.keys import boolean_spelling
from shardtrain.config.suggest import closest
from shardtrain.errors import ConfigError

WHAT_OPTIONS_HOLD = ("numbers, strings, booleans, Enums, paths, Literals of strings or numbers, "
                     "and lists, dicts or dataclasses of them")


def same_value(a: Any, b: Any) -> bool:
    """Equal as recorded values, NaN equal to itself (a NaN default is no wrong type)."""
    # (repr for what JSON cannot encode: a Path, an Enum member, compared unequal rather than a
    # TypeError: found by review)
    def recorded(value: Any) -> str:
        return json.dumps(value, sort_keys=True, default=repr)

    return a == b or recorded(a) == recorded(b)


def literal_choices(hint: Any) -> tuple[tuple[Any, ...], bool] | None:
    """The values a ``Literal[...]`` (or ``Literal[...] | None``) allows, and whether None is one."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint), False
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        inner = next(a for a in args if a is not type(None))
        if typing.get_origin(inner) is typing.Literal:
            return typing.get_args(inner), True
    return None


def resolved_hints(options_cls: type) -> dict[str, Any]:
    """The fields' annotations as types (``from __future__ import annotations`` makes them strings)."""
    try:
        return typing.get_type_hints(options_cls)
    except Exception:  # noqa: BLE001 - an unresolvable annotation is OmegaConf's to report, by name
        return {}


def literal_fields(hints: Mapping[str, Any]) -> dict[str, tuple[tuple[Any, ...], bool]]:
    """The fields annotated ``Literal``, with their choices."""
    found = {}
    for name, hint in hints.items():
        choices = literal_choices(hint)
        if choices is not None:
            found[name] = choices
    return found


def readable_schema(options_cls: type, hints: Mapping[str, Any],
                    literals: Mapping[str, tuple[tuple[Any, ...], bool]]) -> type:
    """``options_cls``'s fields as OmegaConf reads them (each Literal typed as its values' type),
    without its methods: filled, it runs no ``__post_init__``, so the values are recorded as given
    (as before Literals were read) and the task's own class is built from them once."""
    fields = []
    for f in dataclasses.fields(options_cls):
        kind: Any = hints.get(f.name, f.type)
        if f.name in literals:
            choices, optional = literals[f.name]
            kinds = {type(c) for c in choices}
            if len(kinds) != 1 or not kinds <= {str, int, float, bool}:
                raise ConfigError(f"task option {f.name}: Literal{list(choices)} mixes types or holds "
                                  "other than strings or numbers; use one type, or an Enum")
            kind = kinds.pop()
            kind = kind | None if optional else kind
        missing = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if missing and not f.init else f.default  # set by __post_init__, recorded as null
        # Keyword-only, all of them: a kw_only Options may put a field without a default after one with.
        spec = dataclasses.field(default=default, default_factory=f.default_factory, metadata=f.metadata,
                                 kw_only=True)
        fields.append((f.name, kind if f.init or not missing else Any, spec))
    return dataclasses.make_dataclass(options_cls.__name__, fields)


def check_booleans(options_cls: type, hints: Mapping[str, Any],
                   literals: Mapping[str, tuple[tuple[Any, ...], bool]], given: Mapping[str, Any]) -> None:
    """A boolean option (or a Literal of booleans) given anything but a boolean's spelling: OmegaConf
    reads any integer as true, as for the schema's own booleans (config/keys.py)."""
    for f in dataclasses.fields(options_cls):
        raw = given.get(f.name)
        boolean = f.type in ("bool", bool) or hints.get(f.name) is bool or (
            f.name in literals and all(isinstance(choice, bool) for choice in literals[f.name][0]))
        if boolean and raw is not None and not (
                isinstance(raw, bool) or raw in (0, 1) or (isinstance(raw, str) and boolean_spelling(raw))):
            raise ConfigError(f"task.{f.name}={raw!r} is not a boolean: write task.{f.name}=true or "
                              f"task.{f.name}=false")


def read_options(options_cls: type, given: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``options_cls`` filled from ``given`` (every other field its default), and the values as given,
    plain, for the records. A value of the wrong type, or outside a Literal's choices, is a
    ConfigError naming ``task.NAME``."""
    hints = resolved_hints(options_cls)
    literals = literal_fields(hints)
    check_booleans(options_cls, hints, literals, given)
    schema = readable_schema(options_cls, hints, literals)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), dict(given))
        read = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        first = str(exc).splitlines()[0]
        if first.startswith("Unexpected type annotation: Literal"):  # one inside a nested dataclass
            raise ConfigError(f"task.{key}: Literal options are read at the top level of a task's Options "
                              "only; annotate it str (or an Enum) instead") from exc
        raise ConfigError(f"invalid value for task.{key}: {first}") from exc
    for name, (choices, optional) in literals.items():
        value = getattr(read, name)
        if value not in choices and not (optional and value is None):
            shown = [str(c) for c in choices]
            raise ConfigError(f"task.{name}={value!r} is unknown{closest(str(value), shown)}; choose one of "
                              f"{', '.join(shown)}")
    init = {f.name for f in dataclasses.fields(options_cls) if f.init}
    values = {name: getattr(read, name) for name in init}
    # OmegaConf reads a tuple as a list: the task gets the type it declared (found by a user trial).
    values |= {name: tuple(value) for name, value in values.items()
               if isinstance(value, list) and tuple in (hints.get(name), typing.get_origin(hints.get(name)))}
    return options_cls(**values), plain_options(OmegaConf.to_container(merged))


def plain(value: Any) -> Any:
    """``value`` as JSON holds it: an Enum by name, a path as a string, a tuple as a list, a dataclass
    as a dict of its fields."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def plain_options(options: Any) -> dict[str, Any]:
    """A task's options as the plain values config.yaml and each checkpoint record, refused before the
    run (not at its first save) where one cannot be recorded."""
    values = plain(options)
    for name, value in values.items():
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"task option {name}={value!r} cannot be recorded in config.yaml and the "
                              f"checkpoints, which rebuild the task at a resume: options hold "
                              f"{WHAT_OPTIONS_HOLD} ({exc})") from exc
    return values
