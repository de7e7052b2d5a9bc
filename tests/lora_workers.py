"""LoRA runs of shardtrain vs PEFT's own model in a hand-written loop.

``run_lora_cases`` runs inside every spawned rank: each case trains a tiny Hugging Face Llama with
``finetune=lora`` (5 steps) and rank 0 saves losses, grad norms, the gathered weights (adapters and
base) and what the case checked. ``lora_reference`` is one process, no FSDP: ``from_pretrained``,
``peft.get_peft_model`` with the same LoRA settings, adapters started from the values the framework
draws (``init_full_parameter``), the mean loss over the global batch, ``clip_grad_norm_``, AdamW.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import transformers
from equivalence import case_config, hand_written_loop, small_corpus
from hf_workers import hf_case_config, hf_corpus
from peft import LoraConfig, PeftModel, get_peft_model
from task_workers import N, make_task, task_config  # puts examples/tasks on sys.path

# isort: split
from reference import reference_model, reference_run

from shardtrain.config.schema import Config, FinetuneConfig
from shardtrain.diagnostics.memory import local_bytes
from shardtrain.diagnostics.rails import check_optimizer
from shardtrain.distributed.sharded_model import init_full_parameter
from shardtrain.errors import CheckpointError, ModelError
from shardtrain.models.hf import PREFIX, HFCausalLM
from shardtrain.models.llama import Llama
from shardtrain.models.lora import AdapterInitializer, adapter_targets, lora_config

LORA = FinetuneConfig(method="lora", rank=4, alpha=8.0)
# The example vision transformer's projections (its patch embedding's "proj" is a Conv2d).
VIT_TARGETS = ("attn.qkv", "attn.proj", "fc1", "fc2")
# PEFT's names for our parameters: get_peft_model wraps the transformers model twice over.
PEFT_PREFIX = "base_model.model."


def lora_case_config(model_dir: str, world_size: int, run_dir: str, **case) -> Config:
    resume = case.pop("resume", None)
    cfg = hf_case_config(model_dir, world_size, run_dir, **case)
    cfg.finetune = dataclasses.replace(LORA)
    if resume is not None:
        cfg.checkpoint = dataclasses.replace(cfg.checkpoint, enabled=True, resume=resume)
    return cfg


def train_case(cfg: Config, corpus=None, task=None) -> dict:
    from shardtrain.tasks.language_model import LanguageModelTask
    from shardtrain.train.loop import Trainer

    trainer = Trainer.create(cfg, task=task if task is not None else LanguageModelTask(corpus=corpus))
    trainable = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    try:  # an optimizer over every parameter holds the frozen base too: refused
        check_optimizer(torch.optim.AdamW(trainer.model.parameters()), trainer.model)
        everything_refusal = None
    except ModelError as exc:
        everything_refusal = str(exc)
    held = sorted({id(p) for g in trainer.built.optimizer.param_groups for p in g["params"]})
    frozen_bytes = sum(local_bytes(p) for p in trainer.model.parameters() if not p.requires_grad)
    result = trainer.fit()
    weights = trainer.full_weights()
    return {"losses": result.losses, "grad_norms": result.grad_norms, "weights": weights,
            "trainable": trainable, "optimizer_holds": len(held), "main": trainer.env.is_main,
            "everything_refusal": everything_refusal,
            "checkpointed": len(trainer.built.report.checkpointed), "frozen_bytes": frozen_bytes}


def run_lora_cases(model_dir: str, other_base: str, tied_dir: str, adapter_dir: str, out_dir: str) -> None:
    """A tiny HF Llama FULL_SHARD with a checkpoint at step 3, HYBRID_SHARD, a resume from step 3, and a
    resume onto another base (refused); a tied-embedding Qwen2; the built-in Llama; a task's model;
    adapters started from a PEFT adapter directory (model.adapter, which sets the targets)."""
    world_size = int(os.environ["WORLD_SIZE"])
    corpus = hf_corpus(model_dir)
    results = {}
    first = str(Path(out_dir, "full_shard"))
    cfg = lora_case_config(model_dir, world_size, first, checkpoint=True)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, interval=3)
    results["full_shard"] = train_case(cfg, corpus)
    results["hybrid_shard"] = train_case(lora_case_config(
        model_dir, world_size, str(Path(out_dir, "hybrid_shard")), strategy="HYBRID_SHARD",
        shard_group_size=1, activation_checkpointing="all"), corpus)
    builtin = case_config(world_size, str(Path(out_dir, "builtin")))
    builtin.finetune = dataclasses.replace(LORA)
    builtin.checkpoint = dataclasses.replace(builtin.checkpoint, enabled=True, interval=0)
    results["builtin"] = train_case(builtin, small_corpus())
    results["qwen2"] = train_case(lora_case_config(tied_dir, world_size, str(Path(out_dir, "qwen2")),
                                                   checkpoint=True), hf_corpus(tied_dir))
    vit = task_config(world_size, str(Path(out_dir, "vit")))
    vit.finetune = dataclasses.replace(LORA, targets=list(VIT_TARGETS))
    results["vit"] = train_case(vit, task=make_task("vit"))
    for case, base_dtype in (("bf16_mixed", "fp32"), ("bf16_base", "bf16")):  # finetune.base_dtype
        cfg = lora_case_config(model_dir, world_size, str(Path(out_dir, case)), mixed_precision="bf16-mixed")
        cfg.finetune = dataclasses.replace(cfg.finetune, base_dtype=base_dtype)
        results[case] = train_case(cfg, corpus)
    from_adapter = lora_case_config(model_dir, world_size, str(Path(out_dir, "from_adapter")))
    from_adapter.model = dataclasses.replace(from_adapter.model, adapter=adapter_dir)
    from_adapter.finetune = FinetuneConfig(method="lora")  # rank, alpha, targets: the adapter's
    results["from_adapter"] = train_case(from_adapter, corpus)
    results["from_adapter"]["finetune"] = from_adapter.finetune
    step3 = str(Path(first, "checkpoints", "step-3"))
    results["resumed"] = train_case(lora_case_config(
        model_dir, world_size, str(Path(out_dir, "resumed")), resume=step3), corpus)
    try:
        train_case(lora_case_config(other_base, world_size, str(Path(out_dir, "other")), resume=step3),
                   corpus)
        results["other_base"] = None
    except CheckpointError as exc:
        results["other_base"] = str(exc)
    whole = lora_case_config(model_dir, world_size, str(Path(out_dir, "whole")), resume=step3)
    whole.finetune = FinetuneConfig()  # finetune.method=none: a whole model onto adapters only
    try:
        train_case(whole, corpus)
        results["without_lora"] = None
    except CheckpointError as exc:
        results["without_lora"] = str(exc)
    if results["full_shard"]["main"]:
        torch.save(results, Path(out_dir, "results.pt"))


def run_lora_cases_at_4(model_dir: str, tied_dir: str, step3: str, out_dir: str) -> None:
    """At 4 ranks: the tiny HF Llama FULL_SHARD and HYBRID_SHARD (2 replicas x 2 shards), the Qwen2
    (tied embeddings) and the built-in Llama FULL_SHARD; the HF Llama resumed from the step-3
    checkpoint the 2-rank group saved."""
    world_size = int(os.environ["WORLD_SIZE"])
    corpus = hf_corpus(model_dir)
    results = {}
    results["full_shard"] = train_case(lora_case_config(
        model_dir, world_size, str(Path(out_dir, "full_shard"))), corpus)
    results["hybrid_shard"] = train_case(lora_case_config(
        model_dir, world_size, str(Path(out_dir, "hybrid_shard")), strategy="HYBRID_SHARD",
        shard_group_size=2), corpus)
    results["qwen2"] = train_case(lora_case_config(tied_dir, world_size, str(Path(out_dir, "qwen2"))),
                                  hf_corpus(tied_dir))
    builtin = case_config(world_size, str(Path(out_dir, "builtin")))
    builtin.finetune = dataclasses.replace(LORA)
    results["builtin"] = train_case(builtin, small_corpus())
    results["resumed"] = train_case(lora_case_config(
        model_dir, world_size, str(Path(out_dir, "resumed")), resume=step3), corpus)
    if results["full_shard"]["main"]:
        torch.save(results, Path(out_dir, "results.pt"))


def peft_model_of(model_dir: str):
    """The transformers model with PEFT's adapters on the targets shardtrain picks for it."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    modules = adapter_targets(model, LORA.targets)
    return get_peft_model(model, lora_config(LORA, modules))


