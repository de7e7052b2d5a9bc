"""What the framework asks of a model's or a task's initialiser (``distributed/sharded_model.py``
draws with it): ``init_parameter(name, tensor, generator)`` fills one parameter from ``generator``;
``init_parameter_elementwise`` says which parameters it fills element by element, whatever the
tensor's shape, so that it may be called on fixed-size chunks of the flattened parameter and a rank
draws only its shard's chunks; the others are filled as whole tensors."""

from __future__ import annotations

from typing import Any


def draws_elementwise(initializer: Any, name: str) -> bool:
    """Whether ``initializer`` fills parameter ``name`` element by element: its
    ``init_parameter_elementwise``, True or False for every parameter, or a method asked per name
    (a model that computes a few small parameters whole); False without one."""
    flag = getattr(initializer, "init_parameter_elementwise", False)
    return bool(flag(name)) if callable(flag) else bool(flag)
