"""Code that runs inside spawned ranks for the tensor-parallelism tests."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from checkpoint_workers import interrupted, new_trainer
from equivalence import GLOBAL_BATCH, STEPS, case_config, run_cases
from hf_workers import hf_case_config, hf_corpus
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from shardtrain.checkpoint.checkpointer import random_streams_kept, seed_random_streams
from shardtrain.checkpoint.safetensors_files import open_safetensors, weight_files
from shardtrain.checkpoint.weights import base_parameters, own_rows, row_sharded
from shardtrain.distributed.parallelize import (
    apply_tensor_parallel,
    block_selective_contexts,
    enable_activation_checkpointing,
)
from shardtrain.errors import ConfigError
from shardtrain.generation.generate import gathered_copy, generate
from shardtrain.generation.inference import load_for_inference
from shardtrain.tasks.language_model import LanguageModelTask
from shardtrain.tasks.task import LossOutput
from shardtrain.train.loop import Trainer

# The tiny model of the equivalence tests with a feed-forward width tensor parallelism can split
# (97 cannot be halved); dim 36, 6 heads, 2 key/value heads and the 256-token vocabulary can.
TP_MODEL = {"ffn_hidden_dim": 98}
SPLITS = (2, 4)  # FSDP 4 to step 2, FSDP 2 x TP 2 to step 4, FSDP 4 again (and 1 process) to the end
# The tiny Hugging Face Llama of tests/hf_models.py with a feed-forward width TP 2 can split.
HF_SIZES = {"intermediate_size": 98}
ACCUM = 2
SAMPLE_TOKENS = 8
# bf16-mixed through the framework in one process: what a bf16-mixed TP run is compared with.
BF16_ONE_PROCESS = {"bf16_one_process": dict(precision="bf16-mixed", accum=ACCUM, model=TP_MODEL)}


class FeedForwardOnlyPlan(LanguageModelTask):
    """A task passing its own tensor-parallel plan: only the feed-forward of each block is split
    (attention, embedding and head stay whole on every rank of the group)."""

    def parallelize_tensors(self, model, tp_mesh, sequence_parallel: bool) -> None:
        for layer in model.hf.model.layers:
            parallelize_module(layer.mlp, tp_mesh, {"gate_proj": ColwiseParallel(),
                                                    "up_proj": ColwiseParallel(),
                                                    "down_proj": RowwiseParallel()})


class VocabularySplitTiedPlan(FeedForwardOnlyPlan):
    """The feed-forward plan, and a tied embedding and head split along the vocabulary by the
    task's own styles (each style makes its module's weight a parameter of its own)."""

    def parallelize_tensors(self, model, tp_mesh, sequence_parallel: bool) -> None:
        super().parallelize_tensors(model, tp_mesh, sequence_parallel)
        parallelize_module(model.hf, tp_mesh,
                           {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                            "lm_head": ColwiseParallel(output_layouts=Replicate())})


class TiedPair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def check_tied_weights_split_apart_are_refused() -> None:
    """A plan that splits a tied weight's modules differently (or one of them only) cannot keep
    them one tensor: one line naming each place and how it lies."""
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for styles, message in (({"embed": ColwiseParallel(), "head": ColwiseParallel()},
                             "embed.weight (Shard(dim=1)), head.weight (Shard(dim=0))"),
                            ({"head": ColwiseParallel()},
                             "embed.weight (whole), head.weight (Shard(dim=0))")):
        def plan(model, tp_mesh, sequence_parallel, styles=styles):
            parallelize_module(model, tp_mesh, styles)
        try:
            apply_tensor_parallel(TiedPair(), mesh, False, plan)
        except ConfigError as error:
            want = f"the tensor-parallel plan splits one tied weight differently: {message}; "
            assert want in str(error), error
        else:
            raise AssertionError(f"a tied weight split apart by {styles} was not refused")


class LossOnSplitLogits(LanguageModelTask):
    """The language model's loss as a task of one's own writes it: cross-entropy on the model's
    logits, under TP a DTensor split along the vocabulary, handed to the framework as it comes (no
    ``to_local``), with a metric from the same DTensor."""

    def loss(self, model, batch) -> LossOutput:
        logits = model(batch.inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), reduction="sum")
        return LossOutput(loss, batch.targets.numel(), {"nll": loss.detach()})


def hf_tensor_parallel_cases(model_dirs: dict[str, str], cases: dict[str, dict], out: str) -> None:
    """Each case trains the Hugging Face model of its ``family`` (fp32, 2 micro-batches); rank 0
    saves losses, grad norms, the gathered weights and how each parameter lies over tp."""
    world = int(os.environ["WORLD_SIZE"])
    # One family's corpus at a time: the families share a tokenizer recipe and so a prepared-data
    # cache entry, which preparing for another family's tokenizer directory rewrites.
    corpus, corpus_family = None, None
    for name, case in cases.items():
        case = dict(case)
        family = case.pop("family")
        if family != corpus_family:
            corpus, corpus_family = hf_corpus(model_dirs[family]), family
        own_plan, own_loss = case.pop("own_plan", None), case.pop("own_loss", False)
        plans = {"feed_forward": FeedForwardOnlyPlan, "vocabulary": VocabularySplitTiedPlan}
        task = (plans[own_plan] if own_plan else LossOnSplitLogits if own_loss
                else LanguageModelTask)(corpus=corpus)
        model_dir = model_dirs[family]
        cfg = hf_case_config(model_dir, world, f"{out}/{name}", **case)
        data_parallel = world // cfg.strategy.tensor_parallel
        cfg.trainer = dataclasses.replace(cfg.trainer, grad_accum_steps=ACCUM,
                                          micro_batch_size=GLOBAL_BATCH // (data_parallel * ACCUM))
        trainer = Trainer.create(cfg, task=task)
        column_blocks = column_blocks_read(trainer.model, Path(model_dir))
        result = trainer.fit()
        weights = trainer.full_weights()
        if trainer.env.is_main:
            torch.save({"losses": result.losses, "grad_norms": result.grad_norms, "weights": weights,
                        "layout": trainer.built.report.tensor_parallel, "column_blocks": column_blocks},
                       Path(out, f"{name}.pt"))


def column_blocks_read(model, directory: Path) -> int:
    """How many weights split along a column (row-parallel under TP) this rank read as its own block
    only, each equal to what the model was loaded with (found by review: each rank read the
    whole tensor, a third of a model per rank at every start)."""
    params = dict(base_parameters(model, remove_duplicate=False))
    checked = 0
    for file in weight_files(directory):
        with open_safetensors(file) as handle:
            for key in handle.keys():
                param = params.get(model.parameter_name(key))
                if isinstance(param, torch.distributed.tensor.DTensor) and not row_sharded(param):
                    part = own_rows(param, handle, key, key)
                    assert part.shape == param.to_local().shape and part.numel() < param.numel(), key
                    assert torch.equal(part.to(param.dtype), param.to_local()), key
                    checked += 1
    return checked


def eight_ranks(out: str, cases: dict[str, dict], hf_dirs: dict[str, str], hf_cases: dict[str, dict]) -> None:
    """8 ranks: the built-in Llama's cases, then the Hugging Face ones."""
    run_cases(cases, out)
    hf_tensor_parallel_cases(hf_dirs, hf_cases, out)