def lora_reference(model_dir: str) -> dict:
    """One process, no sharding: PEFT's model from the same initial adapters, hand-written loop."""
    cfg = hf_case_config(model_dir, 1, "unused")
    model = peft_model_of(model_dir)
    initializer = AdapterInitializer(None, model)
    # The adapters are drawn as the sharded build draws them for model.name=hf.
    initializer.init_parameter_elementwise = HFCausalLM.init_parameter_elementwise
    initializer.fan_in = {ours(n): f for n, f in initializer.fan_in.items()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                init_full_parameter(initializer, ours(name), param, cfg.trainer.seed)
    losses, norms = hand_written_loop(model, cfg, hf_corpus(model_dir).train,
                                      lambda x: model(input_ids=x).logits)
    weights = {ours(n): p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "weights": weights}


def ours(peft_name: str, prefix: str = PREFIX) -> str:
    """Our name of a parameter of PEFT's model."""
    return prefix + peft_name.removeprefix(PEFT_PREFIX)


def builtin_lora_reference() -> dict:
    """The built-in Llama, drawn as the sharded build draws it, wrapped by ``get_peft_model``; the
    hand-written loop on the small corpus."""
    cfg = case_config(1, "unused")
    model = Llama(cfg.model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            init_full_parameter(model, name, param, cfg.trainer.seed)
    peft_model = get_peft_model(model, lora_config(LORA, adapter_targets(model, LORA.targets)))
    initializer = AdapterInitializer(model, peft_model)
    initializer.fan_in = {ours(n, ""): f for n, f in initializer.fan_in.items()}
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if param.requires_grad:
                init_full_parameter(initializer, ours(name, ""), param, cfg.trainer.seed)
    losses, norms = hand_written_loop(peft_model, cfg, small_corpus().train, peft_model)
    weights = {ours(n, ""): p.detach().clone() for n, p in peft_model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "weights": weights}


def vit_lora_reference() -> dict:
    """The example vision transformer as the task draws it, wrapped by ``get_peft_model``; the
    examples' reference loop (tests/test_tasks.py's) on it."""
    task = make_task("vit")
    cfg = task_config(1, "unused", accum=1)
    task.bind(cfg)
    model = reference_model(task, cfg.trainer.seed)
    peft_model = get_peft_model(model, lora_config(LORA, adapter_targets(model, VIT_TARGETS)))
    initializer = AdapterInitializer(task, peft_model)
    initializer.fan_in = {ours(n, ""): f for n, f in initializer.fan_in.items()}
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if param.requires_grad:
                init_full_parameter(initializer, ours(name, ""), param, cfg.trainer.seed)
    result = reference_run(task, cfg, 2 * N, model=peft_model)
    result["weights"] = {ours(n, ""): w for n, w in result["weights"].items()}
    return result


def peft_adapter_reference(model_dir: str, adapter_dir: str) -> dict:
    """PEFT's own model loaded from the adapter directory (``PeftModel.from_pretrained``, trainable),
    the hand-written loop."""
    cfg = hf_case_config(model_dir, 1, "unused")
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                             attn_implementation="sdpa")
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    losses, norms = hand_written_loop(model, cfg, hf_corpus(model_dir).train,
                                      lambda x: model(input_ids=x).logits)
    weights = {ours(n): p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "weights": weights}


def write_peft_adapter(model_dir: str, out: Path) -> Path:
    """An adapter as PEFT users make one: ``get_peft_model`` on the model, random (non-zero) B so that
    the adapter changes the model, ``save_pretrained``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                        init_lora_weights=False, task_type="CAUSAL_LM")
    get_peft_model(model, config).save_pretrained(str(out))
    return out
