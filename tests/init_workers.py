"""Runs inside spawned ranks for tests/test_init.py."""

from __future__ import annotations

import dataclasses
import resource
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from shardtrain.checkpoint import weights as checkpoint_weights
from shardtrain.checkpoint.weights import load_hf_model_into, load_safetensors_into
from shardtrain.config.plan import resolve_plan
from shardtrain.config.schema import Config
from shardtrain.diagnostics.memory import rss_bytes
from shardtrain.distributed import sharded_model
from shardtrain.distributed.embedding_exchange import exchange_embedding_rows
from shardtrain.distributed.env import build_mesh, init_distributed
from shardtrain.distributed.parallelize import parallelize
from shardtrain.distributed.running_stats import average_running_statistics
from shardtrain.generation.generate import gathered_copy, generate
from shardtrain.models import llama
from shardtrain.models.registry import model_factory

SMALL_CHUNK = 500  # elements: chunk boundaries fall inside every shard of the tiny model


def tiny_config(strategy: str, shard_group: int = 0) -> Config:
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, dim=36, n_layers=2, n_heads=6, n_kv_heads=2,
                                    ffn_hidden_dim=97, max_seq_len=64)
    cfg.strategy = dataclasses.replace(cfg.strategy, sharding_strategy=strategy,
                                       shard_group_size=shard_group)
    return cfg


def build(cfg: Config):
    env = init_distributed()
    plan = resolve_plan(cfg.strategy, env.world_size, env.local_world_size)
    model, _ = sharded_model.build_sharded_model(cfg, env, plan, build_mesh(plan, "cpu"),
                                                 model_factory(cfg.model))
    return env, model


def initial_weights(out: str, cases: list[tuple[str, int, bool]], few_rows: bool = False) -> None:
    """Every case of this world size in one spawned group: each (strategy, shard group, resume)
    built, its weights saved (with ``resume``, then ``resume_draws``); with ``few_rows``, first the
    checks of ``few_rows_and_row_exchange``, at the default chunk size."""
    if few_rows:  # before the small chunks below, for the rest of this process
        few_rows_and_row_exchange(out)
    sharded_model.INIT_CHUNK_ELEMENTS = SMALL_CHUNK
    for strategy, shard_group, resume in cases:
        env, model = build(tiny_config(strategy, shard_group))
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in model.named_parameters()}
        if env.rank == 0:
            torch.save(full, Path(out, f"init-{env.world_size}-{strategy}.pt"))
        if resume:
            resume_draws(out, strategy)


class CountingLlama(llama.Llama):
    """The built-in Llama, counting the calls of its initialiser."""

    draws = 0

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        CountingLlama.draws += 1
        super().init_parameter(name, tensor, generator)


def resume_draws(out: str, strategy: str) -> None:
    """A fresh run through the trainer (the draw deferred past the build), one step and a save;
    then a run resuming it: the draws each made and the weights each holds."""
    from equivalence import small_corpus  # the trainer's imports only in the rank that needs them

    from shardtrain.tasks.language_model import LanguageModelTask
    from shardtrain.train.loop import Trainer

    cfg = tiny_config(strategy)
    cfg.trainer = dataclasses.replace(cfg.trainer, max_steps=2, micro_batch_size=2, seq_len=32,
                                      eval_every=0, sample_tokens=0, progress_bar=False)
    cfg.run = dataclasses.replace(cfg.run, dir=str(Path(out, "resume")), trackers=[])
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, enabled=True, interval=0)
    cfg.diagnostics = dataclasses.replace(cfg.diagnostics, enabled=False)
    corpus = small_corpus()

    def new_trainer() -> Trainer:
        CountingLlama.draws = 0
        return Trainer.create(cfg, task=LanguageModelTask(model=lambda: CountingLlama(cfg.model),
                                                          corpus=corpus))

    fresh = new_trainer()
    record = {"fresh_draws": CountingLlama.draws, "initial": fresh.full_weights()}
    fresh.run_step()
    fresh.save_checkpoint(blocking=True)
    record["saved"] = fresh.full_weights()
    resumed = new_trainer()
    record.update(resumed_draws=CountingLlama.draws, step=resumed.step, resumed=resumed.full_weights())
    if resumed.env.is_main:
        torch.save(record, Path(out, "resume.pt"))


