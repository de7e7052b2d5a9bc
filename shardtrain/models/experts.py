"""A mixture-of-experts model's routed experts, found by their shape: the weights a module holding
``num_experts`` experts stacks them in (transformers v5's ``experts.gate_up_proj`` [experts, ...],
JetMoe's parallel experts, Dbrx's [experts x rows, columns]). A router's [experts, hidden] weight
is no expert's: every token runs it."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn


def routed_expert_weights(model: nn.Module) -> Iterator[tuple[nn.Parameter, int]]:
    """Each stacked expert weight of ``model`` and how many experts it stacks."""
    for module in model.modules():
        count = getattr(module, "num_experts", getattr(module, "moe_num_experts", None))  # Dbrx's
        if not isinstance(count, int) or isinstance(count, bool) or count < 2:
            continue
        for param in module.parameters(recurse=False):
            rows = param.shape[0] if param.dim() else 0
            if param.dim() >= 3 and rows == count:  # [experts, out, in]
                yield param, count
            elif param.dim() == 2 and rows > count and rows % count == 0:  # [experts x out, in]
                yield param, count


def inactive_expert_params(model: nn.Module, experts_per_token: int) -> int:
    """Parameters of the routed experts a token does not run: all but ``experts_per_token`` of each
    stack's experts."""
    return sum(param.numel() * (count - experts_per_token) // count
               for param, count in routed_expert_weights(model) if count > experts_per_token)


def routed_expert_params(model: nn.Module) -> int:
    """Parameters of ``model``'s routed experts (no linear layers: LoRA does not adapt them, QLoRA
    does not quantise them)."""
    return sum(param.numel() for param, _ in routed_expert_weights(model))