def layout_config(run_dir: str, resume: str = "auto", world: int = 4, **strategy):
    cfg = case_config(world, run_dir, model=TP_MODEL, **strategy)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, enabled=True, resume=resume)
    return cfg


def equivalence_and_resume(out: str, cases: dict[str, dict], hf_dirs: dict[str, str],
                           hf_cases: dict[str, dict]) -> None:
    """4 ranks: every equivalence case (the built-in Llama's, then the Hugging Face ones), then one
    run across layouts (DCP reshards the DTensors at each change): FSDP 4 to step 2, saved;
    resumed as FSDP 2 x TP 2 to step 4 (sampling text at step 4), saved; resumed as FSDP 4 again
    to the last step. The first
    run also goes on to step 4 and saves there: the FSDP-only checkpoint the TP one is compared with.
    ``one_process_leg`` resumes the TP checkpoint in one process afterwards."""
    run_cases(cases, out)
    hf_tensor_parallel_cases(hf_dirs, hf_cases, out)
    check_tied_weights_split_apart_are_refused()
    first = new_trainer(layout_config(f"{out}/fsdp4"))
    interrupted(first, SPLITS[0])
    tp_cfg = layout_config(f"{out}/tp", resume=f"{out}/fsdp4/checkpoints/step-{SPLITS[0]}", tensor_parallel=2)
    # The periodic sample during training, drawn from the tensor-parallel weights (gathered once).
    tp_cfg.trainer = dataclasses.replace(tp_cfg.trainer, sample_every=SPLITS[1], sample_tokens=SAMPLE_TOKENS)
    second = new_trainer(tp_cfg)
    assert second.step == SPLITS[0], second.step
    # At the same world size with tensor parallelism added, rank r is another data-parallel rank:
    # the streams are seeded afresh, tensor-parallel peers alike (found by review: each rank took
    # the FSDP run's rank r's, so the two ranks of a tensor-parallel group drew different dropout).
    streams: list = [None] * 4
    torch.distributed.all_gather_object(streams, torch.get_rng_state())
    assert torch.equal(streams[0], streams[1]) and torch.equal(streams[2], streams[3])
    assert not torch.equal(streams[0], streams[2])
    # ... and from the step: seeded as a fresh run's, each resume at another size drew step 1's
    # dropout masks again (found by a review)
    with random_streams_kept():
        seed_random_streams(tp_cfg.trainer.seed, second.env.rank // 2)
        assert not torch.equal(torch.get_rng_state(), streams[second.env.rank])
        seed_random_streams(tp_cfg.trainer.seed, second.env.rank // 2, SPLITS[0])
        assert torch.equal(torch.get_rng_state(), streams[second.env.rank])
    interrupted(second, SPLITS[1] - SPLITS[0])
    tp_weights = second.full_weights()
    # A task's batch of a length sequence parallelism cannot split evenly: one line on every rank
    # before any collective (it desynchronised the gathers: gloo aborted, NCCL may hang).
    odd = torch.zeros(1, 7, dtype=torch.long, device=second.env.device)
    try:
        second.model(odd)
    except ConfigError as error:
        assert "a batch's sequence length=7 must be a multiple of strategy.tensor_parallel=2" in str(error)
    else:
        raise AssertionError("an uneven sequence split was not refused")
    # An id past the vocabulary-split table: every rank's "other" row, a zero vector, without the
    # check (found by review; a whole table fails, as the embedding exchange does)
    outside = torch.full((1, 8), 256, dtype=torch.long, device=second.env.device)
    try:
        second.model(outside)
    except RuntimeError as error:
        assert "a token id is outside the embedding's 256 rows" in str(error), error
    else:
        raise AssertionError("a token id outside the vocabulary was looked up")
    check_selective_keeps_reduce_scatters(second)
    interrupted(first, SPLITS[1] - SPLITS[0])  # the FSDP-only checkpoint at the TP one's step
    third = new_trainer(layout_config(f"{out}/back", resume=f"{out}/tp/checkpoints/step-{SPLITS[1]}"))
    assert third.step == SPLITS[1], third.step
    result = third.fit()
    weights = third.full_weights()
    runs = ((first, SPLITS[0]), (second, None), (third, None))
    if third.env.is_main:
        torch.save({"losses": [loss for run, n in runs for loss in run.result.losses[:n]],
                    "grad_norms": [norm for run, n in runs for norm in run.result.grad_norms[:n]],
                    "weights": weights, "tp_weights": tp_weights,
                    "ids": [ids.tolist() for run, n in runs for ids in run.consumed_ids[:n]]},
                   Path(out, "across_layouts.pt"))
    assert len(result.losses) == STEPS - SPLITS[1]


class TensorParallelReduceScatters(TorchDispatchMode):
    """Counts the functional reduce-scatters tensor parallelism runs (FSDP's are c10d's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops._c10d_functional.reduce_scatter_tensor.default
        return func(*args, **(kwargs or {}))


def check_selective_keeps_reduce_scatters(trainer: Trainer) -> None:
    """Selective checkpointing on a sequence-parallel model reruns none of tensor parallelism's
    reduce-scatters in backward (found by review: it reran each block's row-wise ones, as full
    checkpointing does, on backward's critical path). Turns checkpointing on in ``trainer``'s
    blocks: its training is over."""
    tokens = torch.arange(16, device=trainer.env.device).reshape(2, 8)

    def in_backward() -> int:
        loss = trainer.model(tokens).full_tensor().float().square().mean()
        with TensorParallelReduceScatters() as counted:
            loss.backward()
        trainer.model.zero_grad(set_to_none=True)
        return counted.count

    plain = in_backward()
    for block in trainer.model.layers:
        enable_activation_checkpointing(block, block_selective_contexts(block, float8=False))
    assert in_backward() == plain > 0, plain


def generated(checkpoint: str, prompt: list[int], **sampling) -> list[int]:
    """What ``shardtrain generate`` does in one process: the checkpoint loaded, gathered, generated."""
    loaded = load_for_inference(checkpoint, dtype="fp32")
    model = gathered_copy(loaded.model, loaded.factory, loaded.env.device, loaded.compute_dtype)
    return generate(model, prompt, SAMPLE_TOKENS, **sampling)


def one_process_leg(out: str) -> None:
    """1 process: the FSDP 2 x TP 2 checkpoint of step 4 resumed to the last step; and generation
    from that checkpoint and from the FSDP-only one of the same step: greedy, and with the
    training-time sample's settings (the TP run sampled at that step)."""
    run_cases(BF16_ONE_PROCESS, out)  # the baseline of the bf16-mixed TP case
    run = new_trainer(layout_config(f"{out}/one", resume=f"{out}/tp/checkpoints/step-{SPLITS[1]}", world=1))
    assert run.step == SPLITS[1], run.step
    result = run.fit()
    tokenizer, t = run.task.tokenizer, run.cfg.trainer
    prompt = tokenizer.encode(t.sample_prompt)
    tp, fsdp = (f"{out}/{name}/checkpoints/step-{SPLITS[1]}" for name in ("tp", "fsdp4"))
    sampled = generated(tp, prompt, temperature=0.8, top_k=40, seed=t.seed, vocab_limit=tokenizer.vocab_size,
                        stop_tokens=tokenizer.stop_ids)
    torch.save({"losses": result.losses, "grad_norms": result.grad_norms, "weights": run.full_weights(),
                "ids": [ids.tolist() for ids in run.consumed_ids],
                "greedy": {name: generated(path, prompt) for name, path in (("tp", tp), ("fsdp", fsdp))},
                "sampled": tokenizer.decode(prompt + sampled)}, Path(out, "one_process.pt"))
