"""Hugging Face models trained by shardtrain vs the plain transformers model in a hand-written loop.

``run_hf_cases`` runs inside every spawned rank: for each family and strategy it builds the model from
its directory (``model.name=hf``), records the logits right after loading, trains 5 steps, and rank 0
saves losses, grad norms and the gathered weights. ``hf_reference`` is one process, no FSDP:
``from_pretrained``, the mean loss over the global batch, ``clip_grad_norm_``, AdamW.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import transformers
from equivalence import GLOBAL_BATCH, STEPS, hand_written_loop

from shardtrain.config.schema import Config, DataConfig
from shardtrain.data.corpus import Corpus, load_corpus
from shardtrain.data.tokenizer import HFTokenizer
from shardtrain.models.hf import attention_implementation

ADAM_EPS = 1e-6  # see test_hf_models.py: bounds how far Adam blows up rounding noise
PROBE = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(7))


def hf_corpus(model_dir: str) -> Corpus:
    return load_corpus(DataConfig(max_bytes=150_000, val_percent=30.0), HFTokenizer(model_dir))


def hf_case_config(model_dir: str, world_size: int, run_dir: str, strategy: str = "FULL_SHARD",
                   checkpoint: bool = False, **strategy_extra) -> Config:
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, name="hf", path=model_dir)
    cfg.strategy = dataclasses.replace(cfg.strategy, sharding_strategy=strategy, **strategy_extra)
    cfg.trainer = dataclasses.replace(
        cfg.trainer, max_steps=STEPS, micro_batch_size=GLOBAL_BATCH // world_size, seq_len=32,
        lr=3e-3, warmup_steps=2, grad_clip_norm=1.0, adam_eps=ADAM_EPS, eval_every=0, eval_samples=8,
        sample_tokens=0, progress_bar=False, log_every=100,
    )
    cfg.run = dataclasses.replace(cfg.run, dir=run_dir, trackers=[])
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, enabled=checkpoint, interval=0)
    cfg.diagnostics = dataclasses.replace(cfg.diagnostics, enabled=False)
    return cfg


def run_hf_cases(model_dirs: dict[str, str], cases: dict[str, dict], out_dir: str,
                 router_dir: str | None = None) -> None:
    from shardtrain.tasks.language_model import LanguageModelTask
    from shardtrain.train.loop import Trainer

    world_size = int(os.environ["WORLD_SIZE"])
    for family, model_dir in model_dirs.items():
        corpus = hf_corpus(model_dir)
        for name, case in cases.items():
            run_dir = str(Path(out_dir, f"{family}-{name}"))
            trainer = Trainer.create(hf_case_config(model_dir, world_size, run_dir, **case),
                                     task=LanguageModelTask(corpus=corpus))
            with torch.no_grad():
                trainer.model.eval()
                logits = trainer.model(PROBE).detach().clone()
                trainer.model.train()
            result = trainer.fit()
            weights = trainer.full_weights()
            if trainer.env.is_main:
                torch.save({"losses": result.losses, "grad_norms": result.grad_norms,
                            "weights": weights, "logits": logits, "units": trainer.built.report.units},
                           Path(out_dir, f"{family}-{name}.pt"))
    if router_dir is not None:  # in the same spawned group
        run_router_loss_cases(router_dir, out_dir)


def run_router_loss_cases(model_dir: str, out_dir: str) -> None:
    """A MoE model asking for its router's load-balancing loss, trained with the plain loss and
    the chunked one (its hidden states and head): rank 0 saves what ``run_hf_cases`` saves and the
    logged router_loss of each step."""
    from shardtrain.tasks.language_model import LanguageModelTask
    from shardtrain.train.loop import Trainer

    world_size = int(os.environ["WORLD_SIZE"])
    corpus = hf_corpus(model_dir)
    for chunk in (0, 8):
        cfg = hf_case_config(model_dir, world_size, str(Path(out_dir, f"router-{chunk}")),
                             checkpoint=chunk == 0)  # a MoE checkpoint for the export test
        cfg.trainer = dataclasses.replace(cfg.trainer, loss_chunk_tokens=chunk)
        trainer = Trainer.create(cfg, task=LanguageModelTask(corpus=corpus))
        result = trainer.fit()
        weights = trainer.full_weights()
        if trainer.env.is_main:
            torch.save({"losses": result.losses, "grad_norms": result.grad_norms, "weights": weights,
                        "router_losses": [m["router_loss"] for m in result.metrics]},
                       Path(out_dir, f"router-{chunk}.pt"))


def hf_reference(model_dir: str, micro_batches: int = 1) -> dict:
    """The plain transformers model, one process, a hand-written loop."""
    cfg = hf_case_config(model_dir, 1, "unused")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attention_implementation(config))
    with torch.no_grad():
        logits = model.eval()(PROBE).logits
    model.train()
    extra = None
    if getattr(config, "output_router_logits", False):
        # transformers' load-balancing loss of each micro-batch (a rank's, as the framework computes
        # it), their mean weighed as the framework weighs them: by target tokens, here all equal
        def extra(x: torch.Tensor) -> torch.Tensor:
            parts = [model(input_ids=part).aux_loss for part in x.chunk(micro_batches)]
            return config.router_aux_loss_coef * torch.stack(parts).mean()
    losses, norms = hand_written_loop(model, cfg, hf_corpus(model_dir).train,
                                      lambda x: model(input_ids=x).logits, extra)
    weights = {f"hf.{n}": p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "weights": weights, "logits": logits}

