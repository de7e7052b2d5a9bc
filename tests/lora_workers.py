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
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import transformers
from checkpoint_workers import warnings_logged
from equivalence import case_config, hand_written_loop, small_corpus
from hf_workers import hf_case_config, hf_corpus
from peft import LoraConfig, PeftModel, get_peft_model
from task_workers import N, make_task, task_config  # puts examples/tasks on sys.path
from torch import nn
from torchao.quantization import NF4Tensor, to_nf4

# isort: split
from reference import reference_model, reference_run

from shardtrain.config.plan import resolve_plan
from shardtrain.config.schema import Config, FinetuneConfig
from shardtrain.diagnostics.memory import state_bytes
from shardtrain.diagnostics.rails import check_optimizer
from shardtrain.distributed.parallelize import reshard_all
from shardtrain.distributed.qlora import NF4_BLOCK, NF4_SCALER_BLOCK, is_nf4, quantized_linears
from shardtrain.distributed.sharded_model import init_full_parameter
from shardtrain.errors import CheckpointError, ModelError
from shardtrain.models.hf_directory import PREFIX
from shardtrain.models.llama import Llama
from shardtrain.models.lora import AdapterInitializer, adapter_targets, is_adapter, local_bytes, lora_config
from shardtrain.tasks.language_model import LanguageModelTask

LORA = FinetuneConfig(method="lora", rank=4, alpha=8.0)
QLORA = dataclasses.replace(LORA, method="qlora")
# A Llama whose linear weights split into whole NF4 blocks (64 x 256 elements) at 2 ranks.
NF4_SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_hidden_layers=2)
# The NF4 tensor's inner tensors that FSDP shards and all-gathers, and its mean (every rank's same).
NF4_INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")
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


# Tokens of the sample drawn at the end of a LoRA and a QLoRA run (from a gathered copy with adapters).
SAMPLE_TOKENS = 6


def train_case(cfg: Config, corpus=None, task=None) -> dict:
    from shardtrain.train.loop import Trainer

    task = task if task is not None else LanguageModelTask(corpus=corpus)
    return train_trained(Trainer.create(cfg, task=task))


def train_trained(trainer) -> dict:
    """Train a created trainer; what the cases check of it."""
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
            "checkpointed": len(trainer.built.report.checkpointed), "frozen_bytes": frozen_bytes,
            "sample": result.sample, "finetune": trainer.cfg.finetune}


def bf16_pure_dtypes(cfg: Config, corpus) -> dict:
    """One step under bf16-pure: the dtypes of the base, the adapters and the adapters' Adam state."""
    from shardtrain.train.loop import Trainer

    cfg.trainer = dataclasses.replace(cfg.trainer, max_steps=1)
    trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=corpus))
    trainer.fit()
    params = dict(trainer.model.named_parameters())
    state = trainer.built.optimizer.state
    return {"base": {p.dtype for n, p in params.items() if not is_adapter(n)},
            "adapters": {p.dtype for n, p in params.items() if is_adapter(n)},
            "adam": {t.dtype for n, p in params.items() if is_adapter(n)
                     for key, t in state[p].items() if key != "step"}}


