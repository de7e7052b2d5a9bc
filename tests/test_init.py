"""Initialisation: each rank draws only its own shard, and the weights are the same at any world size."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers
from distributed import run_on_ranks
from init_workers import (
    SMALL_CHUNK,
    FewRows,
    init_memory,
    initial_weights,
    load_memory,
    sampling_memory,
    tiny_config,
)
from safetensors.torch import load_file, save_file

from shardtrain.distributed import sharded_model
from shardtrain.distributed.sharded_model import init_full_parameter
from shardtrain.generation.generate import gathered_copy
from shardtrain.models.llama import Llama
from shardtrain.models.llama_hf_adapter import halves_to_interleaved

CASES = [(1, "FULL_SHARD", 0), (2, "FULL_SHARD", 0), (4, "FULL_SHARD", 0), (4, "HYBRID_SHARD", 2),
         (2, "NO_SHARD", 0)]


def reference(monkeypatch) -> dict[str, torch.Tensor]:
    """The unsharded model initialised in full, one process."""
    monkeypatch.setattr(sharded_model, "INIT_CHUNK_ELEMENTS", SMALL_CHUNK)
    cfg = tiny_config("FULL_SHARD")
    model = Llama(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            init_full_parameter(model, name, p, cfg.trainer.seed)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def initial_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("init")
    for world in sorted({case[0] for case in CASES}):
        # One spawned group a world size. One case resumes through the trainer too, and the 4 ranks
        # also run test_a_rank_with_an_empty_shard_and_embeddings_that_exchange_rows's checks.
        cases = [(strategy, group, (world, strategy) == (2, "FULL_SHARD"))
                 for size, strategy, group in CASES if size == world]
        run_on_ranks(initial_weights, world, str(out), cases, world == 4, tmp_path=out)
    return out


def test_weights_identical_at_every_world_size(initial_runs, monkeypatch):
    expected = reference(monkeypatch)
    largest = max(p.numel() for p in expected.values())
    assert largest > 10 * SMALL_CHUNK  # several chunks per parameter, boundaries inside shards
    for world, strategy, _ in CASES:
        got = torch.load(Path(initial_runs, f"init-{world}-{strategy}.pt"))
        assert got.keys() == expected.keys()
        for name in expected:
            assert got[name].equal(expected[name]), (world, strategy, name)


def test_resume_draws_no_random_initialisation(initial_runs, monkeypatch):
    """A resume reads every weight from its checkpoint, so it draws none (at 70B the draw is minutes
    of start-up); a fresh run through the trainer, whose draw waits until no checkpoint was found,
    still starts from exactly the built model's weights."""
    got = torch.load(Path(initial_runs, "resume.pt"))
    expected = reference(monkeypatch)
    assert got["fresh_draws"] > 0
    assert all(got["initial"][name].equal(expected[name]) for name in expected)
    assert got["step"] == 1 and got["resumed_draws"] == 0
    assert not all(got["saved"][name].equal(expected[name]) for name in expected)  # it trained
    assert all(got["resumed"][name].equal(got["saved"][name]) for name in expected)


def test_a_rank_draws_only_its_shard(tmp_path):
    """Each of 4 ranks' peak resident growth while initialising is under 40% of one rank doing it
    alone (full tensors would put the 268 MB embedding on every rank at once)."""
    run_on_ranks(init_memory, 1, str(tmp_path), tmp_path=tmp_path)
    run_on_ranks(init_memory, 4, str(tmp_path), tmp_path=tmp_path)
    alone, params = map(int, Path(tmp_path, "mem-1-0.txt").read_text().split())
    assert 250e6 < params < 350e6
    assert alone > params * 4  # the single rank holds every fp32 weight
    for rank in range(4):
        grown, _ = map(int, Path(tmp_path, f"mem-4-{rank}.txt").read_text().split())
        assert grown < 0.4 * alone, (rank, grown, alone)


