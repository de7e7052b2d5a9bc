"""What the framework asks of a model's or a task's initialiser (``distributed/sharded_model.py``
draws with it): ``init_parameter(name, tensor, generator)`` fills one parameter from ``generator``;
``init_parameter_elementwise`` says which parameters it fills element by element, whatever the
tensor's shape, so that it may be called on fixed-size chunks of the flattened parameter and a rank
draws only its shard's chunks; the others are filled as whole tensors. An elementwise one may name
ranges of the flattened parameter set to a constant after the draw (``init_parameter_constants``:
an embedding's padding row), which a chunk alone cannot place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def draws_elementwise(initializer: Any, name: str) -> bool:
    """Whether ``initializer`` fills parameter ``name`` element by element: its
    ``init_parameter_elementwise``, True or False for every parameter, or a method asked per name
    (a model that computes a few small parameters whole); False without one."""
    flag = getattr(initializer, "init_parameter_elementwise", False)
    return bool(flag(name)) if callable(flag) else bool(flag)


def elementwise_constants(initializer: Any, name: str) -> Sequence[tuple[int, int, float]]:
    """``(begin, end, value)`` ranges of parameter ``name``'s flattened elements that
    ``initializer`` sets to ``value`` after its elementwise draw (``init_parameter_constants``);
    none without one."""
    constants = getattr(initializer, "init_parameter_constants", None)
    return constants(name) if constants is not None else ()
