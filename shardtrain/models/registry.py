"""The built-in models by ``model.name``: the one place that turns a model config into a model."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from shardtrain.config.schema import BUILTIN_MODELS, ModelConfig
from shardtrain.errors import ConfigError
from shardtrain.models.llama import Llama


def hf_causal_lm(cfg: ModelConfig) -> nn.Module:
    """``model.name=hf``: ``models/hf.HFCausalLM``, imported through importlib on purpose, as PEFT
    and the trackers are: it imports transformers, 1-2 s of start-up for every process, which only
    the runs with a Hugging Face model need (training, generating from, evaluating, exporting it)."""
    return importlib.import_module("shardtrain.models.hf").HFCausalLM(cfg)


BUILDERS: dict[str, Callable[[ModelConfig], nn.Module]] = {"llama": Llama, "hf": hf_causal_lm}
assert set(BUILDERS) == set(BUILTIN_MODELS), "config.schema.BUILTIN_MODELS and BUILDERS disagree"


def build_model(cfg: ModelConfig) -> nn.Module:
    if cfg.name not in BUILDERS:
        raise ConfigError(f"model.name={cfg.name!r} is unknown; built-in models: {', '.join(BUILDERS)}")
    return BUILDERS[cfg.name](cfg)


def model_factory(cfg: ModelConfig) -> Callable[[], nn.Module]:
    """The default ``model_factory`` of training, generation and planning."""
    return lambda: build_model(cfg)