@pytest.mark.parametrize("elementwise", [True, False])
def test_full_parameter_is_deterministic(elementwise, monkeypatch):
    cfg = tiny_config("FULL_SHARD")
    model = Llama(cfg.model)
    monkeypatch.setattr(type(model), "init_parameter_elementwise", elementwise)
    a, b = torch.empty(97, 36), torch.empty(97, 36)
    init_full_parameter(model, "layers.0.feed_forward.w1.weight", a, 7)
    init_full_parameter(model, "layers.0.feed_forward.w1.weight", b, 7)
    assert a.equal(b) and a.std() > 0
    init_full_parameter(model, "layers.0.feed_forward.w1.weight", b, 8)
    assert not a.equal(b)


@pytest.fixture(scope="module")
def bf16_mixed_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bf16")
    run_on_ranks(sampling_memory, 1, str(out), tmp_path=out)
    return out


def test_sampling_never_copies_the_model_in_fp32(bf16_mixed_run):
    """bf16-mixed: the gathered copy is allocated in bf16 (about half the fp32 model) plus one
    gathered parameter; building it in fp32 first would grow by at least the fp32 model."""
    grown, params, tokens, dtypes = Path(bf16_mixed_run, "sampling.txt").read_text().split()
    fp32_model = int(params) * 4
    assert int(params) > 90e6 and int(tokens) == 8 and dtypes == "torch.bfloat16"
    assert 0.4 * fp32_model < int(grown) < 0.75 * fp32_model, (int(grown), fp32_model)


def test_rotary_tables_reach_the_blocks_in_fp32_under_bf16_mixed(bf16_mixed_run):
    """FSDP's mixed precision casts each block's floating-point inputs to bf16. The rotary tables
    must not be among them: in bf16 (8 significant bits) the slow-turning dimensions of
    neighbouring far positions round to the same cos/sin. q and k are rotated in bf16 compute."""
    tables, rotated = Path(bf16_mixed_run, "rope.txt").read_text().split()
    assert rotated == "torch.bfloat16"  # the probe ran inside bf16-mixed blocks
    assert tables == "torch.float32"


def test_a_rank_with_an_empty_shard_and_embeddings_that_exchange_rows(initial_runs):
    # tests/init_workers.py's row_exchange asserts on every rank; each leaves a mark once through
    marks = sorted(p.name for p in Path(initial_runs).glob("exchange*.ok"))
    assert marks == [f"exchange{r}.ok" for r in range(4)]
    # ... and BatchNorm's running statistics agree (distributed/running_stats.py)
    marks = sorted(p.name for p in Path(initial_runs).glob("running_stats*.ok"))
    assert marks == [f"running_stats{r}.ok" for r in range(4)]
    # ... and a BatchNorm trains under bf16 precisions and checkpointed blocks (init_workers.py)
    marks = sorted(p.name for p in Path(initial_runs).glob("norms*.ok"))
    assert marks == [f"norms{r}.ok" for r in range(4)]
    got = torch.load(Path(initial_runs, "few_rows.pt"))
    plain = FewRows()
    for name, param in plain.named_parameters():
        expected = torch.empty(param.shape)
        init_full_parameter(plain, name, expected, 5)
        assert got[name].equal(expected), name


def test_gathered_copy_keeps_tied_weights():
    """to_empty gives each module its own new Parameter; the copy must tie them again."""
    cfg = tiny_config("FULL_SHARD")
    cfg.model.tie_embeddings = True
    torch.manual_seed(0)
    model = Llama(cfg.model).eval()
    plain = gathered_copy(model, lambda: Llama(cfg.model), torch.device("cpu"), torch.float32)
    assert plain.output.weight is plain.tok_embeddings.weight
    tokens = torch.randint(0, 256, (1, 8))
    assert torch.equal(plain(tokens), model(tokens))