def init_memory(out: str) -> None:
    """Peak resident growth while building and initialising a ~300M-parameter model whose
    embedding and head are large (65,536 x 1,024 each): one full tensor is ~9% of the model."""
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, vocab_size=65536, dim=1024, n_layers=13, n_heads=16,
                                    n_kv_heads=16, max_seq_len=128)
    # From what is resident now, not from the peak so far (ru_maxrss): memory the imports touched
    # and gave back would otherwise hide part of the growth.
    before = rss_bytes() // 1024
    env, model = build(cfg)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    params = sum(p.numel() for p in model.parameters())
    Path(out, f"mem-{env.world_size}-{env.rank}.txt").write_text(f"{grown} {params}")


def sampling_memory(out: str) -> None:
    """Peak resident growth of one sampling step (gather + generate) with bf16-mixed, ~100M params."""
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, dim=1024, n_layers=8, n_heads=16, n_kv_heads=16,
                                    max_seq_len=64)
    cfg.strategy = dataclasses.replace(cfg.strategy, mixed_precision="bf16-mixed")
    env, model = build(cfg)
    before = rss_bytes() // 1024  # now, not the peak of building (chunk buffers), in ru_maxrss's KiB
    plain = gathered_copy(model, model_factory(cfg.model), env.device, torch.bfloat16)
    tokens = generate(plain, list(b"def "), 8, device=env.device)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    dtypes = {str(p.dtype) for p in plain.parameters()}
    params = sum(p.numel() for p in model.parameters())
    Path(out, "sampling.txt").write_text(f"{grown} {params} {len(tokens)} {','.join(sorted(dtypes))}")
    tables, rotated = rotary_dtypes(model, torch.tensor([list(b"def main")]))
    Path(out, "rope.txt").write_text(f"{','.join(sorted(tables))} {','.join(sorted(rotated))}")


