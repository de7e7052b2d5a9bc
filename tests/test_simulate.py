"""``shardtrain plan --simulate``: one training step of rank 0 at 8 to 1,024 ranks, in one process.

The planner's per-rank parameters, gradients and optimizer state must equal the simulated sharded
sizes exactly, and its activation peak and total peak be within 10% of FSDP2's memory tracker, for
Llama-3 8B, 70B and 405B shapes at the world sizes they are trained at. Probe mode (two shallow
depths, extended by depth) is checked against simulating every layer, and the private PyTorch
behaviour the simulator depends on is pinned here.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
import torch.distributed as dist
import transformers
from simulate_workers import (
    STRATEGIES,
    checkpointing_modes,
    probe_and_full_depth,
    simulate_against_planner,
    simulate_tensor_parallel,
    small_config,
    tensor_parallel_probe_and_full_depth,
)
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

from shardtrain.cli.main import main
from shardtrain.config.loader import load_config
from shardtrain.errors import ConfigError
from shardtrain.train import simulate as sim_module
from shardtrain.train.simulate import OTHER_BLOCKS, fake_world, simulate, simulation_rows

# (model, world size, strategies, one more setting). With the default loss (chunked at Llama-3's
# 128k vocabulary), every strategy at one node and at eight; full sharding at 512 and 1,024 ranks
# (hybrid shards within a node's 8 ranks there as at 64, and SHARD_GRAD_OP differs from full
# sharding only in the units it keeps gathered, which 8 and 64 ranks check). At one point each, full
# sharding with the plain loss, with tied embeddings (one unit holds the embeddings and the head:
# its gradient is reduced at the end of backward), and resharding to groups of 2 after forward (each
# unit keeps half its parameters until its backward: counted as true, the peak was 26% low).
GRID = [("llama3_8b", 8, STRATEGIES, ""), ("llama3_8b", 64, STRATEGIES, ""),
        ("llama3_70b", 512, ("full_shard",), ""), ("llama3_405b", 1024, ("full_shard",), ""),
        ("llama3_8b", 8, ("full_shard",), "trainer.loss_chunk_tokens=0"),
        ("llama3_8b", 8, ("full_shard",), "model.tie_embeddings=true"),
        ("llama3_8b", 8, ("full_shard",), "trainer.devices=8 strategy.reshard_after_forward=2"),
        # found by review: the full gradients of unsharded accumulation counted beside the sharded
        # ones (20% high); LoRA's rank-16 A matrices padded to 1,024 rows in FSDP2's buffers (17% low);
        # LoRA dropout's outputs and masks (the activations 2.5x low without checkpointing)
        ("llama3_8b", 8, ("full_shard",), "trainer.grad_accum_steps=2 strategy.grad_accumulation=unsharded"),
        ("llama_1b", 1024, ("full_shard",), "model.max_seq_len=8192 finetune=lora finetune.dropout=0.1")]
# One task a strategy: the two workers share the grid evenly.
GRID_TASKS = [(model, world, strategy, extra) for model, world, strategies, extra in GRID
              for strategy in strategies]
TOLERANCE = 0.10


PROBE_CASES = [("full_shard", "none", 2)]
# FSDP x TP as the published recipes run them (torchtitan: 70B as FSDP 32 x TP 8 on 256 GPUs), with
# every checkpointing mode, without sequence parallelism, on a 3-D hybrid mesh and SHARD_GRAD_OP.
TP_GRID = [("llama3_70b", 256, 8, "full_shard", "none"), ("llama3_70b", 256, 8, "full_shard", "all"),
           ("llama3_70b", 256, 8, "full_shard", "selective"),
           ("llama3_70b", 256, 8, "full_shard", "all", "strategy.sequence_parallel=false"),
           ("llama3_405b", 1024, 8, "full_shard", "none"), ("llama3_405b", 1024, 8, "full_shard", "all"),
           ("llama3_8b", 64, 2, "hybrid_shard", "none"), ("llama3_8b", 64, 4, "shard_grad_op", "all")]


@pytest.fixture(scope="module")
def simulations() -> dict:
    """Every simulation of this file that takes seconds, run two at a time."""
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        # Every task submitted before any result is read: neither worker waits while work is left.
        probes = {case: pool.submit(probe_and_full_depth, *case) for case in PROBE_CASES}
        tp_probes = pool.submit(tensor_parallel_probe_and_full_depth)
        chunks = pool.map(simulate_against_planner, *zip(*GRID_TASKS))
        tp_grid = pool.map(simulate_tensor_parallel, *zip(*[c[:5] for c in TP_GRID]),
                           *zip(*[c[5:] or ("",) for c in TP_GRID]))
        return {"grid": [result for chunk in chunks for result in chunk],
                "probes": {case: future.result() for case, future in probes.items()},
                "tp_grid": list(tp_grid), "tp_probes": tp_probes.result()}


@pytest.fixture(scope="module")
def grid_results(simulations) -> list[dict]:
    return simulations["grid"]


def test_planner_matches_the_simulation_at_scale(grid_results):
    assert len(grid_results) == sum(len(checkpointing_modes(task[2])) for task in GRID_TASKS)
    for r in grid_results:
        sim_params, sim_grads, sim_optim, sim_act, sim_peak = r["simulated"]
        params, grads, optim, act, peak = r["planned"]
        assert (params, grads, optim) == (sim_params, sim_grads, sim_optim), r["case"]
        assert abs(act / sim_act - 1) < TOLERANCE, (r["case"], act, sim_act)
        assert abs(peak / sim_peak - 1) < TOLERANCE, (r["case"], peak, sim_peak)
        assert len(r["probed"]) == 2, r  # a probe pair, never a full 126-layer step


def test_simulated_numbers_follow_the_strategies(grid_results):
    by_case = {r["case"]: r["simulated"] for r in grid_results}
    full = by_case["llama3_8b x 8 full_shard AC=none"]
    zero2 = by_case["llama3_8b x 8 shard_grad_op AC=none"]
    wider = by_case["llama3_8b x 64 full_shard AC=none"]
    checkpointed = by_case["llama3_8b x 8 full_shard AC=all"]
    selective = by_case["llama3_8b x 8 full_shard AC=selective"]
    regrouped = by_case["llama3_8b x 8 full_shard AC=none trainer.devices=8 strategy.reshard_after_forward=2"]
    assert regrouped[:3] == full[:3] and regrouped[4] > full[4]  # half of each unit kept until backward
    assert zero2[:3] == full[:3] and zero2[4] > full[4]  # same shards, units stay gathered
    assert 7.5 < full[0] / wider[0] < 8.5  # 8x the ranks, 1/8 of the shard
    assert checkpointed[3] < full[3] / 3  # activation checkpointing keeps block inputs only
    # Selective checkpointing keeps attention's and every second matmul's outputs: between full
    # checkpointing and none, with the built-in Llama's lean layers too (which keep no element-wise
    # outputs for it to drop).
    print("selective / none activations", selective[3] / full[3])
    assert checkpointed[3] < selective[3] < 0.85 * full[3]
    # 8B at 8 ranks: 16 bytes per parameter over 8 ranks (fp32 params, grads, two Adam moments).
    assert abs(sum(full[:3]) - 16 * 8.03e9 / 8) / (16 * 8.03e9 / 8) < 0.01


def test_planner_matches_the_simulation_with_tensor_parallelism(simulations):
    """Per-rank states exact (each TP shard sharded again by FSDP over the data-parallel ranks),
    activations and peak within 10%, at FSDP 32 x TP 8 (70B, 256 ranks) and FSDP 128 x TP 8 (405B,
    1,024 ranks), each from a probe pair of shallow depths."""
    results = simulations["tp_grid"]
    assert len(results) == len(TP_GRID)
    for r in results:
        sim_params, sim_grads, sim_optim, sim_act, sim_peak = r["simulated"]
        params, grads, optim, act, peak = r["planned"]
        assert (params, grads, optim) == (sim_params, sim_grads, sim_optim), r["case"]
        assert abs(act / sim_act - 1) < TOLERANCE, (r["case"], act, sim_act)
        assert abs(peak / sim_peak - 1) < TOLERANCE, (r["case"], peak, sim_peak)
        assert len(r["probed"]) == 2, r  # a probe pair, never a full 80- or 126-layer step
    by_case = {r["case"]: r for r in results}
    fsdp = {r["case"]: r["simulated"] for r in simulations["grid"]}["llama3_70b x 512 full_shard AC=none"]
    tp8 = by_case["llama3_70b x 256 full_shard TP 8 AC=none"]
    assert tp8["mesh"] == (32, 8)
    # Each of 256 ranks holds about 1/256 of the weights, as under FSDP alone (the norms, replicated
    # over tp, are sharded 32 ways only)...
    assert 1 < tp8["simulated"][0] * 256 / (fsdp[0] * 512) < 1.01
    # ...but TP 8 with sequence parallelism divides the activations of a sequence by about 2.9 (not
    # 8: the norms' outputs are whole again for the matmuls, which keep them, and w2 keeps its input,
    # where FSDP alone recomputes both in backward).
    assert 2.5 < fsdp[3] / tp8["simulated"][3] < 3.5
    no_sp = by_case["llama3_70b x 256 full_shard TP 8 AC=all strategy.sequence_parallel=false"]
    assert no_sp["simulated"][3] > 3 * by_case["llama3_70b x 256 full_shard TP 8 AC=all"]["simulated"][3]


def test_tensor_parallel_probes_equal_the_full_depth(simulations):
    probed, full = simulations["tp_probes"]
    assert probed.probed_layers == (6, 7) and full.probed_layers == ()
    assert (probed.params, probed.grads, probed.optimizer) == (full.params, full.grads, full.optimizer)
    assert probed.phases == {k: v for k, v in full.phases.items() if OTHER_BLOCKS not in k}
    assert probed.peak == full.peak and probed.activations == full.activations


@pytest.mark.parametrize("case", PROBE_CASES)
def test_probes_equal_the_full_depth(simulations, case):
    probed, full = simulations["probes"][case]
    accumulate = case[2]
    assert probed.probed_layers == (6, 7) and full.probed_layers == ()
    assert (probed.params, probed.grads, probed.optimizer) == (full.params, full.grads, full.optimizer)
    assert probed.phases == {k: v for k, v in full.phases.items() if OTHER_BLOCKS not in k}
    assert probed.peak == full.peak and probed.activations == full.activations
    if accumulate > 1:
        assert "backward start (last micro-batch)" in probed.phases  # micro-batches are phases apart


def test_hybrid_with_sharded_accumulation_is_refused_with_the_way_out():
    with pytest.raises(ConfigError, match="grad_accum_steps=1"):
        simulate(small_config(12, "hybrid_shard", "none", 2), 16, 4)
    # FULL_SHARD x TP has no replicas: its mesh's first dimension is the shard one (found by a
    # trial: refused as if it were HSDP)
    cfg = small_config(2, "full_shard", "none", 2, seq_len=1024)
    cfg.strategy.tensor_parallel = 2
    result = simulate(cfg, 8, 8)
    assert "backward start (last micro-batch)" in result.phases


def test_phase_tracker_keeps_the_stock_trackers_peak():
    """Pins FSDPMemTracker's private _update_peak_stats/_curr_mem_snap/_in_opt/_mod_tracker and the
    fake backend: the phase peaks' maximum is the stock tracker's global peak."""
    cfg = small_config(6, "full_shard", "none", seq_len=1024)
    # The plain loss: the stock tracker loses track of a module whose forward never runs (the chunked
    # loss uses the head's weight directly); shardtrain's phase tracker does not depend on it.
    cfg.trainer.loss_chunk_tokens = 0
    peaks = {}

    class Stock(FSDPMemTracker):
        def __init__(self, model, optimizer, blocks):
            super().__init__(model, optimizer)
            self.peaks = {"stock": {"Total": 0}}
            self.activation_peaks = {"stock": 0}
            self.stage = None

        def __exit__(self, *args):
            super().__exit__(*args)
            peaks["stock"] = self.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    original = sim_module.PhasePeakTracker
    try:
        sim_module.PhasePeakTracker = Stock
        sim_module._simulate_depth(cfg, 8, 8, sim_module.bound_task(cfg))
    finally:
        sim_module.PhasePeakTracker = original
    ours = simulate(cfg, 8, 8, probe=False)
    assert ours.peak == peaks["stock"]
    assert {"forward start", "forward blocks[-1]", "forward end", "backward start", "backward blocks[2]",
            "backward end", "gradient norm", "optimizer"} <= ours.phases.keys()
    kinds = {k.value for k in _FSDPRefType}
    assert set(sim_module.ACTIVATION_KINDS) | set(sim_module.GATHERED_KINDS) <= kinds


def test_a_simulation_does_not_depend_on_what_ran_before_it():
    """Blocks are told apart by index, never by the order of a set of names (which changes with
    each process's string hashing), and nothing is collected during a simulated step."""
    cfg = small_config(7, "hybrid_shard", "none", seq_len=2048)
    first = simulate(cfg, 16, 4, probe=False)
    simulate(small_config(7, "full_shard", "all", seq_len=1024), 16, 4, probe=False)
    again = simulate(cfg, 16, 4, probe=False)
    assert first.phases == again.phases and first.activation_peaks == again.activation_peaks


def test_fake_world_is_a_real_process_group_of_n_ranks_and_refuses_nesting():
    with fake_world(1024):
        assert dist.get_world_size() == 1024 and dist.get_rank() == 0
        with pytest.raises(ConfigError, match="single process"), fake_world(8):
            pass
    assert not dist.is_initialized()


def test_plan_simulate_command(capsys):
    assert main(["plan", "--simulate", "model=llama3_8b", "model.n_layers=3", "trainer.seq_len=1024",
                 "trainer.micro_batch_size=1", "strategy.mixed_precision=bf16-mixed",
                 "--world-sizes", "64", "--strategies", "shard_grad_op",
                 "--ac", "all", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert out.count("SHARD_GRAD_OP") == 1 and "  yes  " in out
    assert "peak (planner)" in out and "fits" in out


def test_the_weights_average_is_counted_as_the_planner_counts_it():
    """trainer.ema_decay's fp32 average, sharded as the parameters: the simulation holds it with the
    optimizer's state at every phase, by exactly the bytes the planner adds."""
    import dataclasses

    from shardtrain.diagnostics.planner import estimate
    from shardtrain.models.registry import build_model

    cfg = small_config(3, "full_shard", "none", seq_len=1024)
    averaged = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, ema_decay=0.999))
    plain, with_average = simulate(cfg, 16, 4, probe=False), simulate(averaged, 16, 4, probe=False)
    with torch.device("meta"):
        meta = build_model(cfg.model)
    planned = (estimate(averaged, meta, "FULL_SHARD", 16, 4).optimizer
               - estimate(cfg, meta, "FULL_SHARD", 16, 4).optimizer)
    assert planned > 0 and with_average.optimizer - plain.optimizer == planned
    assert {phase: with_average.phases[phase]["Total"] - peaks["Total"]
            for phase, peaks in plain.phases.items()} == dict.fromkeys(plain.phases, planned)


def test_cpu_offload_keeps_the_sharded_states_off_the_simulated_device():
    """Found by review: the fake step runs on "cpu", where CPUOffloadPolicy moves nothing, and its
    peak counted the sharded parameters, gradients and AdamW state that an accelerator's run keeps
    in host memory (the planner, which moves them, was 0.79 of it). Each phase now holds them no
    more, and the peak drops by what the planner's drops (measured: 1,220 MiB both)."""
    import dataclasses

    from shardtrain.diagnostics.planner import estimate
    from shardtrain.models.registry import build_model
    from shardtrain.train.simulate import OFFLOADED_KINDS

    cfg = small_config(3, "full_shard", "none", seq_len=1024)
    offloaded = dataclasses.replace(cfg, strategy=dataclasses.replace(cfg.strategy, cpu_offload=True))
    plain, on_device = simulate(cfg, 16, 4, probe=False), simulate(offloaded, 16, 4, probe=False)
    for phase, kinds in plain.phases.items():
        host = sum(kinds[kind] for kind in OFFLOADED_KINDS)
        assert host > 0 and on_device.phases[phase]["Total"] == kinds["Total"] - host, phase
        assert all(on_device.phases[phase][kind] == 0 for kind in OFFLOADED_KINDS), phase
    with torch.device("meta"):
        meta = build_model(cfg.model)
    planned = [estimate(case, meta, "FULL_SHARD", 16, 4).peak for case in (cfg, offloaded)]
    dropped = planned[0] - planned[1], plain.peak - on_device.peak
    assert dropped[0] > 0 and abs(dropped[1] / dropped[0] - 1) < 0.01, dropped
    # Accumulated over a shard group of one (NO_SHARD's, or one GPU's), the full gradients stay on
    # the device between micro-batches (found by review: planned without them, 0.25-0.39x the
    # simulated peak, and micro_batch_size=auto chose batches that could not fit)
    whole = small_config(2, "no_shard", "all", accumulate=3, seq_len=1024)
    whole = dataclasses.replace(whole, strategy=dataclasses.replace(whole.strategy, cpu_offload=True))
    with torch.device("meta"):
        meta = build_model(whole.model)
    simulated, planned = simulate(whole, 4, 4, probe=False).peak, estimate(whole, meta, "NO_SHARD", 4, 4).peak
    assert abs(planned / simulated - 1) < TOLERANCE, (planned, simulated)


def test_a_mixture_of_experts_block_holds_its_experts_gradients_in_its_backward(tmp_path):
    """Found by review: a block's stacked expert weights get their whole gradient at once, in the
    compute dtype, which the planner counted as two dense feed-forward weights' (a Qwen3-MoE
    30B-A3B's shape at 64 ranks: the peak 0.88x the simulated one; measured 1.04 since)."""
    transformers.Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, vocab_size=151936, max_position_embeddings=4096).save_pretrained(tmp_path)
    cfg = load_config(["model.name=hf", f"model.path={tmp_path}", "model.tokenizer=bytes",
                       "trainer.seq_len=4096", "trainer.micro_batch_size=1",
                       "strategy.mixed_precision=bf16-mixed"])
    [(simulated, planned)] = simulation_rows(cfg, [64], ["FULL_SHARD"], ["all"], 8)
    assert abs(planned.peak / simulated.peak - 1) < TOLERANCE, (planned.peak, simulated.peak)