def test_loading_a_consolidated_file_reads_only_the_own_rows(tmp_path):
    """Each of 4 ranks' peak resident growth while loading a 76M-parameter file (a 65,536 x 512
    embedding and head: 134 MB each in fp32) is under half of one rank loading it alone, and every
    rank holds exactly its rows of the file."""
    vocab, dim = 65536, 512
    cfg = tiny_config("FULL_SHARD").model
    model = Llama(dataclasses.replace(cfg, vocab_size=vocab, dim=dim, n_layers=1, n_heads=8,
                                      n_kv_heads=8, ffn_hidden_dim=0, max_seq_len=64))
    state = {name: torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
             for i, (name, p) in enumerate(model.named_parameters())}
    weights = tmp_path / "w.safetensors"
    save_file(state, str(weights))
    del model
    for world in (1, 4):
        run_on_ranks(load_memory, world, str(tmp_path), str(weights), vocab, dim, tmp_path=tmp_path)
    alone = int(Path(tmp_path, "load-1-0.txt").read_text().split()[0])
    assert alone > vocab * dim * 4  # one rank reads the embedding and the head at least
    rows = 0
    for rank in range(4):
        grown, held = map(int, Path(tmp_path, f"load-4-{rank}.txt").read_text().split())
        assert grown < alone / 2, (rank, grown, alone)
        mine = torch.load(Path(tmp_path, f"rows-4-{rank}.pt"))
        assert mine.equal(state["tok_embeddings.weight"][rows:rows + held])
        rows += held
    assert rows == vocab


@pytest.fixture(scope="module")
def hf_loads(tmp_path_factory) -> tuple[Path, torch.Tensor, Path]:
    """One run at 1 and at 4 ranks of both Hugging Face loads: a Llama directory saved by
    transformers in two files with an index (a 65,536 x 512 embedding and head) into
    ``model.name=hf``, and a small one (6 heads, 2 key/value heads) into the built-in Llama."""
    out = tmp_path_factory.mktemp("hf_loads")
    vocab, dim = 65536, 512
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=8,
                                      max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    directory = out / "model"
    model.save_pretrained(directory, max_shard_size="150MB")
    assert (directory / "model.safetensors.index.json").is_file()
    embedding = model.model.embed_tokens.weight.detach().clone()
    del model
    small = out / "small"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=36, intermediate_size=97, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5)).save_pretrained(small)
    # Mixtral as transformers saves it: each expert's w1, w2, w3 apart (3 experts: uneven over 4)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=3, max_position_embeddings=64)).save_pretrained(out / "moe")
    for world in (1, 4):
        run_on_ranks(load_memory, world, str(out), str(directory), vocab, dim, str(small), str(out / "moe"),
                     tmp_path=out)
    return out, embedding, small


def test_loading_a_hugging_face_directory_reads_only_the_own_rows(hf_loads):
    """The same for ``model.name=hf``, loaded by 4 ranks vs one."""
    out, embedding, _ = hf_loads
    alone = int(Path(out, "load-1-0.txt").read_text().split()[0])
    assert alone > embedding.numel() * 4
    rows = 0
    for rank in range(4):
        grown, held = map(int, Path(out, f"load-4-{rank}.txt").read_text().split())
        assert grown < alone / 2, (rank, grown, alone)
        assert torch.load(Path(out, f"rows-4-{rank}.pt")).equal(embedding[rows:rows + held])
        rows += held
        print(f"rank {rank} of 4: peak growth {grown / 2**20:.0f} MiB; alone {alone / 2**20:.0f} MiB")
    assert rows == embedding.shape[0]


def test_init_from_hf_reads_only_the_own_q_and_k_rows(hf_loads):
    """q and k are permuted within each head on the way in; each of 4 ranks still reads only its
    own rows of them (a quarter of what one rank loading alone reads; reading them whole put
    11.5 GiB of a 70B model's q and k on every rank), and holds exactly today's permuted rows."""
    out, _, small = hf_loads
    alone = int(Path(out, "qk-1-0.txt").read_text())
    assert alone == 2 * (36 + 12) * 36  # 2 layers of q (36 x 36) and k (12 x 36)
    stored = load_file(small / "model.safetensors")
    held = [torch.load(Path(out, f"qk-rows-4-{rank}.pt")) for rank in range(4)]
    for rank in range(4):
        read = int(Path(out, f"qk-4-{rank}.txt").read_text())
        print(f"rank {rank} of 4: read {read} q/k elements; alone {alone}")
        assert read < alone / 2, (rank, read, alone)
    for layer in range(2):
        for ours, theirs, heads in (("wq", "q_proj", 6), ("wk", "k_proj", 2)):
            name = f"layers.{layer}.attention.{ours}.weight"
            want = halves_to_interleaved(stored[f"model.layers.{layer}.self_attn.{theirs}.weight"], heads)
            assert torch.cat([rows[name] for rows in held]).equal(want), name
            assert all(rows[name].shape[0] > 0 for rows in held)