def rotary_dtypes(model: nn.Module, tokens: torch.Tensor) -> tuple[set[str], set[str]]:
    """The dtypes of the cos/sin tables every block's attention rotates q and k with, and of q and k,
    in one forward of the sharded model: what arrives after FSDP cast each block's inputs."""
    tables: set[str] = set()
    rotated: set[str] = set()
    original = llama.apply_rope

    def probe(x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        rotated.add(str(x.dtype))
        # a complex table holds cos and sin as its real and imaginary parts
        tables.update(str((t.real if t.is_complex() else t).dtype) for t in rope)
        return original(x, *rope)

    llama.apply_rope = probe
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        llama.apply_rope = original
    return tables, rotated


class FewRows(nn.Module):
    """A 3-row weight on 4 ranks: FSDP2's ceil-sized chunks leave the last rank no rows."""

    init_parameter_elementwise = True

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.Linear(5, 3, bias=False)
        self.wide = nn.Linear(40, 9)

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        tensor.normal_(0.0, 1.0, generator=generator)


def empty_shard(out: str) -> None:
    env = init_distributed()
    with torch.device("meta"):
        model = FewRows()
    fully_shard(model, mesh=init_device_mesh("cpu", (env.world_size,)))
    sharded_model.materialize(model, env.device, seed=5)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if env.rank == 0:
        torch.save(full, Path(out, "few_rows.pt"))


def peak_rss_since_reset() -> int:
    """VmHWM, the peak resident set since the last ``reset_peak_rss`` (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set


class CountingFile:
    """An open safetensors file that counts the elements read of each tensor, whole or sliced."""

    def __init__(self, opening, counts: dict[str, int]) -> None:
        self.opening, self.counts = opening, counts

    def __enter__(self) -> CountingFile:
        self.handle = self.opening.__enter__()  # open_safetensors' open file
        return self

    def __exit__(self, *exc) -> None:
        self.opening.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.handle.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.counted(name, self.handle.get_tensor(name))

    def get_slice(self, name: str) -> CountingSlice:
        return CountingSlice(self, name, self.handle.get_slice(name))

    def counted(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self.counts[name] = self.counts.get(name, 0) + tensor.numel()
        return tensor


class CountingSlice:
    def __init__(self, file: CountingFile, name: str, stored) -> None:
        self.file, self.name, self.stored = file, name, stored

    def get_shape(self) -> list[int]:
        return self.stored.get_shape()

    def __getitem__(self, index) -> torch.Tensor:
        return self.file.counted(self.name, self.stored[index])


def qk_reads(out: str, directory: str) -> None:
    """``model.init_from=hf:`` into the built-in Llama (6 heads, 2 key/value heads of 6 rows: at 4
    ranks most shard boundaries of q and k fall inside a head, several on an odd row): the elements
    of q and k each rank reads from the files, and the rows it then holds."""
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, dim=36, n_layers=2, n_heads=6, n_kv_heads=2,
                                    ffn_hidden_dim=97, max_seq_len=64, init_from=f"hf:{directory}")
    env, model = build(cfg)
    counts: dict[str, int] = {}
    real = checkpoint_weights.open_safetensors
    checkpoint_weights.open_safetensors = lambda *args, **kwargs: CountingFile(real(*args, **kwargs), counts)
    try:
        checkpoint_weights.load_hf_into(model, cfg.model, directory)
    finally:
        checkpoint_weights.open_safetensors = real
    qk = sum(n for name, n in counts.items() if name.endswith(("q_proj.weight", "k_proj.weight")))
    rows = {name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters() if name.endswith(("wq.weight", "wk.weight"))}
    Path(out, f"qk-{env.world_size}-{env.rank}.txt").write_text(str(qk))
    torch.save(rows, Path(out, f"qk-rows-{env.world_size}-{env.rank}.pt"))


def load_memory(out: str, weights: str, vocab: int, dim: int, qk_directory: str | None = None,
                moe_directory: str | None = None) -> None:
    """Peak resident growth while loading a consolidated file (or, when ``weights`` is a directory,
    a Hugging Face model directory into ``model.name=hf``) into the sharded model; then, given
    ``qk_directory``, ``qk_reads`` of it, and given ``moe_directory``, its stacked expert
    parameters as loaded (``moe-WORLD.pt``, whole, from rank 0)."""
    cfg = Config()
    hf = Path(weights).is_dir()
    if hf:
        cfg.model = dataclasses.replace(cfg.model, name="hf", path=weights)
    else:
        cfg.model = dataclasses.replace(cfg.model, vocab_size=vocab, dim=dim, n_layers=1, n_heads=8,
                                        n_kv_heads=8, max_seq_len=64)
    env, model = build(cfg)
    before = rss_bytes()
    reset_peak_rss()
    if hf:
        load_hf_model_into(model, weights)
    else:
        load_safetensors_into(model, Path(weights))
    grown = peak_rss_since_reset() - before
    first = model.hf.get_input_embeddings().weight if hf else model.tok_embeddings.weight
    rows = first.to_local() if isinstance(first, DTensor) else first
    Path(out, f"load-{env.world_size}-{env.rank}.txt").write_text(f"{grown} {rows.shape[0]}")
    torch.save(rows.detach().clone(), Path(out, f"rows-{env.world_size}-{env.rank}.pt"))
    if qk_directory is not None:
        qk_reads(out, qk_directory)
    if moe_directory is not None:
        cfg.model = dataclasses.replace(cfg.model, name="hf", path=moe_directory)
        env, model = build(cfg)
        load_hf_model_into(model, moe_directory)
        stacked = {name: param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()
                   for name, param in model.named_parameters() if ".experts." in name}
        if env.rank == 0:
            torch.save(stacked, Path(out, f"moe-{env.world_size}.pt"))


def exchange_inputs(rank: int, micro_batch: int, vocab: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s token ids (row 1, the padding row, among them) and incoming gradient."""
    generator = torch.Generator().manual_seed(100 * micro_batch + rank)
    tokens = torch.randint(0, vocab, (2, 5), generator=generator)
    tokens[0, 0] = 1
    return tokens, torch.randn(2, 5, dim, generator=generator)


def row_exchange(out: str) -> None:
    """strategy.embedding_lookup=exchange against a plain lookup of the whole table, on a 1-D mesh of
    4 ranks and a 2 x 2 hybrid one, fp32 and bf16 compute, two accumulated micro-batches, a padding
    row and a vocabulary of 10 rows (3, 3, 3, 1 a rank; 5, 5 over 2)."""
    env = init_distributed()
    rank, world, vocab, dim = env.rank, env.world_size, 10, 3
    table = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(0))
    for shape, names in (((world,), ("dp_shard",)), ((2, world // 2), ("dp_replicate", "dp_shard"))):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for dtype in (torch.float32, torch.bfloat16):
            embedding = nn.Embedding(vocab, dim, padding_idx=1)
            embedding.weight.data.copy_(table)
            weight = exchange_embedding_rows(embedding, mesh, dtype)
            # The layout FSDP2 gives the same table: checkpoints read either way.
            fsdp = nn.Embedding(vocab, dim)
            fsdp.weight.data.copy_(table)
            fully_shard(fsdp, mesh=mesh)
            assert weight.placements == fsdp.weight.placements, (weight.placements, fsdp.weight.placements)
            assert weight.to_local().equal(fsdp.weight.to_local())
            # Materialising a model built on meta gives it new Parameter objects (to_empty).
            embedding.to_empty(device="cpu")
            weight = embedding.weight
            with torch.no_grad():
                weight.to_local().copy_(fsdp.weight.to_local())
            expected = torch.zeros(vocab, dim)
            for micro_batch in range(2):
                embedding.sum_replicas = micro_batch == 1
                tokens, incoming = exchange_inputs(rank, micro_batch, vocab, dim)
                looked_up = embedding(tokens)
                assert looked_up.dtype == dtype and looked_up.equal(table[tokens].to(dtype))
                looked_up.backward(incoming.to(dtype))
                for other in range(world):
                    tokens, incoming = exchange_inputs(other, micro_batch, vocab, dim)
                    expected.index_add_(0, tokens.flatten(), incoming.to(dtype).float().reshape(-1, dim))
            expected[1] = 0  # nn.Embedding's padding row gets no gradient
            got = weight.grad.full_tensor()
            # fp32: the sums' order differs; bf16: each rank sums a token's gradients in bf16.
            tolerance = 1e-6 if dtype == torch.float32 else 3e-2
            assert torch.allclose(got, expected, rtol=tolerance, atol=tolerance), (shape, dtype)
    try:
        embedding(torch.tensor([[0, vocab]]))
        raise AssertionError("an id beyond the table was looked up")
    except IndexError as exc:
        assert f"token id {vocab} is outside the embedding's {vocab} rows" in str(exc), exc
    # One rank's bad id stops every rank of its exchange group at the same exchange, none waits for
    # the rank that raised (before, they sat in the next all-to-all until the group's timeout).
    # The last mesh is hybrid: ranks 0-1 exchange rows, and so do ranks 2-3.
    group_ranks = dist.get_process_group_ranks(embedding.route.group)
    try:
        embedding(torch.tensor([[0, vocab + 3 if rank == 1 else 2]]))
        assert 1 not in group_ranks, "a rank went on past another rank's bad id"
    except IndexError as exc:
        expected = (f"token id {vocab + 3} is outside" if rank == 1
                    else "rank 1 of the embedding's row exchange looked up a token id outside")
        assert 1 in group_ranks and expected in str(exc), exc
    looked_up = embedding(torch.tensor([[0, 2]]))  # the group is usable after the refusal
    assert looked_up.float().equal(table[torch.tensor([[0, 2]])].to(looked_up.dtype).float())
    # In a model: an embedding alone in its unit is exchanged, a tied one (the head's matmul needs
    # the whole table) is gathered with the head.
    for tied, exchanged in ((False, ["tok_embeddings"]), (True, [])):
        cfg = tiny_config("FULL_SHARD")
        cfg.model = dataclasses.replace(cfg.model, tie_embeddings=tied)
        plan = resolve_plan(cfg.strategy, env.world_size, env.local_world_size)
        _, report = sharded_model.build_sharded_model(cfg, env, plan, build_mesh(plan, "cpu"),
                                                      model_factory(cfg.model))
        assert report.exchanged_embeddings == exchanged, (tied, report.exchanged_embeddings)
    Path(out, f"exchange{rank}.ok").write_text("ok")


def running_statistics_agree(out: str) -> None:
    """BatchNorm's running statistics, which each rank's forward updates from its own batches, are
    averaged over the data-parallel ranks (both dimensions of a hybrid mesh), in fp32 for bf16 ones;
    num_batches_tracked and the parameters are left alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for shape, names in (((world,), ("dp_shard",)), ((2, world // 2), ("dp_replicate", "dp_shard"))):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for dtype in (torch.float32, torch.bfloat16):
            model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3), nn.InstanceNorm1d(
                3, track_running_stats=True), nn.BatchNorm1d(3, track_running_stats=False))
            fully_shard(model, mesh=mesh)
            ranks = torch.arange(world, dtype=torch.float32)
            for module in (model[1], model[3]):
                size = module.num_features
                module.running_mean = (torch.arange(size) + 10.0 * rank).to(dtype)
                module.running_var = (torch.arange(size) / 8 + 1.0 + rank).to(dtype)
                module.num_batches_tracked.fill_(rank)
            average_running_statistics(model, mesh, names)
            for module in (model[1], model[3]):
                size = module.num_features
                mean = (torch.arange(size) + 10.0 * ranks.mean()).to(dtype)
                var = (torch.arange(size) / 8 + 1.0 + ranks.mean()).to(dtype)
                assert module.running_mean.dtype == dtype and module.running_mean.equal(mean), (shape, dtype)
                assert module.running_var.equal(var), (shape, dtype, module.running_var, var)
                assert int(module.num_batches_tracked) == rank
    Path(out, f"running_stats{rank}.ok").write_text("ok")


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.linear(x)))


def batch_norm_trains_in_bf16_and_checkpointed(out: str) -> None:
    """Found by a trial: a BatchNorm under bf16-mixed or bf16-pure failed in its forward (bf16
    weights beside fp32 running statistics), and a checkpointed block's recomputation moved the
    statistics a second time. Each norm keeps fp32 weights in a unit of its own; with every block
    recomputed, the statistics, the outputs and the gradients are the ones without."""
    rank = dist.get_rank()
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    for precision in ("bf16-mixed", "bf16-pure"):
        results = []
        for checkpointing in ("none", "all"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8), NormBlock(), NormBlock())
            strategy = dataclasses.replace(Config().strategy, mixed_precision=precision,
                                           activation_checkpointing=checkpointing)
            plan = resolve_plan(strategy, dist.get_world_size(), dist.get_world_size())
            report = parallelize(model, build_mesh(plan, "cpu"), plan, [NormBlock])
            assert report.fp32_norms == ["1.norm", "2.norm"], report.fp32_norms
            assert model[1].norm.weight.dtype == torch.float32
            for _ in range(2):
                out_ = model(x)
                out_.float().square().sum().backward()
            grads = [p.grad.full_tensor() for p in model.parameters()]
            stats = [b.clone() for name, b in model.named_buffers() if "running" in name or "tracked" in name]
            results.append((out_.detach(), grads, stats, int(model[1].norm.num_batches_tracked)))
        (plain, plain_grads, plain_stats, plain_count), (out_, grads, stats, count) = results
        assert (plain_count, count) == (2, 2), (precision, plain_count, count)
        assert all(torch.equal(a, b) for a, b in zip(stats, plain_stats, strict=True)), precision
        assert torch.equal(out_, plain) and all(map(torch.equal, grads, plain_grads)), precision
        # A norm the wrap policy makes a unit of its own is one in fp32 (found by review: left bf16)
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))
        report = parallelize(model, build_mesh(plan, "cpu"), plan, [nn.BatchNorm1d])
        assert report.fp32_norms == ["1"] and model[1].weight.dtype == torch.float32, report.fp32_norms
        model(x).float().sum().backward()
    Path(out, f"norms{rank}.ok").write_text("ok")


def few_rows_and_row_exchange(out: str) -> None:
    """The 4-rank checks (in the group of ``initial_weights`` at 4 ranks)."""
    empty_shard(out)
    row_exchange(out)
    running_statistics_agree(out)
    batch_norm_trains_in_bf16_and_checkpointed(out)
