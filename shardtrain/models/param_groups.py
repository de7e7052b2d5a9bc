"""Which parameters get weight decay: shared by the optimizer and the memory planner."""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _NormBase

# Normalisation layers whose affine parameters take the input's shape: a LayerNorm over (C, H, W)
# has a 3-D weight, which is still a norm's scale.
NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, _NormBase)


def no_decay_names(model: nn.Module) -> set[str]:
    """Norm weights, biases and embedding tables: anything 1-D, a parameter named ``bias*`` (the
    attention's ``bias_k`` is 3-D), or owned by a normalisation layer or an ``nn.Embedding``. A
    learnt position embedding held as a plain parameter of 2 or more dimensions is not one of them."""
    names = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if param.ndim < 2 or param_name.startswith("bias") or isinstance(module, (nn.Embedding, *NORMS)):
                names.add(f"{module_name}.{param_name}" if module_name else param_name)
    return names
