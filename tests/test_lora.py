"""LoRA under FSDP2 (``finetune=lora``) at 2 gloo ranks, fp32, against PEFT's own model
(``get_peft_model`` on the same model and initial adapters) trained by a hand-written loop in one
process on the same batches.

One spawned group runs every case: a tiny Hugging Face Llama FULL_SHARD (saving at step 3) and
HYBRID_SHARD (2 replicas, every block activation-checkpointed), a resume from step 3, a resume onto
another base and one without finetune=lora, a Qwen2 with tied embeddings, the built-in Llama
(random base), and the example vision-transformer task (a task's own model and initialiser).
Checked: losses, grad norms and final adapters within relative 1e-5 of the reference (measured:
printed), the frozen base bit-identical, the optimizer holding exactly the adapters, the checkpoint
holding only adapters and their optimizer state, the resume bit-exact, the wrong resumes refused
with one line; export-peft's round trip through ``PeftModel.from_pretrained`` and its failure on a
corrupted adapter; embeddings, heads and non-Linear targets refused.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from distributed import run_on_ranks
from equivalence import max_errors
from hf_models import family_config, make_model_dir, sample_texts, train_tokenizer
from lora_workers import (
    NF4_INNER,
    NF4_SIZES,
    builtin_lora_reference,
    lora_reference,
    run_lora_cases,
    vit_lora_reference,
)
from safetensors.torch import load_file, save_file
from torch import nn
from torchao.quantization import NF4Tensor

from shardtrain.checkpoint.weights import model_config_of
from shardtrain.cli.main import main
from shardtrain.config.compose import compose_config
from shardtrain.distributed.qlora import (
    NF4_GRAIN,
    check_quantizable,
    quantized_linears,
    to_nf4_before_sharding,
)
from shardtrain.distributed.sharded_model import with_adapters
from shardtrain.errors import CheckpointError, ConfigError
from shardtrain.export.peft import export_peft, verify_peft_export
from shardtrain.models.hf import PREFIX
from shardtrain.models.llama import Llama
from shardtrain.models.lora import adapter_targets, add_adapters, is_adapter

TOL = 1e-5
# The vision transformer's adapters: 1.4e-5 measured, all of it one row of blocks.0's fc1 lora_B (a
# hidden unit GELU barely opens: its gradient is near rounding, and Adam steps on it at full size;
# 2.0e-6 of the tensor's 2.7e-6 summed absolute difference, every other adapter within 1.3e-6). The
# examples' own tests explain the same effect on attention biases (tests/task_workers.py).
WEIGHT_TOL = {"vit": {"weights": 5e-5}}
# QLoRA's adapters: 1.2e-5 measured, nearly all of it in layers.0.mlp.down_proj's lora_A, one row
# (seven elements above 1e-6: 6.7e-5 of the tensor's 7.8e-5 summed absolute difference): the input
# columns of a down projection that the gated MLP barely opens get gradients near rounding, which Adam
# steps on at full size, as with the vision transformer above. Every other adapter within 2.6e-6;
# losses 1.4e-7, grad norms 8e-8.
QLORA_WEIGHT_TOL = 5e-5


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_models")
    tokenizer = train_tokenizer(sample_texts())
    return (str(make_model_dir(root / "llama", "llama", seed=0, tokenizer=tokenizer)),
            str(make_model_dir(root / "other", "llama", seed=1, tokenizer=tokenizer)),
            str(make_model_dir(root / "qwen2", "qwen2", seed=2, tokenizer=tokenizer)),
            str(make_model_dir(root / "nf4", "llama", seed=3, tokenizer=tokenizer, **NF4_SIZES)))


@pytest.fixture(scope="module")
def lora_runs(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_runs")
    run_on_ranks(run_lora_cases, 2, *model_dirs, str(out), tmp_path=out)
    return out, torch.load(out / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def reference(model_dirs):
    return lora_reference(model_dirs[0])


def adapters(weights: dict) -> dict:
    return {n: w for n, w in weights.items() if is_adapter(n)}


@pytest.mark.parametrize("case", ["full_shard", "hybrid_shard", "qwen2", "builtin", "vit"])
def test_lora_matches_peft_reference(lora_runs, reference, model_dirs, case):
    _, results = lora_runs
    result = results[case]
    ref = {"builtin": builtin_lora_reference, "vit": vit_lora_reference,
           "qwen2": lambda: lora_reference(model_dirs[2])}.get(case, lambda: reference)()
    errors = max_errors({**result, "weights": adapters(result["weights"])},
                        {**ref, "weights": adapters(ref["weights"])})
    print(case, errors)
    tolerance = {**dict.fromkeys(errors, TOL), **WEIGHT_TOL.get(case, {})}
    assert all(errors[k] < tolerance[k] for k in errors), errors
    assert result["weights"].keys() == ref["weights"].keys()
    frozen = [n for n in ref["weights"] if not is_adapter(n)]
    assert frozen and all(torch.equal(result["weights"][n], ref["weights"][n]) for n in frozen)
    assert result["trainable"] == sorted(adapters(ref["weights"]))
    assert result["optimizer_holds"] == len(result["trainable"])
    assert "frozen parameters" in result["everything_refusal"], result["everything_refusal"]
    assert result["checkpointed"] == (3 if case == "hybrid_shard" else 0)
    moved = [n for n, w in adapters(result["weights"]).items() if ".lora_B." in n and w.abs().max() > 0]
    assert len(moved) == len(result["trainable"]) // 2  # every B left zero: the adapters trained


def test_lora_base_weights_untouched(lora_runs, model_dirs):
    _, results = lora_runs
    stored = load_file(f"{model_dirs[0]}/model.safetensors")
    base = {n.replace(".base_layer.", "."): w for n, w in results["full_shard"]["weights"].items()
            if not is_adapter(n)}
    assert base.keys() == {PREFIX + n for n in stored}
    for name, tensor in stored.items():
        assert torch.equal(base[PREFIX + name], tensor), name


def test_lora_checkpoint_holds_adapters_and_resumes_exactly(lora_runs):
    out, results = lora_runs
    step3 = out / "full_shard" / "checkpoints" / "step-3"
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(step3)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    optim_keys = [k for k in keys if k.startswith("optim.state.")]
    assert model_keys and all(is_adapter(k) for k in model_keys), model_keys[:3]
    assert {k.rpartition(".")[0].removeprefix("optim.state.") for k in optim_keys} \
        == {k.removeprefix("model.") for k in model_keys}
    state = json.loads((step3 / "trainer_state.json").read_text())
    assert state["base_weights"]["fingerprint"]
    full, resumed = results["full_shard"], results["resumed"]
    assert resumed["losses"] == full["losses"][3:]
    for name, weight in full["weights"].items():
        assert torch.equal(resumed["weights"][name], weight), name
    refusal = results["other_base"]
    assert refusal is not None and "\n" not in refusal and "trained on base" in refusal, refusal
    refusal = results["without_lora"]
    assert refusal is not None and "\n" not in refusal and "finetune.method=lora" in refusal, refusal
    with pytest.raises(CheckpointError, match="holds LoRA adapters only") as caught:
        model_config_of(step3)  # what generate, eval and export-hf read first
    assert "\n" not in str(caught.value) and "export-peft" in str(caught.value)


def test_lora_targets_refuse_embeddings_and_head():
    model = nn.Module()
    model.tok_embeddings = nn.Embedding(10, 4)
    model.wq = nn.Linear(4, 4)
    model.output = nn.Linear(4, 10)
    model.output_head = lambda: model.output
    assert adapter_targets(model, []) == ["wq"]
    for target, what in (("tok_embeddings", "embedding"), ("output", "output head")):
        with pytest.raises(ConfigError, match=f"selects the {what}") as caught:
            adapter_targets(model, [target])
        assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="selects no nn.Linear"):
        adapter_targets(model, ["nothing"])
    model.patch = nn.Conv2d(3, 4, 2)
    with pytest.raises(ConfigError, match="a Conv2d: LoRA takes nn.Linear layers only"):
        adapter_targets(model, ["patch"])


def test_lora_targets_refuse_a_tied_embedding():
    """Qwen2 ties its head to its input embedding: either name is refused, the defaults are not."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(family_config("qwen2"))
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert len(adapter_targets(model, [])) == 3 * 7  # q k v o gate up down per layer
    for target, what in (("embed_tokens", "embedding"), ("lm_head", "output head")):
        with pytest.raises(ConfigError, match=f"selects the {what}"):
            adapter_targets(model, [target])


