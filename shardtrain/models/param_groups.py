"""Which parameters get weight decay: shared by the optimizer and the memory planner."""

from __future__ import annotations

from torch import nn


def no_decay_names(model: nn.Module) -> set[str]:
    """Norm weights, biases and embedding tables: anything 1-D or owned by an nn.Embedding (a learnt
    position embedding held as a plain parameter of 2 or more dimensions is not one of them)."""
    names = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if param.ndim < 2 or isinstance(module, nn.Embedding):
                names.add(f"{module_name}.{param_name}" if module_name else param_name)
    return names
