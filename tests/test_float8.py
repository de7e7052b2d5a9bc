"""strategy.float8: refused where there are no float8 matmuls, counted by the planner, and the
conversion swaps the blocks' linear layers (not the output head) for torchao's Float8Linear, their
weights gathered in float8 only where they are sharded.
Training itself needs a GPU of compute capability 8.9+: benchmarks/run.py --only float8; the scales
precomputed after each step are tested at 2 ranks in test_lora.py (its group already imports torchao)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from shardtrain.cli.main import main
from shardtrain.config.loader import check_runtime, load_config
from shardtrain.config.plan import resolve_plan
from shardtrain.diagnostics.planner import estimate
from shardtrain.errors import ConfigError
from shardtrain.models.registry import build_model

REFUSAL = "strategy.float8=true needs a GPU with float8 matmuls"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without float8")
def test_float8_is_refused_on_cpu_with_one_line_but_planned(capsys, tmp_path):
    with pytest.raises(ConfigError, match=f"{REFUSAL} .* this run has a CPU; drop strategy.float8"):
        check_runtime(load_config(["strategy.float8=true"]))
    assert main(["train", "strategy.float8=true", f"run.dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"shardtrain: error: {REFUSAL}") and "\n" not in err
    assert not (tmp_path / "run").exists()
    # Planning is for other machines (a login node plans the GPU job): the plan counts float8 and
    # NCCL here without refusing, and --simulate says why it cannot run float8.
    plan = ["plan", "model=llama3_8b", "trainer.seq_len=8192", "trainer.micro_batch_size=1",
            "strategy.mixed_precision=bf16-mixed", "strategy.float8=true", "dist.backend=nccl"]
    assert main([*plan, "--world-sizes", "8"]) == 0
    out = capsys.readouterr().out
    assert "float8 linears, gathered in float8 where a shard group has more than one rank; 1 process per " \
        "node" in out and "8 x FULL_SHARD" in out
    assert main([*plan, "--simulate"]) == 2
    assert "the simulator cannot run strategy.float8" in capsys.readouterr().err


def test_planner_gathers_converted_linears_in_float8():
    # The default (chunked) loss: the peak is where the head unit's gradients are reduced, with the
    # last block still gathered, in float8.
    cfg = load_config(["model=llama3_8b", "trainer.seq_len=8192", "trainer.micro_batch_size=1",
                       "strategy.mixed_precision=bf16-mixed"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    plain = estimate(cfg, model, "FULL_SHARD", 8, 8)
    cfg.strategy.float8 = True
    fp8 = estimate(cfg, model, "FULL_SHARD", 8, 8)
    # One block's seven projections (dim 4,096, 8 KV heads of 128, FFN 14,336), counted here.
    block_linears = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert plain.peak_phase == fp8.peak_phase == "head reduced"  # the head and the last block gathered
    assert plain.peak - fp8.peak == plain.gathered - fp8.gathered == block_linears  # 2 bytes -> 1
    assert (fp8.params, fp8.grads, fp8.optimizer, fp8.activations) == (
        plain.params, plain.grads, plain.optimizer, plain.activations)
    # One rank a shard group: the weights are gathered in bf16 (ShardingPlan.gathers_float8), so
    # the plan is the plain one's.
    for world_size, overrides in ((1, {}), (8, {"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 1})):
        cfg.strategy = dataclasses.replace(cfg.strategy, float8=False, **overrides)
        plain = estimate(cfg, model, cfg.strategy.sharding_strategy, world_size, 8)
        cfg.strategy.float8 = True
        fp8 = estimate(cfg, model, cfg.strategy.sharding_strategy, world_size, 8)
        assert (fp8.peak, fp8.gathered) == (plain.peak, plain.gathered), world_size


def test_conversion_swaps_block_linears_but_not_the_head(tmp_path):
    """Only the blocks' linears: not the output head (even a Hugging Face model's whose logits are
    scaled, which ``output_head`` does not name, or whose head is tied to the embedding), and not
    LoRA's adapters, which train in fp32 (at rank 16 they would divide by 16)."""
    import transformers
    from torchao.float8.float8_linear import Float8Linear  # torchao: only this test pays its import

    from shardtrain.config.schema import ModelConfig
    from shardtrain.distributed.float8 import convert_linears
    from shardtrain.models.hf import HFCausalLM
    from shardtrain.models.lora import add_adapters

    cfg = load_config(["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                       "model.ffn_hidden_dim=96"])
    blocks = ["layers.0", "layers.1"]
    model = build_model(cfg.model)
    converted = convert_linears(model, blocks, gather_in_float8=True)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(converted) == {n for n in linears if n.startswith("layers.")} and len(converted) == 14
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in converted)
    assert all(model.get_submodule(n).config.enable_fsdp_float8_all_gather for n in converted)
    head = model.output_head()
    assert not isinstance(head, Float8Linear) and isinstance(head, nn.Linear)
    unsharded = build_model(cfg.model)
    assert convert_linears(unsharded, blocks, gather_in_float8=False) == converted
    assert not any(unsharded.get_submodule(n).config.enable_fsdp_float8_all_gather for n in converted)
    # A task's micro-batch of tokens not a multiple of 16, which CUDA's float8 weight gradients need,
    # is refused in its first forward (torch's CPU float8 matmul takes it: a GPU's backward failed);
    # without gradients (evaluation, generation) it runs
    from shardtrain.errors import TrainingError

    with pytest.raises(TrainingError, match=r"layers\.0\.\w+\.\w+ got 8 tokens .* multiple of 16"):
        model(torch.zeros(1, 8, dtype=torch.long))
    with torch.no_grad():
        assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, cfg.model.vocab_size)
    model(torch.zeros(2, 8, dtype=torch.long)).float().sum().backward()

    lora = load_config(["model.dim=64", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
                        "model.ffn_hidden_dim=96", "finetune=lora"])
    adapted = add_adapters(build_model(lora.model), lora.finetune)
    converted = convert_linears(adapted, ["layers.0"], gather_in_float8=True)
    assert len(converted) == 7 and not any("lora_" in name for name in converted), converted
    # A frozen base's scales are computed once after the weights are read, not after every step
    # (found by review: a pass and an all-reduce a step over weights that never change)
    from shardtrain.distributed.parallelize import trains_any

    assert not trains_any(adapted, converted)  # add_adapters froze the base
    # A frozen base's float8 weight gradient is computed eager (so the token count is refused), and
    # dropped compiled (so it is not: found by review, refused for nothing)
    tokens = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(TrainingError, match=r"got 8 tokens"):
        adapted(tokens)
    try:
        torch.compile(adapted)(tokens).float().sum().backward()
    finally:
        torch.compiler.reset()
    assert all(p.grad is not None for n, p in adapted.named_parameters() if "lora_" in n)
    assert trains_any(model, [name for name in linears if name.startswith("layers.")])

    # Cohere scales its logits (so output_head() is None) and ties its head to the embedding.
    transformers.CohereConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    cohere = HFCausalLM(ModelConfig(name="hf", path=str(tmp_path)))
    assert cohere.output_head() is None
    hf_blocks = [n for n, m in cohere.named_modules() if isinstance(m, cohere.block_classes)]
    converted = convert_linears(cohere, hf_blocks, gather_in_float8=True)
    assert len(converted) == 7 and not any("lm_head" in name for name in converted), converted
    lm_head = cohere.hf.get_output_embeddings()
    assert not isinstance(lm_head, Float8Linear) and lm_head.weight is cohere.hf.get_input_embeddings().weight