def test_export_peft_of_the_builtin_llama(lora_runs, tmp_path):
    """Its q/k adapters' lora_B rows go through the rotary permutation export-hf applies."""
    out, _ = lora_runs
    checkpoint = out / "builtin" / "checkpoints" / "step-5"
    keys = load_file(str(export_peft(checkpoint, tmp_path / "adapter")[1])).keys()
    assert "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight" in keys
    difference = verify_peft_export(checkpoint, tmp_path / "adapter")
    print("export-peft logits, built-in Llama", difference)
    assert difference < TOL


def test_export_peft_round_trip_and_corruption(lora_runs, tmp_path):
    out, _ = lora_runs
    checkpoint = out / "full_shard" / "checkpoints" / "step-5"
    written = export_peft(checkpoint, tmp_path / "adapter")
    assert [p.name for p in written] == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads(written[0].read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    keys = load_file(str(written[1])).keys()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    difference = verify_peft_export(checkpoint, tmp_path / "adapter")
    print("export-peft logits", difference)
    assert difference < TOL
    tensors = load_file(str(written[1]))
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    tensors[key] = tensors[key] * 3
    save_file(tensors, str(written[1]))
    with pytest.raises(CheckpointError, match="export check failed"):
        verify_peft_export(checkpoint, tmp_path / "adapter")


def test_export_peft_of_a_qlora_checkpoint(lora_runs, tmp_path):
    """QLoRA's adapters are LoRA's: export-peft writes them the same way and checks itself."""
    out, _ = lora_runs
    checkpoint = out / "qlora" / "checkpoints" / "step-5"
    export_peft(checkpoint, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    difference = verify_peft_export(checkpoint, tmp_path / "adapter")
    print("export-peft logits, qlora checkpoint", difference)
    assert difference < TOL


def test_finetune_config_and_qlora_refusals():
    """QLoRA runs on a CPU; what it cannot do is refused in one line: weights whose row shards do
    not hold whole NF4 blocks (named, with the fix), float8 (it converts the same layers)."""
    cfg = compose_config(["finetune=lora", "finetune.rank=8", "finetune.targets=[q_proj,v_proj]"])
    assert (cfg.finetune.method, cfg.finetune.rank, cfg.finetune.targets) == ("lora", 8, ["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="not a preset|finetune.method"):
        compose_config(["finetune=lorra"])
    cfg = compose_config(["finetune=qlora", "finetune.targets=[0]"])
    factory = with_adapters(lambda: nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 36)), cfg,
                            torch.device("cpu"))
    model = factory()
    assert [n for n, _ in quantized_linears(model)] == ["0.base_layer", "1"]  # the untargeted one too
    with pytest.raises(ConfigError, match=r"1.weight \(36 x 128\) does not split into 1 row shards "
                                          r"of whole NF4 blocks") as caught:
        check_quantizable(model, 1)
    assert "\n" not in str(caught.value) and "finetune.method=lora" in str(caught.value)
    kept = to_nf4_before_sharding(model[:1], shards=1)  # built whole: quantised at once, kept from FSDP
    base = model[0].base_layer
    assert kept == {base.weight}
    assert isinstance(base.weight, NF4Tensor) and base.bias.dtype == torch.float32
    with pytest.raises(ConfigError, match="not the DCP checkpoint /runs/x/step-9; `shardtrain consolidate`"):
        with_adapters(nn.Linear, compose_config(["finetune=qlora", "model.init_from=/runs/x/step-9"]), None)
    for setting in ("strategy.float8=true", "strategy.compile=true"):
        with pytest.raises(ConfigError, match=f"qlora does not combine with {setting}") as caught:
            with_adapters(lambda: nn.Linear(2, 2), compose_config(["finetune=qlora", setting]),
                          torch.device("cpu"))
        assert "\n" not in str(caught.value)


def nf4_of_ranks(ranks: list[dict]) -> dict:
    """One weight's NF4 tensors as its rank shards hold them, put back together (rank order = rows)."""
    whole = {attr: torch.cat([rank[attr] for rank in ranks]) for attr in NF4_INNER if attr != "scaler_mean"}
    means = [rank["scaler_mean"] for rank in ranks]
    assert all(torch.equal(mean, means[0]) for mean in means)  # every rank dequantises alike
    return {**whole, "scaler_mean": means[0]}


def test_qlora_matches_peft_on_the_same_nf4_base(lora_runs, model_dirs):
    """finetune=qlora at 2 ranks against get_peft_model on the model whose linear weights are
    to_nf4 of the same weights: losses, grad norms, adapters; the sharded NF4 data is the
    reference's, bit for bit, before and after training; FSDP all-gathers NF4 (4-bit data)."""
    _, results = lora_runs
    result = results["qlora"]
    ref = lora_reference(model_dirs[3], nf4=True)
    errors = max_errors({**result, "weights": adapters(result["weights"])},
                        {**ref, "weights": adapters(ref["weights"])})
    print("qlora", errors)
    tolerance = {"loss": TOL, "grad_norm": TOL, "weights": QLORA_WEIGHT_TOL}
    assert all(errors[k] < tolerance[k] for k in errors), errors
    quantized = sorted(ref["nf4"])
    assert len(quantized) == 2 * 7 and not any("lm_head" in n or "embed" in n for n in quantized)
    assert sorted(result["nf4_before"]) == quantized == sorted(result["nf4_after"])
    for name in quantized:
        before, after = nf4_of_ranks(result["nf4_before"][name]), nf4_of_ranks(result["nf4_after"][name])
        for attr in NF4_INNER:
            assert torch.equal(before[attr], ref["nf4"][name][attr]), (name, attr)
            assert torch.equal(after[attr], before[attr]), (name, attr)
        assert {(r["class"], r["dtype"]) for r in result["nf4_after"][name]} == {("NF4Tensor", torch.uint8)}
    frozen = [n for n in ref["weights"] if not is_adapter(n)]  # dequantised, and the rest as read
    assert all(torch.equal(result["weights"][n], ref["weights"][n]) for n in frozen)
    assert result["trainable"] == sorted(adapters(ref["weights"]))
    assert result["optimizer_holds"] == len(result["trainable"])
    # What FSDP's all-gather rebuilt for each linear's forward: NF4 with 4-bit data (axolotl#2992:
    # not plain weights).
    assert set(result["gathered_types"].values()) == {("NF4Tensor", torch.uint8)}
    assert len(result["gathered_types"]) == len(quantized)


def test_qlora_base_bytes_per_rank(lora_runs):
    """Per-rank bytes of the quantised weights' shards under QLoRA against the same weights under
    LoRA (fp32): 4 bits per element plus one int8 scale per 64 and an fp32 factor per 16,384."""
    _, results = lora_runs
    shards = [rank for ranks in results["qlora"]["nf4_after"].values() for rank in ranks[:1]]  # rank 0's
    nf4_bytes, fp32_bytes = sum(r["bytes"] for r in shards), sum(r["fp32_bytes"] for r in shards)
    lora_bytes = results["qlora_as_lora"]["base_bytes"]
    params = results["qlora"]["state_bytes"].params, results["qlora_as_lora"]["state_bytes"].params
    print(f"quantised weights, rank 0: qlora {nf4_bytes:,} B, lora {lora_bytes:,} B "
          f"({nf4_bytes / lora_bytes:.4f}); all parameters: qlora {params[0]:,} B, lora {params[1]:,} B")
    assert lora_bytes == fp32_bytes
    elements = fp32_bytes // 4
    # uint8 pairs of 4-bit codes, an int8 scale per block of 64, an fp32 factor per 64 x 256, and
    # each weight's fp32 mean and 16-entry NF4 table
    tables = len(shards) * (4 + 16 * 4)
    assert nf4_bytes == elements // 2 + elements // 64 + 4 * (elements // NF4_GRAIN) + tables
    assert nf4_bytes / lora_bytes < 0.13  # ~1/8 of fp32


def test_qlora_checkpoint_holds_adapters_and_resumes_exactly(lora_runs):
    out, results = lora_runs
    step3 = out / "qlora" / "checkpoints" / "step-3"
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(step3)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(is_adapter(k) for k in model_keys), model_keys[:3]
    state = json.loads((step3 / "trainer_state.json").read_text())
    assert state["base_weights"]["quantization"].startswith("nf4")
    full, resumed = results["qlora"], results["qlora_resumed"]
    assert resumed["losses"] == full["losses"][3:]
    for name, weight in full["weights"].items():
        assert torch.equal(resumed["weights"][name], weight), name


def test_plan_simulate_counts_the_adapters(capsys):
    """plan --simulate builds the model with its adapters: gradients and Adam state of the adapters
    only (fp32, at one rank: their full size); the planner's formulas (full fine-tuning) are flagged."""
    overrides = ["model=llama3_8b", "model.n_layers=2", "trainer.seq_len=512", "trainer.micro_batch_size=1",
                 "strategy.mixed_precision=bf16-mixed", "finetune=lora", "finetune.rank=64"]
    assert main(["plan", "--simulate", *overrides, "--world-sizes", "1"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith("1 "))
    grads, optimizer = map(float, row[4:6])
    cfg = compose_config(overrides)
    with torch.device("meta"):
        model = add_adapters(Llama(cfg.model), cfg.finetune)
    adapter_gib = sum(p.numel() for p in model.parameters() if p.requires_grad) * 4 / 2**30
    assert adapter_gib == pytest.approx(0.039, abs=0.001)  # 64 x 81,920 per layer, 2 layers
    assert grads == pytest.approx(adapter_gib, abs=0.006)
    assert optimizer == pytest.approx(2 * adapter_gib, abs=0.006)
    assert "the planner's formulas count full fine-tuning" in out
