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
    learnt position embedding held as a plain parameter of 2 or more dimensions is not one of them.
    Every name of such a parameter: a table tied to a head registered before it is named by the
    head's first (``named_parameters``' one name), and was decayed (found by review)."""
    kept = set()
    for module in model.modules():
        for param_name, param in module.named_parameters(recurse=False):
            if param.ndim < 2 or param_name.startswith("bias") or isinstance(module, (nn.Embedding, *NORMS)):
                kept.add(id(param))
    return {name for name, param in model.named_parameters(remove_duplicate=False) if id(param) in kept}