@pytest.mark.parametrize(("strategy", "world_size", "shard_group_size", "gathers"), [
    ("FULL_SHARD", 8, 0, True), ("FULL_SHARD", 1, 0, False), ("HYBRID_SHARD", 8, 4, True),
    ("HYBRID_SHARD", 8, 1, False), ("NO_SHARD", 8, 0, False)])
def test_float8_weights_are_gathered_in_float8_only_where_sharded(strategy, world_size, shard_group_size,
                                                                   gathers):
    strategy_cfg = dataclasses.replace(load_config(["strategy.mixed_precision=bf16-mixed"]).strategy,
                                       sharding_strategy=strategy, shard_group_size=shard_group_size)
    local = min(world_size, 8)
    assert resolve_plan(strategy_cfg, world_size, local).gathers_float8 is False
    plan = resolve_plan(dataclasses.replace(strategy_cfg, float8=True), world_size, local)  # a CPU refuses it
    assert plan.gathers_float8 is gathers
    assert plan.describe().endswith(f"float8 linears gathered in {'float8' if gathers else 'bfloat16'}")


def test_multihead_attention_out_proj_is_not_converted_and_a_model_with_nothing_to_convert_is_refused(
        monkeypatch):
    """Found by review: nn.MultiheadAttention reads its out_proj's weight without calling the layer,
    so a float8 out_proj (the DiT example's) failed in torchao's addmm at two ranks and ran in fp32,
    counted as float8, at one; and a model with no linear of float8 sizes trained on without float8,
    its start-up line saying float8."""
    import types

    import shardtrain.distributed.float8  # noqa: F401  registers the conversion (imports torchao)
    from shardtrain.distributed import parallelize as parallelize_module
    from shardtrain.distributed.float8 import convert_linears

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
            self.mlp = nn.Linear(width, width)

    class Model(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(width)])

    assert convert_linears(Model(64), ["blocks.0"], gather_in_float8=True) == ["blocks.0.mlp"]
    monkeypatch.setattr(parallelize_module, "check_float8", lambda device: None)  # a CPU refuses float8
    plan = resolve_plan(dataclasses.replace(load_config([]).strategy, float8=True), 1, 1)
    with pytest.raises(ConfigError, match=r"^strategy.float8=true found no linear layer to convert in the "
                                          r"model's 1 blocks: .* multiples of 16"):
        parallelize_module.parallelize(Model(72), types.SimpleNamespace(device_type="cpu"), plan, [Block])


def test_compiled_frozen_float8_linear_leaves_its_weight_gradient_out():
    """torchao's float8 backward computes a weight gradient whether the weight trains or not (a LoRA
    base's is then dropped); compiled, as float8 is meant to run, AOTAutograd leaves that matmul
    out of the backward graph: one float8 matmul in a frozen linear's backward, two in a trained
    one's (what docs/configuration.md says of strategy.float8 with finetune=lora)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from shardtrain.distributed.float8 import convert_linears

    def backward_matmuls(trained: bool) -> int:
        graphs = []

        def keep(graph, _inputs):
            graphs.append(graph)
            return make_boxed_func(graph.forward)

        model = nn.Sequential(nn.Sequential(nn.Linear(64, 64, bias=False)))
        convert_linears(model, ["0"], gather_in_float8=False)
        model[0][0].weight.requires_grad_(trained)
        compiled = torch.compile(model, backend=aot_autograd(
            fw_compiler=lambda graph, _inputs: make_boxed_func(graph.forward), bw_compiler=keep))
        compiled(torch.randn(32, 64, requires_grad=True)).sum().backward()
        (backward,) = graphs
        return sum(node.target is torch.ops.aten._scaled_mm.default for node in backward.graph.nodes)

    assert (backward_matmuls(trained=True), backward_matmuls(trained=False)) == (2, 1)
