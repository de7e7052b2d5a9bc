"""trainer.micro_batch_size=auto and trainer.global_batch_size.

The planner's choice is recomputed here from the planner's own estimates (every activation
checkpointing mode from the cheapest, every micro-batch dividing a rank's share of the global
batch, the largest that fits first), and a real 2-rank run under a memory limit this test sets
chooses what the planner says and stays below that limit.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from batch_size_workers import GLOBAL_BATCH, auto_batch_run, planned_peak
from distributed import run_on_ranks
from hf_models import make_model_dir

from shardtrain.cli.main import main
from shardtrain.config.loader import load_config
from shardtrain.config.plan import accumulation_steps
from shardtrain.config.strategy import AC_MODES
from shardtrain.diagnostics import kept
from shardtrain.diagnostics.planner import (
    NothingFits,
    auto_batch_table,
    choose_batch,
    estimate,
    planned_model,
)
from shardtrain.distributed.env import DistEnv
from shardtrain.errors import ConfigError
from shardtrain.models.registry import build_model
from shardtrain.train.batch_size import resolve_batch
from shardtrain.train.grad import global_grad_norm
from shardtrain.train.optim import step_unless
from shardtrain.train.step import failing_part

GIB = 2**30
WORLD = 64  # Llama-3 8B on 64 ranks of 8 per node, 8 sequences of 4,096 tokens per rank and step


def expected_choice(cfg, model, world: int, budget: int) -> tuple[int, str]:
    """The cheapest checkpointing under which some micro-batch fits, and the largest such batch
    (the ranks of a tensor-parallel group share one data-parallel rank's share)."""
    per_rank = cfg.trainer.global_batch_size // (world // cfg.strategy.tensor_parallel)
    for ac in AC_MODES:
        for micro in sorted((n for n in range(1, per_rank + 1) if per_rank % n == 0), reverse=True):
            trial = replace(cfg, trainer=replace(cfg.trainer, micro_batch_size=micro,
                                                 grad_accum_steps=per_rank // micro),
                            strategy=replace(cfg.strategy, activation_checkpointing=ac))
            if estimate(trial, model, "FULL_SHARD", world, 8).peak <= budget:
                return micro, ac
    raise AssertionError("nothing fits")


def llama_8b_config(*overrides: str):
    cfg = load_config(["model=llama3_8b", "trainer.seq_len=4096", "trainer.micro_batch_size=auto",
                       f"trainer.global_batch_size={8 * WORLD}", "strategy.mixed_precision=bf16-mixed",
                       *overrides])
    with torch.device("meta"):
        return cfg, build_model(cfg.model)


@pytest.fixture(scope="module")
def llama_8b():
    return llama_8b_config()


@pytest.fixture(scope="module")
def llama_8b_plain_layers():
    """Plain autograd's norms and SwiGLU, as a Hugging Face model has them: they keep element-wise
    tensors that every checkpointing mode drops, so no checkpointing keeps far more than with the
    lean layers, and selective less than every_k."""
    return llama_8b_config("model.lean_layers=false")


# Limits (GiB) and what the planner chose at each when this test was written (with the built-in
# Llama's lean layers, w2's input and the norms' outputs recomputed, and selective keeping attention
# and every second matmul): several sizes, and every kind of checkpointing. At 12 GiB full
# checkpointing with the chunked loss (auto: Llama-3's 128k vocabulary) leaves room for 2.
@pytest.mark.parametrize(("plain_layers", "limit_gib", "written"),
                         [(False, 80, (4, "none")), (False, 40, (2, "none")), (False, 16, (1, "selective")),
                          (False, 14, (1, "every_k")), (False, 12, (2, "all")),
                          (True, 21.3, (1, "selective"))])
def test_auto_chooses_what_the_planner_says_fits(llama_8b, llama_8b_plain_layers, plain_layers, limit_gib,
                                                 written):
    cfg, model = llama_8b_plain_layers if plain_layers else llama_8b
    choice = choose_batch(cfg, model, WORLD, 8, limit_gib * GIB, held=0, accelerated=True)
    chosen = (choice.micro_batch_size, choice.activation_checkpointing)
    assert chosen == expected_choice(cfg, model, WORLD, choice.budget) == written
    assert choice.budget == int(limit_gib * GIB * 0.9) and choice.estimate.peak <= choice.budget
    assert choice.micro_batch_size * choice.grad_accum_steps * WORLD == 8 * WORLD
    assert "trainer.micro_batch_size=auto" in choice.describe(WORLD, 0.1)


def one_sequence_peaks(cfg, model) -> dict[str, int]:
    one = replace(cfg, trainer=replace(cfg.trainer, micro_batch_size=1, grad_accum_steps=8))
    return {ac: estimate(replace(one, strategy=replace(one.strategy, activation_checkpointing=ac)),
                         model, "FULL_SHARD", WORLD, 8).peak for ac in AC_MODES}


def test_auto_checkpoints_only_when_no_batch_fits_without(llama_8b, llama_8b_plain_layers):
    # (auto tries modes by their time cost, selective before every second block in full, so every_k
    # is chosen only where it fits and selective does not.)
    # Plain layers keep element-wise tensors that every mode drops: selective keeps less than
    # every_k there. The lean layers keep none of them: selective keeps more than every_k, less
    # than none.
    peaks_of = {}
    orders = {"plain": ("all", "selective", "every_k", "none"),
              "lean": ("all", "every_k", "selective", "none")}
    for layers, (cfg, model) in (("plain", llama_8b_plain_layers), ("lean", llama_8b)):
        order = orders[layers]
        peaks = peaks_of[layers] = one_sequence_peaks(cfg, model)
        assert [peaks[mode] for mode in order] == sorted(peaks.values()), peaks
        # Just below what one sequence needs without checkpointing: selective, at the largest size.
        choice = choose_batch(cfg, model, WORLD, 8, int((peaks["none"] - 1) / 0.9), held=0, accelerated=True)
        assert choice.activation_checkpointing == "selective"
        assert choice.micro_batch_size == expected_choice(cfg, model, WORLD, choice.budget)[0]
    cfg, model = llama_8b
    # An explicit mode is the cheapest it may choose.
    explicit = replace(cfg, strategy=replace(cfg.strategy, activation_checkpointing="all"))
    assert choose_batch(explicit, model, WORLD, 8, 80 * GIB, 0, True).activation_checkpointing == "all"
    with pytest.raises(ConfigError, match=r"nothing fits: one sequence .* raise trainer.memory_limit_gib"):
        choose_batch(cfg, model, WORLD, 8, int(peaks_of["lean"]["all"] * 0.9), held=0, accelerated=True)
    # A process that already holds more than the limit allows: said so, not a negative budget.
    held_too_much = (r"nothing fits: the process already holds 3\.0 GiB at start, which leaves nothing "
                     r"of the limit 2\.0 GiB less 10% margin \(1\.8 GiB\)")
    with pytest.raises(ConfigError, match=held_too_much):
        choose_batch(cfg, model, WORLD, 8, 2 * GIB, held=3 * GIB, accelerated=True)


def test_auto_passes_over_selective_checkpointing_the_build_refuses():
    """A LoRA rank equal to a projection's width (the kv projections' 32 here) cannot run under
    selective checkpointing: found by review, auto chose it, and the build refused it after launch."""
    cfg = load_config(["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                       "model.ffn_hidden_dim=128", "model.vocab_size=256", "trainer.seq_len=1024",
                       "finetune=lora", "finetune.rank=32", "trainer.micro_batch_size=auto",
                       "trainer.global_batch_size=4"])
    model = planned_model(cfg)
    one = replace(cfg, trainer=replace(cfg.trainer, micro_batch_size=1, grad_accum_steps=4))
    peaks = {ac: estimate(replace(one, strategy=replace(one.strategy, activation_checkpointing=ac)),
                          model, "FULL_SHARD", 1, 1).peak for ac in AC_MODES}
    assert peaks["selective"] < peaks["none"]  # where it fits and none does not, it would be chosen
    budget = int((peaks["none"] - 1) / 0.9)
    assert choose_batch(cfg, model, 1, 1, budget, held=0, accelerated=True).activation_checkpointing in (
        "every_k", "all")
    asked = replace(cfg, strategy=replace(cfg.strategy, activation_checkpointing="selective"))
    with pytest.raises(ConfigError, match="finetune.rank=32 is also a width of this block's projections"):
        choose_batch(asked, model, 1, 1, budget, held=0, accelerated=True)


def test_auto_under_tensor_parallelism_divides_the_batch_over_data_parallel_ranks(llama_8b):
    """FSDP 8 x TP 8 on the 64 ranks: 8 data-parallel ranks, each (a tp group of 8) training on an
    eighth of the global batch, planned with the tp-split weights and activations."""
    cfg, model = llama_8b
    tp = replace(cfg, trainer=replace(cfg.trainer, global_batch_size=64),
                 strategy=replace(cfg.strategy, tensor_parallel=8))
    choice = choose_batch(tp, model, WORLD, 8, 30 * GIB, held=0, accelerated=True)
    assert choice.estimate.mesh == (8, 8)
    assert choice.micro_batch_size * choice.grad_accum_steps * (WORLD // 8) == 64
    chosen = (choice.micro_batch_size, choice.activation_checkpointing)
    # At 30 GiB FSDP alone fits one sequence (above); TP 8 splits the activations: 4 sequences
    # (8 do not fit).
    assert chosen == expected_choice(tp, model, WORLD, choice.budget) == (4, "none")
    assert choice.rejected[0][:2] == (8, "none")
    with pytest.raises(ConfigError, match="global_batch_size=60 does not divide over 8 data-parallel ranks"):
        choose_batch(replace(tp, trainer=replace(tp.trainer, global_batch_size=60)), model, WORLD, 8,
                     30 * GIB, held=0, accelerated=True)


def test_global_batch_under_tensor_parallelism_counts_data_parallel_ranks():
    """4 ranks as FSDP 2 x TP 2 are 2 data-parallel ranks: 8 sequences of 2 per micro-batch are 2
    micro-batches (4 on 4 plain FSDP ranks would have been 1)."""
    cfg = load_config(["trainer.micro_batch_size=2", "trainer.global_batch_size=8"])
    cfg.strategy = replace(cfg.strategy, tensor_parallel=2)
    env = DistEnv(rank=0, world_size=4, local_world_size=4, local_rank=0, device=torch.device("cpu"),
                  backend="gloo")
    assert resolve_batch(cfg, env) is None and cfg.trainer.grad_accum_steps == 2


def test_global_batch_must_divide_over_ranks_and_micro_batches():
    assert accumulation_steps(64, 4, 2) == 8
    with pytest.raises(ConfigError, match="not a multiple of trainer.micro_batch_size=3 x 2 ranks"):
        accumulation_steps(64, 3, 2)
    with pytest.raises(ConfigError, match="needs trainer.global_batch_size"):
        load_config(["trainer.micro_batch_size=auto"])
    with pytest.raises(ConfigError, match="chosen only when training starts"):
        cfg = load_config(["trainer.micro_batch_size=auto", "trainer.global_batch_size=8"])
        with torch.device("meta"):
            estimate(cfg, build_model(cfg.model), "FULL_SHARD", 1, 1)
    # A config built without load_config, and accumulation steps auto would contradict: one line each.
    env = DistEnv(rank=0, world_size=2, local_world_size=2, local_rank=0, device=torch.device("cpu"),
                  backend="gloo")
    auto = load_config(["trainer.micro_batch_size=auto", "trainer.global_batch_size=8"])
    with pytest.raises(ConfigError, match="needs trainer.global_batch_size"):
        resolve_batch(replace(auto, trainer=replace(auto.trainer, global_batch_size=0)), env)
    with pytest.raises(ConfigError, match="grad_accum_steps=3 contradicts trainer.micro_batch_size=auto"):
        resolve_batch(replace(auto, trainer=replace(auto.trainer, grad_accum_steps=3)), env)
    # plan says so once, not on every row with exit status 0 (found by review)
    with pytest.raises(ConfigError, match="grad_accum_steps=3 contradicts trainer.micro_batch_size=auto"):
        auto_batch_table(replace(auto, trainer=replace(auto.trainer, grad_accum_steps=3)), [8], 80 * GIB, 8)


def test_the_planner_takes_accumulation_from_the_global_batch(llama_8b):
    """``shardtrain plan`` and the planner with a fixed micro-batch and trainer.global_batch_size: the
    accumulation steps the run will take at each world size (8 of 1 sequence at 8 ranks for 64), so
    unsharded accumulation's held gradients are counted (they were planned as 1 step)."""
    cfg, model = llama_8b
    for accumulation in ("sharded", "unsharded"):
        base = replace(cfg, trainer=replace(cfg.trainer, micro_batch_size=1),
                       strategy=replace(cfg.strategy, grad_accumulation=accumulation))
        by_global = replace(base, trainer=replace(base.trainer, global_batch_size=64))
        by_steps = replace(base, trainer=replace(base.trainer, global_batch_size=0, grad_accum_steps=8))
        one_step = replace(by_steps, trainer=replace(by_steps.trainer, grad_accum_steps=1))
        planned = [estimate(c, model, "FULL_SHARD", 8, 8) for c in (by_global, by_steps, one_step)]
        assert planned[0] == planned[1], accumulation
        if accumulation == "unsharded":  # every rank holds the whole gradient between micro-batches
            assert planned[0].peak > planned[2].peak + 25 * GIB
    # Steps the global batch contradicts are refused, as the run refuses them.
    contradicting = replace(cfg, trainer=replace(cfg.trainer, micro_batch_size=1, global_batch_size=64,
                                                 grad_accum_steps=3))
    with pytest.raises(ConfigError, match="grad_accum_steps=3 contradicts trainer.global_batch_size=64"):
        estimate(contradicting, model, "FULL_SHARD", 8, 8)


def test_auto_run_chooses_the_planners_size_and_fits(tmp_path):
    run_on_ranks(auto_batch_run, 2, str(tmp_path), tmp_path=tmp_path)
    r = json.loads((tmp_path / "auto.json").read_text())
    base = load_config(["model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                        "model.max_seq_len=1024", "trainer.seq_len=1024"])
    base = replace(base, trainer=replace(base.trainer, global_batch_size=GLOBAL_BATCH))
    # The planner, asked here for every size at the budget the run had: the largest that fits.
    fitting = [m for m in (16, 8, 4, 2, 1) if planned_peak(base, 2, m) <= r["budget"]]
    assert (r["micro"], r["ac"]) == (fitting[0], "none")
    assert r["micro"] == 4  # the limit was set between the planner's 4 and 8
    assert r["micro"] * r["accum"] * 2 == GLOBAL_BATCH == r["global_batch"] and r["config_micro"] == 4
    # The choice is the trainer's copy's: the config the caller passed still says auto (it can start
    # another run, at another world size, which chooses afresh).
    assert (r["caller_micro"], r["caller_ac"]) == ("auto", "none")
    assert r["peak_bytes"] < r["limit"], (r["peak_bytes"] / GIB, r["limit"] / GIB)  # the run fits
    assert len(r["losses"]) == 2
    report = next(line for line in r["log"] if line.startswith("trainer.micro_batch_size=auto"))
    assert "4 per micro-batch x 4 micro-batches x 2 data-parallel ranks = 32 sequences" in report
    oom = r["out_of_memory"]
    assert oom.startswith("step 3 ran out of cpu memory in forward (rank 0): trainer.micro_batch_size=auto "
                          "chose 4 ")
    assert f"planned peak of {r['planned'] / GIB:.2f} GiB" in oom and "parameters and optimizer state" in oom
    assert "the activation and communication-buffer estimate" in oom and "was wrong" in oom
    # The CPU allocator's refusal (a RuntimeError, not torch's OutOfMemoryError) says the same, with
    # the process's peak resident memory where a CPU has no allocator peak
    refusal = r["cpu_refusal"]
    assert refusal.startswith("step 3 ran out of cpu memory in forward (rank 0): "
                              "trainer.micro_batch_size=auto ")
    resident = re.search(r"the peak resident memory before the failure (\d+\.\d\d) GiB", refusal)
    assert resident and float(resident[1]) > 0, refusal
    assert "activation_checkpointing=none" in report and "8 with none" in report.split("over it:")[1]


def test_plan_shows_what_auto_would_choose_at_each_world_size(llama_8b, capsys):
    """``shardtrain plan`` with micro_batch_size=auto: each row is the trainer's choice at that world
    size and strategy against --device-memory (nothing held at start, as on an accelerator)."""
    cfg, model = llama_8b
    overrides = ["plan", "model=llama3_8b", "trainer.seq_len=4096", "trainer.micro_batch_size=auto",
                 f"trainer.global_batch_size={8 * WORLD}", "strategy.mixed_precision=bf16-mixed",
                 "--world-sizes", "8", str(WORLD), "--processes-per-node", "8"]
    assert main([*overrides, "--device-memory", "30GiB"]) == 0
    rows = {tuple(line.split()[:3]): line.split()[3:] for line in capsys.readouterr().out.splitlines()[2:]}
    for world in (8, WORLD):
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"):
            trial = replace(cfg, strategy=replace(cfg.strategy, sharding_strategy=strategy))
            row = rows[(str(world), "x", strategy)]
            try:
                choice = choose_batch(trial, model, world, 8, 30 * GIB, held=0, accelerated=True)
            except NothingFits as exc:
                assert row[:2] == ["nothing", "fits"] and row[-1] == f"{exc.smallest_peak / GIB:.2f})"
                continue
            assert row == [str(choice.micro_batch_size), "x", str(choice.grad_accum_steps),
                           choice.activation_checkpointing, f"{choice.estimate.peak / GIB:.2f}"], strategy
    assert rows[(str(WORLD), "x", "FULL_SHARD")][:4] == ["1", "x", "8", "none"]  # as the test above chose
    assert rows[("8", "x", "NO_SHARD")][:2] == ["nothing", "fits"]
    # Under tensor parallelism a world too small for a tp group is a row, not a crash.
    assert main([*overrides[:-5], "strategy.tensor_parallel=8", "--world-sizes", "1", str(WORLD),
                 "--processes-per-node", "8", "--device-memory", "30GiB"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 8 (sequence parallel on), FSDP over the other ranks" in out.splitlines()[0]
    assert "   1 x FULL_SHARD          not possible: tensor-parallel groups of 8 need a multiple of 8" in out
    assert f"  {WORLD} x FULL_SHARD            4 x 16   none" in out  # FSDP 8 x TP 8 fits 4, as above
    assert main(overrides) == 2
    assert "needs the memory it plans against: add --device-memory 80GB" in capsys.readouterr().err
    assert main([*overrides, "--simulate"]) == 2
    assert "plan --simulate runs one micro-batch size" in capsys.readouterr().err


def test_cpu_offload_leaves_the_states_off_the_device(llama_8b):
    """strategy.cpu_offload: FSDP2 keeps the sharded parameters, gradients and AdamW's state in host
    memory, so the planner counts them there, not in the device's peak, and auto can afford more
    (at 24 GiB a rank Llama-3 8B recomputed every block without offload)."""
    cfg, model = llama_8b
    fixed = replace(cfg, trainer=replace(cfg.trainer, micro_batch_size=1))
    plain = estimate(fixed, model, "FULL_SHARD", 8, 8)
    offloaded = estimate(replace(fixed, strategy=replace(fixed.strategy, cpu_offload=True)), model,
                         "FULL_SHARD", 8, 8)
    assert (offloaded.params, offloaded.grads, offloaded.optimizer) == (0, 0, 0) and plain.host == 0
    assert offloaded.host == plain.params + plain.grads + plain.optimizer
    assert offloaded.activations == plain.activations
    assert offloaded.peak <= plain.peak - plain.params - plain.optimizer
    # Planned for CPUs, the device is the host: the states stay in the peak.
    on_cpu = [estimate(replace(fixed, strategy=replace(fixed.strategy, cpu_offload=offload)), model,
                       "FULL_SHARD", 8, 8, accelerated=False) for offload in (False, True)]
    assert on_cpu[0] == on_cpu[1] and on_cpu[1].host == 0
    without = choose_batch(cfg, model, 8, 8, 24 * GIB, held=0, accelerated=True)
    with_offload = choose_batch(replace(cfg, strategy=replace(cfg.strategy, cpu_offload=True)), model, 8, 8,
                                24 * GIB, held=0, accelerated=True)
    assert (without.micro_batch_size, without.activation_checkpointing) == (1, "all")
    assert (with_offload.micro_batch_size, with_offload.activation_checkpointing) == (1, "none")


def test_out_of_memory_names_the_part_of_the_step_that_failed():
    """The out-of-memory message judges the planner by where the step failed: AdamW makes its state
    in the first optimizer step, so a failure there says so rather than blaming activations; one in
    the gradient norm is not called a forward's."""
    def out_of_memory(*_):
        raise torch.OutOfMemoryError("CUDA out of memory")

    class FailsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            out_of_memory()

    class FailsInForward(torch.autograd.Function):  # forward runs through torch.autograd too
        @staticmethod
        def forward(ctx, x):
            out_of_memory()

    class GradRaises:  # a parameter whose gradient's read fails, inside the global norm
        @property
        def grad(self):
            out_of_memory()

    x = torch.ones(3, requires_grad=True)
    optimizer = torch.optim.AdamW([x], fused=True)
    optimizer.register_step_pre_hook(out_of_memory)
    x.grad = torch.ones(3)
    for run, part in ((lambda: FailsInBackward.apply(x).sum().backward(), "backward"),
                      (lambda: FailsInForward.apply(x), "forward"),
                      (lambda: global_grad_norm([GradRaises()], None), "the gradient norm and clipping"),
                      (lambda: step_unless(optimizer, torch.tensor(False)), "the optimizer step")):
        with pytest.raises(torch.OutOfMemoryError) as failure:
            run()
        assert failing_part(failure.value) == part


def test_auto_refuses_to_plan_from_blocks_it_could_not_measure(tmp_path, monkeypatch):
    """Found by review: where a Hugging Face family's blocks could not run on fake tensors, auto chose a
    micro-batch from the Llama formula (a warning said it "may be under" what they keep), and the run
    could run out of memory mid-way."""
    directory = make_model_dir(tmp_path / "model", "llama")

    def cannot_measure(*args, **kwargs):
        raise NotImplementedError("aten::foo has no fake implementation")

    monkeypatch.setattr(kept, "measure", cannot_measure)
    monkeypatch.setattr(kept, "_measured", {})
    monkeypatch.setattr(kept, "_unmeasured", {})
    cfg = load_config(["model=hf", f"model.path={directory}", "trainer.micro_batch_size=auto",
                       "trainer.global_batch_size=8", "trainer.memory_limit_gib=8", "trainer.seq_len=32"])
    env = DistEnv(rank=0, world_size=1, local_world_size=1, local_rank=0, device=torch.device("cpu"),
                  backend="gloo")
    with pytest.raises(ConfigError, match=r"^trainer.micro_batch_size=auto: the memory planner could not "
                                          r"measure the blocks of .*model \(NotImplementedError: aten::foo "
                                          r"has no fake implementation\), .*set trainer.micro_batch_size=N"):
        resolve_batch(cfg, env)
    # ... and plan's table of what auto would choose says so, not the choices (found by review)
    with pytest.raises(ConfigError, match=r"^trainer.micro_batch_size=auto: the memory planner could not "):
        auto_batch_table(cfg, [1, 8], None, 1)