def run_lora_cases(model_dir: str, other_base: str, tied_dir: str, adapter_dir: str, nf4_dir: str,
                   out_dir: str) -> None:
    """A tiny HF Llama FULL_SHARD with a checkpoint at step 3, HYBRID_SHARD, a resume from step 3, and a
    resume onto another base (refused); a tied-embedding Qwen2; the built-in Llama; a task's model;
    adapters started from a PEFT adapter directory (model.adapter, which sets the targets); QLoRA on a
    Llama of NF4-sized weights, its resume, and its base's bytes under LoRA; strategy.float8's
    precomputed scales (torchao's other feature, whose import this group already pays)."""
    world_size = int(os.environ["WORLD_SIZE"])
    results = run_qlora_cases(nf4_dir, world_size, out_dir)
    results["float8_scales"] = float8_scale_case(out_dir)
    corpus = hf_corpus(model_dir)
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
    builtin.trainer = dataclasses.replace(builtin.trainer, sample_tokens=SAMPLE_TOKENS)  # the end's sample
    results["builtin"] = train_case(builtin, small_corpus())
    results["qwen2"] = train_case(lora_case_config(tied_dir, world_size, str(Path(out_dir, "qwen2")),
                                                   checkpoint=True), hf_corpus(tied_dir))
    vit = task_config(world_size, str(Path(out_dir, "vit")), checkpoint_every=N)  # a task's LoRA checkpoint
    vit.finetune = dataclasses.replace(LORA, targets=list(VIT_TARGETS))
    results["vit"] = train_case(vit, task=make_task("vit"))
    for case, base_dtype in (("bf16_mixed", "fp32"), ("bf16_base", "bf16")):  # finetune.base_dtype
        cfg = lora_case_config(model_dir, world_size, str(Path(out_dir, case)), mixed_precision="bf16-mixed",
                               checkpoint=case == "bf16_base")  # export-peft of a bf16 base
        cfg.finetune = dataclasses.replace(cfg.finetune, base_dtype=base_dtype)
        results[case] = train_case(cfg, corpus)
    results["bf16_pure"] = bf16_pure_dtypes(lora_case_config(
        model_dir, world_size, str(Path(out_dir, "bf16_pure")), mixed_precision="bf16-pure"), corpus)
    # saved: its adapters are on 9 of the 14 projections the default targets select (tests/test_lora.py
    # reads it as a checkpoint of the narrower defaults before 2026-12-01)
    from_adapter = lora_case_config(model_dir, world_size, str(Path(out_dir, "from_adapter")),
                                    checkpoint=True)
    from_adapter.model = dataclasses.replace(from_adapter.model, adapter=adapter_dir)
    from_adapter.finetune = FinetuneConfig(method="lora")  # rank, alpha, targets: the adapter's
    results["from_adapter"] = train_case(from_adapter, corpus)  # its "finetune": as the adapter set it
    step3 = str(Path(first, "checkpoints", "step-3"))
    results["resumed"] = train_case(lora_case_config(
        model_dir, world_size, str(Path(out_dir, "resumed")), resume=step3), corpus)
    # A resume with another alpha (built, not trained): said.
    rescaled = lora_case_config(model_dir, world_size, str(Path(out_dir, "rescaled")), resume=step3)
    rescaled.finetune = dataclasses.replace(LORA, alpha=2 * LORA.alpha)
    with warnings_logged() as warned:
        from shardtrain.train.loop import Trainer
        Trainer.create(rescaled, task=LanguageModelTask(corpus=corpus))
    results["rescaled"] = {"warned": warned}
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


def nf4_state(model) -> dict[str, dict]:
    """Each NF4 weight's sharded local tensor, by our name: its class, and its inner tensors as
    this rank holds them (4-bit data, int8 scales, their fp32 factors and mean)."""
    state = {}
    for name, param in model.named_parameters():
        local = param.to_local()
        if is_nf4(param):
            state[name] = {"class": type(local).__name__, "dtype": local.quantized_data.dtype,
                           "bytes": local_bytes(param), "fp32_bytes": local.numel() * 4,
                           **{attr: getattr(local, attr).clone() for attr in NF4_INNER}}
    return state


def gathered_nf4(model) -> dict[str, dict]:
    """``nf4_state`` of every rank, rank by rank (a collective)."""
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, nf4_state(model))
    return {name: [rank[name] for rank in ranks] for name in ranks[0]}


def unsharded_weight_types(model) -> dict[str, str]:
    """The class of each quantised linear's weight while its FSDP unit runs forward (all-gathered)."""
    seen = {}

    def record(name: str, module: nn.Module) -> None:
        weight = module.weight
        seen[name] = (type(weight).__name__, getattr(weight, "quantized_data", weight).dtype)

    handles = [module.register_forward_pre_hook(lambda m, _, name=name: record(name, m))
               for name, module in quantized_linears(model)]
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    reshard_all(model)
    for handle in handles:
        handle.remove()
    return seen


def run_qlora_cases(nf4_dir: str, world_size: int, out_dir: str) -> dict:
    """finetune=qlora FULL_SHARD with a checkpoint at step 3 (the NF4 shards recorded before and after
    training, and the class of the weights FSDP all-gathers); its resume from step 3; the same
    model's base under finetune=lora, for its bytes."""
    from shardtrain.train.loop import Trainer

    corpus = hf_corpus(nf4_dir)
    results = {}
    cfg = lora_case_config(nf4_dir, world_size, str(Path(out_dir, "qlora")), checkpoint=True)
    cfg.finetune = dataclasses.replace(QLORA)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, interval=3)
    cfg.trainer = dataclasses.replace(cfg.trainer, sample_tokens=SAMPLE_TOKENS)  # from the dequantised base
    trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=corpus))
    before = gathered_nf4(trainer.model)
    gathered_types = unsharded_weight_types(trainer.model)
    results["qlora"] = train_trained(trainer)
    results["qlora"].update(nf4_before=before, nf4_after=gathered_nf4(trainer.model),
                            gathered_types=gathered_types, state_bytes=state_bytes(trainer.model, None))
    resumed = lora_case_config(nf4_dir, world_size, str(Path(out_dir, "qlora_resumed")),
                               resume=str(Path(out_dir, "qlora", "checkpoints", "step-3")))
    resumed.finetune = dataclasses.replace(QLORA)
    results["qlora_resumed"] = train_case(resumed, corpus)
    as_lora = Trainer.create(lora_case_config(nf4_dir, world_size, str(Path(out_dir, "qlora_as_lora"))),
                             task=LanguageModelTask(corpus=corpus))
    quantized = set(results["qlora"]["nf4_after"])
    results["qlora_as_lora"] = {"base_bytes": sum(local_bytes(p) for n, p in as_lora.model.named_parameters()
                                                  if n in quantized),
                                "state_bytes": state_bytes(as_lora.model, None)}
    return results


