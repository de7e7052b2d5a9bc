"""The diagnostics report: what FSDP2 was asked to do, what it did, and what each rank holds.

Printed by rank 0 at start-up (settings and the sharded module tree) and after the first step
(dtypes seen in a real forward and backward, every rank's local state, per-phase memory).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardtrain.config.plan import ShardingPlan, dtype_name
from shardtrain.config.schema import Config
from shardtrain.config.sizes import counted
from shardtrain.distributed.embedding_exchange import ExchangedEmbedding
from shardtrain.distributed.env import DistEnv
from shardtrain.distributed.parallelize import ShardingReport


def settings_lines(cfg: Config, plan: ShardingPlan, report: ShardingReport, env: DistEnv) -> list[str]:
    heads = set(report.units[-2:-1]) if len(report.units) > 1 else set()
    upcast = ", ".join(f"{count:,} elements in {dtype}" for dtype, count in report.upcast.items())
    lines = [
        "diagnostics: resolved settings",
        f"  strategy {plan.strategy}; mesh [{plan.mesh}] on {env.device.type}; backend {env.backend}; "
        f"world {env.world_size} ({env.local_world_size} per node)",
        f"  mixed precision {plan.precision}: storage {dtype_name(plan.storage_dtype)}, "
        f"compute {dtype_name(plan.param_dtype)}, gradient reduce {dtype_name(plan.reduce_dtype)}; "
        f"cpu_offload {plan.cpu_offload}",
        *([f"  trainable parameters the model built in another dtype ({upcast}) are stored in "
           f"{dtype_name(plan.storage_dtype)}, as the precision says"] if report.upcast else []),
        f"  reshard_after_forward {plan.reshard_after_forward} for blocks"
        + ("; False for the last block" if plan.reshard_after_forward is True and report.units[:-1] else "")
        + (f"; False for the head unit {sorted(heads)[0]}" if heads and "+" in sorted(heads)[0] else ""),
        f"  gradient accumulation {plan.grad_accumulation} "
        f"({counted(cfg.trainer.grad_accum_steps, 'micro-batch')} per step)",
        f"  activation checkpointing {plan.activation_checkpointing}; wrap policy "
        + ("" if report.wrap_source == "strategy.wrap_policy" else f"({report.wrap_source}) ")
        + f"{report.wrap_policy} -> {', '.join(report.wrap_classes) or 'none'}; seed {cfg.trainer.seed}",
        *([f"  {counted(len(report.fp32_norms), 'norm layer')} with running statistics kept in fp32, each "
           f"a unit of its own ({', '.join(report.fp32_norms[:3])}{', ...' * (len(report.fp32_norms) > 3)})"]
          if report.fp32_norms else []),
        f"  timeouts: {cfg.dist.startup_timeout_s}s for start-up and the first step, then "
        f"{cfg.dist.timeout_s}s; TORCH_DISTRIBUTED_DEBUG={cfg.dist.debug}",
        f"diagnostics: {len(report.units) - 1} FSDP units + root, "
        f"{len(report.checkpointed)} activation-checkpointed",
    ]
    for name in report.units:
        mark = " (activation checkpointing)" if name in report.checkpointed else ""
        lines.append(f"  {name:40s} {report.unit_params.get(name, 0):>12,d} params{mark}")
    for name in report.exchanged_embeddings:
        lines.append(f"  {name:40s} {report.unit_params.get(name, 0):>12,d} params (not a unit: rows "
                     "exchanged all-to-all, the table never gathered)")
    if report.tensor_parallel:
        sp = "on" if plan.sequence_parallel else "off"
        lines.append(f"diagnostics: tensor parallel over tp={plan.tensor_parallel} (sequence parallel {sp}), "
                     f"FSDP over {' x '.join(f'{n}={plan.size(n)}' for n in plan.data_parallel_dims)}; "
                     "each parameter over tp:")
        lines += [f"  {name:40s} {layout}" for name, layout in report.tensor_parallel.items()]
    return lines


class DtypeProbe:
    """Records the dtypes parameters and activations really have inside forward."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: dict[str, set[str]] = {"parameters in forward": set(), "activations in": set()}
        self.sharded_in_forward: list[str] = []
        self.handles = []
        for name, module in model.named_modules():
            # An exchanged embedding keeps its sharded table by design (it casts the rows it reads).
            if isinstance(module, ExchangedEmbedding):
                continue
            if any(True for _ in module.parameters(recurse=False)):
                self.handles.append(module.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(module, args):
            for p in module.parameters(recurse=False):
                self.seen["parameters in forward"].add(dtype_name(p.dtype))
                # Gathered by FSDP, a tensor-parallel parameter is still a DTensor, on the tp mesh.
                if isinstance(p, DTensor) and set(p.device_mesh.mesh_dim_names or ("",)) - {"tp"}:
                    self.sharded_in_forward.append(name)
            for a in args:
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    self.seen["activations in"].add(dtype_name(a.dtype))
        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def dtype_lines(probe: DtypeProbe, grad_dtypes: set[str], plan: ShardingPlan) -> list[str]:
    lines = ["diagnostics: dtypes in effect (measured in the first step)"]
    for key, values in probe.seen.items():
        lines.append(f"  {key}: {', '.join(sorted(values)) or '-'}")
    lines.append(f"  sharded gradients after reduce-scatter: {', '.join(sorted(grad_dtypes)) or '-'}")
    lines.append(f"  gradient reduce dtype (policy given to FSDP2): {dtype_name(plan.reduce_dtype)}")
    expected = dtype_name(plan.param_dtype)
    if probe.seen["parameters in forward"] - {expected}:
        lines.append(f"  WARNING: parameters were not {expected} in forward: the mixed-precision "
                     "policy did not apply to every module")
    if probe.sharded_in_forward:
        lines.append(f"  WARNING: sharded (not gathered) parameters used in forward by "
                     f"{probe.sharded_in_forward[:3]}: those modules bypassed FSDP's hooks")
    return lines


def gather_rank_entries(entry: dict) -> list[dict] | None:
    """Every rank's entry on rank 0, None on the others: rank 0 alone reports them (an all-gather
    handed each of 1,024 ranks all 1,024 entries)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [entry]
    entries: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(entry, entries, dst=0)
    return entries


# Up to this many ranks the per-rank table shows each; beyond, the notable ones (notable_ranks).
SHOWN_RANKS = 16


def notable_ranks(entries: list[dict], phases: list[str]) -> list[dict]:
    """The first four ranks, and those with the most and the least local parameters and the most
    memory at each phase's end, in rank order: what a table of 1,024 lines would hide."""
    picked = {e["rank"]: e for e in entries[:4]}
    measures = [lambda e: e["params_mib"]] + [lambda e, phase=phase: e["phases"][phase]["rss_mib"]
                                              for phase in phases]
    for measure in measures:
        top = max(entries, key=measure)
        picked[top["rank"]] = top
    least = min(entries, key=lambda e: e["params_mib"])
    picked[least["rank"]] = least
    return [picked[rank] for rank in sorted(picked)]


def rank_lines(entries: list[dict], phases: list[str], step: int = 1) -> list[str]:
    """The per-rank table after the first step measured (``step``: the run's step number there, past
    1 in a resumed run)."""
    lines = [f"diagnostics: per-rank local state after step {step} (MiB) and memory by phase",
             "  rank | params |  grads | optimizer | " + " | ".join(f"{p} RSS" for p in phases)]
    shown = entries if len(entries) <= SHOWN_RANKS else notable_ranks(entries, phases)
    for e in shown:
        rss = " | ".join(f"{e['phases'][p]['rss_mib']:>{len(p) + 4}.0f}" for p in phases)
        lines.append(f"  {e['rank']:>4} | {e['params_mib']:6.2f} | {e['grads_mib']:6.2f} | "
                     f"{e['optimizer_mib']:9.2f} | {rss}")
    if len(shown) < len(entries):
        lines.append(f"  ({len(shown)} of {len(entries)} ranks: the first four and the extremes; every "
                     "rank's in metrics.jsonl, kind memory_ranks)")
    params = [e["params_mib"] for e in entries]
    if max(params) > 0:
        lines.append(f"  shard unevenness: largest/smallest local parameters = "
                     f"{max(params) / max(min(params), 1e-9):.3f}")
    return lines