def test_experts_stored_apart_load_into_the_stacked_parameters(hf_loads):
    """Mixtral, Qwen3-MoE and DeepSeek-V3 directories store each expert's projections apart (what
    transformers' save_pretrained writes), which transformers stacks while loading; they were
    refused. Each rank now reads the experts its shard holds into the stacked parameters (gate and up
    concatenated): at 1 and 4 ranks (3 experts: one rank holds none) equal to from_pretrained's."""
    out, _, _ = hf_loads
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out / "moe", dtype=torch.float32)
    want = {f"hf.{name}": param for name, param in theirs.named_parameters() if ".experts." in name}
    assert any(name.endswith("gate_up_proj") for name in want)
    for world in (1, 4):
        loaded = torch.load(Path(out, f"moe-{world}.pt"))
        assert loaded.keys() == want.keys()
        assert all(loaded[name].equal(want[name]) for name in want), world


def test_an_init_parameter_that_fills_nothing_or_returns_a_new_tensor_is_refused():
    """Found by review: the tensor a task's init_parameter is given was torch.empty, so a hook that
    passed over a name (a custom init for a new head only) or returned a new tensor left
    uninitialised memory as the weights, without a word."""
    from shardtrain.errors import ModelError

    class HeadOnly:
        init_parameter_elementwise = False

        def init_parameter(self, name, tensor, generator):
            if name == "head.weight":
                tensor.normal_(0, 0.02, generator=generator)

    class Returns:
        def init_parameter(self, name, tensor, generator):
            return torch.zeros_like(tensor)

    class ReturnsItsTensor:  # nn.init and in-place methods return the tensor they fill: fine
        init_parameter_elementwise = True

        def init_parameter(self, name, tensor, generator):
            return torch.nn.init.normal_(tensor, generator=generator)

    init_full_parameter(HeadOnly(), "head.weight", torch.empty(4, 3), seed=0)
    with pytest.raises(ModelError, match=r"HeadOnly.init_parameter left parameter 'body.weight' unfilled"):
        init_full_parameter(HeadOnly(), "body.weight", torch.empty(4, 3), seed=0)
    with pytest.raises(ModelError, match=r"Returns.init_parameter returned a new tensor for 'w'; fill the "
                                         "tensor it is given in place"):
        init_full_parameter(Returns(), "w", torch.empty(2), seed=0)
    drawn = torch.empty(5, 3)
    init_full_parameter(ReturnsItsTensor(), "w", drawn, seed=0)  # by chunks: elementwise
    assert torch.isfinite(drawn).all() and drawn.std() > 0

    class ThroughAView:  # a conv weight filled through a 2-D view of it, the view returned: fine
        def init_parameter(self, name, tensor, generator):
            return torch.nn.init.orthogonal_(tensor.view(tensor.shape[0], -1), generator=generator)

    conv = torch.empty(4, 2, 3, 3)
    init_full_parameter(ThroughAView(), "conv.weight", conv, seed=0)
    assert torch.isfinite(conv).all()


def test_a_lazy_module_is_refused_with_what_to_build_instead():
    """nn.LazyLinear has no shape before a forward: torch's own error advised a dummy forward,
    which build_model cannot run (found by review)."""
    from shardtrain.errors import ModelError

    refused = r"LazyLinear is a lazy module .*nn.Linear\(in, out\) for nn.LazyLinear\(out\)"
    with sharded_model.parameters_on_meta(), pytest.raises(ModelError, match=refused):
        torch.nn.Sequential(torch.nn.LazyLinear(4))