def float8_scale_case(out_dir: str, steps: int = 3) -> dict:
    """strategy.float8's scale precomputation on FULL_SHARD shards: the same tiny Llama, its linears
    converted and sharded as parallelize does (a CPU refuses strategy.float8 itself, so the pieces
    are called directly; torch's CPU float8 matmul is emulated), trained with and without
    ``precompute_float8_scales_after_steps``: both runs' losses, and after each step each converted
    weight's precomputed scale against float8's largest value over the weight's whole largest |w|;
    then the same scales on another model after DCP's optimizer-state initialisation and a read of
    the trained weights, before and after ``refresh_float8_scales`` (what a resume does); and the
    same training under HYBRID_SHARD with one rank a shard group, whose plan gathers the weights in
    their own dtype (each linear casts its own to float8) and precomputes nothing. The trained
    weights saved by DCP as checkpoints save them (``plain_float8_weights``): plain tensors, which a
    process without torchao imported reads, and which a load fills the converted weights from."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from torchao.float8.float8_linear import Float8Linear

    from shardtrain.distributed.env import build_mesh
    from shardtrain.distributed.float8 import convert_linears
    from shardtrain.distributed.parallelize import (
        plain_float8_weights,
        precompute_float8_scales_after_steps,
        refresh_float8_scales,
    )

    cfg = case_config(int(os.environ["WORLD_SIZE"]), "unused", model=dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, vocab_size=256))
    plan_strategy = dataclasses.replace(cfg.strategy, float8=True)  # (a CPU refuses it in load_config)
    plan = resolve_plan(plan_strategy, int(os.environ["WORLD_SIZE"]), 1)
    mesh = build_mesh(plan, "cpu")
    batch = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (steps, 2, 33), generator=batch)
    result: dict = {"losses": {}, "scales": []}

    def next_token_loss(model: Llama, window: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())

    def sharded_float8_llama(seed: int, plan=plan, mesh=mesh) -> tuple[Llama, list[str]]:
        torch.manual_seed(seed)
        model = Llama(cfg.model)
        converted = convert_linears(model, [f"layers.{i}" for i in range(len(model.layers))],
                                    gather_in_float8=plan.gathers_float8)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, converted

    def train(model: Llama, optimizer: torch.optim.Optimizer, window: torch.Tensor) -> float:
        loss = next_token_loss(model, window)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    for precomputed in (False, True):
        model, converted = sharded_float8_llama(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if precomputed:
            precompute_float8_scales_after_steps(optimizer, model)
        float8_linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
        # The shard's own local tensor is what FSDP's gathers cast (to_local() gives another wrapper).
        result["converted"] = len(converted)
        result["before_first_step"] = [m.weight._local_tensor._precomputed_scale for m in float8_linears]
        losses = []
        for window in tokens:
            losses.append(train(model, optimizer, window))
            if precomputed:
                finfo_max = torch.finfo(torch.float8_e4m3fn).max
                result["scales"].append([
                    (m.weight._local_tensor._precomputed_scale.item(),
                     finfo_max / m.weight.full_tensor().abs().max().double().item()) for m in float8_linears])
        result["losses"][precomputed] = losses
    # The gathers cast with the precomputed scales rather than computing their own: the trained
    # model's loss on one window with its scales as precomputed, with none (each gather computes
    # it), and with every scale 16 times too large (weights saturate in float8) must differ there.
    with torch.no_grad():
        def window_loss() -> float:
            return next_token_loss(model, tokens[0]).item()

        precomputed_scales = [m.weight._local_tensor._precomputed_scale for m in float8_linears]
        result["window_loss"] = {"precomputed": window_loss()}
        for m in float8_linears:
            m.weight._local_tensor._precomputed_scale = None
        result["window_loss"]["computed_by_gathers"] = window_loss()
        for m, scale in zip(float8_linears, precomputed_scales, strict=True):
            m.weight._local_tensor._precomputed_scale = scale * 16
        result["window_loss"]["scales_16x"] = window_loss()
        for m, scale in zip(float8_linears, precomputed_scales, strict=True):
            m.weight._local_tensor._precomputed_scale = scale
    # A resume: reading a checkpoint initialises the optimizer's state with a zero-learning-rate step
    # (DCP), whose hook computes scales from the weights before the read; the trainer refreshes them.
    resumed, _ = sharded_float8_llama(1)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    precompute_float8_scales_after_steps(resumed_optimizer, resumed)
    get_state_dict(resumed, resumed_optimizer)
    set_model_state_dict(resumed, get_model_state_dict(model))

    def scale_errors() -> list[float]:
        finfo_max = torch.finfo(torch.float8_e4m3fn).max
        return [abs(m.weight._local_tensor._precomputed_scale.item()
                    * m.weight.full_tensor().abs().max().item() / finfo_max - 1)
                for m in resumed.modules() if isinstance(m, Float8Linear)]

    result["resume_scale_errors"] = {"before_refresh": scale_errors()}
    refresh_float8_scales(resumed)
    result["resume_scale_errors"]["after_refresh"] = scale_errors()

    # Found by review: checkpoints pickled torchao's weight subclass, so consolidate, eval, generate
    # and a resume without float8 could not read a float8 run's checkpoint (torch.load weights_only).
    saved = plain_float8_weights(get_model_state_dict(model))
    result["saved_local_types"] = sorted({type(v.to_local()).__name__ for v in saved.values()})
    directory = Path(out_dir, "float8_dcp")
    dcp.save(saved, checkpoint_id=str(directory))
    reread, _ = sharded_float8_llama(2)
    dcp.load(plain_float8_weights(get_model_state_dict(reread)), checkpoint_id=str(directory))
    result["reread_equal"] = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in
                                 zip(model.parameters(), reread.parameters(), strict=True))
    result["reread_types"] = sorted({type(p.to_local()).__name__ for p in reread.parameters()})
    if int(os.environ["RANK"]) == 0:
        reader = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                  "dcp_to_torch_save(sys.argv[1], sys.argv[2]); "
                  "print('torchao imported' if 'torchao' in sys.modules else 'read without torchao')")
        proc = subprocess.run([sys.executable, "-c", reader, str(directory), str(directory) + ".pt"],
                              capture_output=True, text=True, timeout=300)
        result["read_elsewhere"] = proc.stdout.strip() or proc.stderr[-500:]

    one_rank_groups = dataclasses.replace(plan_strategy, sharding_strategy="HYBRID_SHARD", shard_group_size=1)
    hybrid = resolve_plan(one_rank_groups, int(os.environ["WORLD_SIZE"]), 1)
    model, _ = sharded_float8_llama(0, hybrid, build_mesh(hybrid, "cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # no scales to precompute (parallelize)
    weights = [m.weight for m in model.modules() if isinstance(m, Float8Linear)]
    result["one_rank_shards"] = {
        "mesh": hybrid.mesh, "gathers_float8": hybrid.gathers_float8,
        "losses": [train(model, optimizer, window) for window in tokens],
        "local_weight_types": sorted({type(w.to_local()).__name__ for w in weights}),
        "gathers_float8_full_shard": plan.gathers_float8}
    return result


def peft_model_of(model_dir: str, nf4: bool = False):
    """The transformers model with PEFT's adapters on the targets shardtrain picks for it; ``nf4``:
    every linear weight but the head's first quantised whole by torchao's ``to_nf4`` (QLoRA's base)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    modules = adapter_targets(model, LORA.targets)
    if nf4:
        for module in model.modules():
            if type(module) is nn.Linear and module is not model.get_output_embeddings():
                module.weight = nn.Parameter(to_nf4(module.weight.detach(), NF4_BLOCK, NF4_SCALER_BLOCK),
                                             requires_grad=False)
    return get_peft_model(model, lora_config(LORA, modules))


def lora_reference(model_dir: str, nf4: bool = False) -> dict:
    """One process, no sharding: PEFT's model from the same initial adapters, hand-written loop;
    ``nf4``: on the NF4 base (the weights returned dequantised, and the NF4 tensors under "nf4")."""
    cfg = hf_case_config(model_dir, 1, "unused")
    model = peft_model_of(model_dir, nf4)
    initializer = AdapterInitializer(None, model)
    initializer.fan_in = {ours(n): f for n, f in initializer.fan_in.items()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                init_full_parameter(initializer, ours(name), param, cfg.trainer.seed)
    losses, norms = hand_written_loop(model, cfg, hf_corpus(model_dir).train,
                                      lambda x: model(input_ids=x).logits)
    # .to(fp32) dequantises an NF4 weight (.float() keeps an fp32 one NF4, and its clone() quantises
    # it again)
    weights = {ours(n): p.detach().to(torch.float32).clone() for n, p in model.named_parameters()}
    quantized = {ours(n): {attr: getattr(p, attr) for attr in NF4_INNER}
                 for n, p in model.named_parameters() if isinstance(p, NF4Tensor)}
    return {"losses": losses, "grad_norms": norms, "weights": weights, "nf4": quantized}


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
