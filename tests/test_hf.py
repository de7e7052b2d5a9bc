"""Round trip with Hugging Face transformers (a local tiny model; nothing is downloaded)."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import math
import re
import shutil

import pytest
import torch
from cli_utils import read_metrics, run_cli
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardtrain.checkpoint.weights import load_hf_into, load_safetensors_into, model_config_of
from shardtrain.config.schema import ModelConfig
from shardtrain.errors import CheckpointError, ConfigError, DataError
from shardtrain.export.consolidate import consolidate
from shardtrain.export.hf import export_hf
from shardtrain.export.verify import verify_export
from shardtrain.models.llama import Llama

transformers = pytest.importorskip("transformers")


def safe_open_metadata(path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_the_built_in_models_export_names_its_tokenizers_end_of_text(tmp_path):
    """Found by review: config.json's eos_token_id was null even for a run with a Hugging Face
    tokenizer that has one, and transformers' generate then never stopped at the end of text."""
    from hf_models import make_model_dir

    from shardtrain.data.tokenizer import HFTokenizer
    from shardtrain.export.hf import special_token_ids

    directory = make_model_dir(tmp_path / "model", "llama")
    tokenizer = HFTokenizer(directory)
    assert tokenizer.eos_id is not None
    ids = special_token_ids(ModelConfig(tokenizer=str(directory)))
    assert ids["eos_token_id"] == tokenizer.eos_id and ids.get("bos_token_id") == tokenizer.bos_id
    assert special_token_ids(ModelConfig(tokenizer="bytes")) == {}  # the byte tokenizer has neither


def test_a_tokenizer_edited_since_training_is_refused_where_a_checkpoint_is_read(tmp_path):
    """Found by review: generate, eval and export-hf read the tokenizer from where the run named it,
    and one edited or replaced there since training gave other ids (a loss of other text, an export
    with another tokenizer) without a word. Checkpoints record its digest; a resume says the change."""
    from hf_models import make_model_dir, sample_texts, train_tokenizer

    from shardtrain.data.tokenizer import HFTokenizer

    directory = make_model_dir(tmp_path / "model", "llama")
    run_dir = tmp_path / "run"
    common = ["experiment=quick", "data.max_bytes=60000", "data.val_percent=50",
              f"model.tokenizer={directory}", "model.vocab_size=320", "trainer.eval_every=0",
              "trainer.sample_tokens=0", "run.trackers=[]", f"run.dir={run_dir}"]
    trained = run_cli("train", *common, "trainer.max_steps=1")
    assert trained.returncode == 0, trained.stderr[-3000:]
    ckpt = run_dir / "checkpoints" / "step-1"
    recorded = json.loads((ckpt / "trainer_state.json").read_text())["tokenizer"]
    assert recorded == HFTokenizer(directory).name
    consolidated = consolidate(ckpt, tmp_path / "m.safetensors")[0]  # which records it too
    train_tokenizer(sample_texts()[::-1], vocab_size=290).save(str(directory / "tokenizer.json"))
    edited = HFTokenizer(directory).name

    def said(source) -> str:
        return (f"{source} was trained with the tokenizer {recorded}, and {directory} is now {edited} "
                "(edited or replaced since?): the model would read its ids as other text; put back the "
                "tokenizer the run was trained with")

    for command, source in ((["eval", str(consolidated), "--samples", "2"], consolidated),
                            (["export-hf", str(ckpt), str(tmp_path / "hf")], ckpt)):
        refused = run_cli(*command)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert refused.stderr.strip().endswith(said(source)), refused.stderr[-3000:]
    with pytest.raises(DataError, match=re.escape(said(consolidated))):
        export_hf(consolidated, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_an_export_interrupted_in_its_check_leaves_no_files(tmp_path):
    """Found by review: a Ctrl-C during the self-check left the export's files whole and unchecked
    (they passed for an export, and the rerun was refused: "already holds model files")."""
    import argparse

    from shardtrain.cli.main import finish_export

    out = tmp_path / "export"
    out.mkdir()
    files = [out / "config.json", out / "model.safetensors"]
    for file in files:
        file.write_text("{}")

    def interrupted(checkpoint, directory):
        raise KeyboardInterrupt

    args = argparse.Namespace(checkpoint=str(tmp_path / "ckpt"), out=str(out), no_verify=False)
    with pytest.raises(KeyboardInterrupt):
        finish_export(args, files, interrupted, "transformers'", made=True)
    assert not out.exists()


def test_a_replaced_tokenizers_ids_reach_a_multimodal_configs_language_model(tmp_path):
    """Found by review: a run whose model.tokenizer replaced the base's wrote that tokenizer's
    special ids into config.json's top level only; a multimodal model's language model (Llama 4's,
    Mllama's) reads its text_config's, which kept the base vocabulary's ids."""
    from hf_models import make_model_dir

    from shardtrain.data.tokenizer import HFTokenizer
    from shardtrain.export.hf import write_hf_model_files

    directory = make_model_dir(tmp_path / "model", "llama")
    config = json.loads((directory / "config.json").read_text())
    config["text_config"] = {"bos_token_id": 7, "eos_token_id": 8, "pad_token_id": 9, "vocab_size": 300}
    (directory / "config.json").write_text(json.dumps(config))
    own = tmp_path / "tokenizer"
    shutil.copytree(directory, own)
    tokenizer = HFTokenizer(own)
    out = tmp_path / "out"
    out.mkdir()
    write_hf_model_files(ModelConfig(name="hf", path=str(directory), tokenizer=str(own)), out, torch.float32)
    written = json.loads((out / "config.json").read_text())
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": None}
    assert {key: written["text_config"][key] for key in ids} == ids == {key: written[key] for key in ids}
    assert written["text_config"]["vocab_size"] == 300 and tokenizer.eos_id != 8


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers_with_matching_logits(tmp_path, tied):
    run_dir = tmp_path / "run"
    proc = run_cli("train", "experiment=quick", "trainer.max_steps=3", "trainer.sample_tokens=0",
                   f"model.tie_embeddings={str(tied).lower()}", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = run_dir / "checkpoints" / "step-3"
    out = tmp_path / "hf"
    exported = run_cli("export-hf", str(ckpt), str(out), "--max-shard-size", "40KB")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    assert "verified: transformers' logits match the checkpoint's" in exported.stdout

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    # The byte tokenizer goes with it (found by review: generate on the export found no tokenizer):
    # transformers' reads each byte as its own id, as training did, and generate takes the directory.
    text = "def main():\n    return 'héllo'  # 日本\x00"
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert their_tokenizer(text).input_ids == list(text.encode())
    assert their_tokenizer.decode(list(text.encode())) == text
    # ... and eval counts its loss per byte, as of the checkpoint (found by review: "per token")
    from shardtrain.data.tokenizer import HFTokenizer, reads_bytes

    assert reads_bytes(HFTokenizer(out))
    from shardtrain.export.hf import tokenizer_copies

    gone = str(tmp_path / "gone" / "tokenizer.json")  # a tokenizer moved since training: said first
    with pytest.raises(CheckpointError, match=re.escape(f"model.tokenizer={gone!r} does not exist")):
        tokenizer_copies(ModelConfig(tokenizer=gone))
    assert hf.config.num_key_value_heads < hf.config.num_attention_heads  # grouped-query attention
    assert hf.config.tie_word_embeddings == tied

    consolidated = tmp_path / "m.safetensors"
    assert run_cli("consolidate", str(ckpt), str(consolidated)).returncode == 0
    ours = Llama(model_config_of(consolidated))
    load_safetensors_into(ours, consolidated)  # a tied model's file names the weight twice
    ours.eval()
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_error(hf(x).logits, ours(x)) < 1e-5
    # From the consolidated file: as many shards, each read alone (found by review: one shard of the
    # whole file, read whole, whatever --max-shard-size said), the same tensors.
    from_file = [p for p in export_hf(consolidated, tmp_path / "hf-from-file", max_shard_size="40KB")
                 if p.suffix == ".safetensors"]
    shards = [p for p in out.iterdir() if p.suffix == ".safetensors"]
    assert len(from_file) == len(shards) > 2
    assert all(load_file(p) for p in from_file)  # no shard of a tied head's dropped name alone (review)
    written = {k: v for p in from_file for k, v in load_file(p).items()}
    expected = {k: v for p in shards for k, v in load_file(p).items()}
    assert written.keys() == expected.keys() and all(written[k].equal(expected[k]) for k in written)
    if not tied:
        return
    # A part holding only the tied head's second name makes no shard (found by review: an empty
    # shard, counted in the others' "-of-N" names).
    from shardtrain.export.hf import hf_conversion, write_hf_directory

    weights = load_file(consolidated)
    head = {"output.weight": weights.pop("output.weight")}
    files = write_hf_directory(hf_conversion(model_config_of(consolidated)), tmp_path / "two-parts",
                               [lambda: dict(weights), lambda: dict(head)])
    assert [p.name for p in files if p.suffix == ".safetensors"] == ["model.safetensors"]
    from_export = run_cli("generate", str(out), "--prompt", "def ", "--max-new-tokens", "8")
    assert from_export.returncode == 0 and from_export.stdout.startswith("def "), from_export.stderr[-3000:]
    # A tied model's consolidated file starts a run and generates (it used to be refused:
    # "unexpected keys ['output.weight']").
    again = run_cli("train", "experiment=quick", "trainer.max_steps=1", "trainer.sample_tokens=0",
                    "model.tie_embeddings=true", f"model.init_from={consolidated}",
                    f"run.dir={tmp_path / 'again'}")
    assert again.returncode == 0, again.stderr[-3000:]
    generated = run_cli("generate", str(consolidated), "--prompt", "def ", "--max-new-tokens", "8")
    assert generated.returncode == 0 and generated.stdout.startswith("def "), generated.stderr[-3000:]
    # The two names of one tied weight must hold the same tensor.
    state = load_file(consolidated)
    state["output.weight"] = state["output.weight"] + 1
    broken = tmp_path / "broken.safetensors"
    save_file(state, str(broken), metadata=safe_open_metadata(consolidated))
    with pytest.raises(CheckpointError, match="tied weight"):
        load_safetensors_into(Llama(model_config_of(consolidated)), broken)


def test_export_check_fails_on_corrupted_weights(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    proc = run_cli("train", "experiment=quick", "trainer.max_steps=2", "trainer.sample_tokens=0",
                   f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt, out = run_dir / "checkpoints" / "step-2", tmp_path / "hf"
    bf16 = run_cli("export-hf", str(ckpt), str(out), "--dtype", "bf16")
    assert bf16.returncode == 0 and "verified" in bf16.stdout, bf16.stderr[-3000:]  # rounded alike
    # Never over an earlier export: its files left beside the new ones would be loaded instead
    written = sorted(p.name for p in out.iterdir())
    with pytest.raises(CheckpointError, match=f"output directory {out} already holds model files"):
        export_hf(ckpt, out, max_shard_size="40KB")
    assert sorted(p.name for p in out.iterdir()) == written
    # --max-shard-size measures bf16 shards as written (found by review: as the stored fp32, twice as
    # many shards as asked for), as consolidate --dtype bf16 does
    shards = [p for p in export_hf(ckpt, tmp_path / "hf16", max_shard_size="40KB", dtype="bf16")
              if p.name.startswith("model-")]
    assert len(shards) == len([p for p in consolidate(ckpt, tmp_path / "c16", max_shard_size="40KB",
                                                      dtype="bf16") if p.suffix == ".safetensors"])
    # A consolidation that fails part-way (a full disk at its second shard) leaves none of its
    # files (found by review: they blocked the rerun, "already holds model files", and kept the space)
    from shardtrain.checkpoint.safetensors_files import write_streamed

    written = []

    def full_at_second(target, *args):
        written.append(target)
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        write_streamed(target, *args)

    monkeypatch.setattr("shardtrain.export.consolidate.write_streamed", full_at_second)
    with pytest.raises(OSError, match="No space left"):
        consolidate(ckpt, tmp_path / "partial", max_shard_size="40KB")
    assert len(written) == 2 and not (tmp_path / "partial").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "README.md").write_text("mine")
    written.clear()
    with pytest.raises(OSError, match="No space left"):
        consolidate(ckpt, tmp_path / "kept", max_shard_size="40KB")
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["README.md"]
    monkeypatch.undo()

    def index_cut_short(directory, *args):  # the last file written: part of it, then the disk is full
        (directory / "model.safetensors.index.json").write_text('{"metadata": {"total_')
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("shardtrain.export.consolidate.write_index", index_cut_short)
    with pytest.raises(OSError, match="No space left"):
        consolidate(ckpt, tmp_path / "kept", max_shard_size="40KB")
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["README.md"]
    monkeypatch.undo()
    for size in ("0", "0.5B"):  # found by review: no limit at all, one file
        with pytest.raises(ConfigError, match=f"--max-shard-size '{size}' must be more than 0"):
            consolidate(ckpt, tmp_path / "zero", max_shard_size=size)
    out = tmp_path / "hf32"
    export_hf(ckpt, out)  # in fp32, then damage one weight as a bad converter would
    # An earlier export's shards and index beside the single file: transformers loads the file, the
    # check read the index
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}  # a one-shard export's own
    shutil.copyfile(out / "model.safetensors", out / "model-00001-of-00001.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": {
        name: "model-00001-of-00001.safetensors" for name in index["weight_map"]}}))
    with pytest.raises(CheckpointError, match="export check failed: .* holds both model.safetensors and"):
        verify_export(ckpt, out)
    (out / "model-00001-of-00001.safetensors").unlink()
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    state = load_file(out / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.weight"][0] += 1.0
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"export check failed: .* differ from the checkpoint's"):
        verify_export(ckpt, out)
    del state["model.layers.0.self_attn.q_proj.weight"]  # dropped: transformers would draw it at random
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="export check failed"):
        verify_export(ckpt, out)
    skipped = run_cli("export-hf", str(ckpt), str(tmp_path / "unchecked"), "--no-verify")
    assert skipped.returncode == 0 and "verified" not in skipped.stdout
    # A family without a position limit (Bloom's ALiBi: max_seq_len None) is checked on 32 tokens
    # (found by review: a TypeError after the files were written)
    from types import SimpleNamespace

    from shardtrain.export.verify import check_tokens

    unbounded = SimpleNamespace(dims=SimpleNamespace(vocab_size=10), max_seq_len=None)
    assert check_tokens(unbounded).shape == (2, 32)
    # A failed check removes what it failed, and the directory the export made: left whole with its
    # config.json it passed for a finished export and blocked the export again (found by review)
    from shardtrain.cli.main import main

    with monkeypatch.context() as patched:
        patched.setattr("shardtrain.models.llama_hf_adapter.interleaved_to_halves", lambda w, heads: w)
        assert main(["export-hf", str(ckpt), str(tmp_path / "wrong")]) == 2
    assert "the export's files are removed (--no-verify writes them unchecked)" in capsys.readouterr().err
    assert not (tmp_path / "wrong").exists()
    assert main(["export-hf", str(ckpt), str(tmp_path / "wrong")]) == 0


def test_export_dtype_casts_floating_point_tensors_only(tmp_path):
    from shardtrain.export.hf import hf_conversion, write_hf_directory

    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=32, max_seq_len=16)
    part = {"tok_embeddings.weight": torch.randn(32, 16), "norm.weight": torch.arange(16) * 1000003}
    write_hf_directory(hf_conversion(cfg, "bf16"), tmp_path, [lambda: dict(part)])
    written = load_file(tmp_path / "model.safetensors")
    assert written["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(written["model.norm.weight"], part["norm.weight"])  # not rounded to bf16
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 32 * 16 * 2 + 16 * 8
    # A value past fp16's range is refused naming it, not written as inf (found by review: exit 0,
    # or the export check blaming the conversion)
    part["tok_embeddings.weight"][3, 5] = 1e5
    with pytest.raises(CheckpointError, match=r"tensor 'model.embed_tokens.weight' holds 1e\+05, past "
                                              r"float16's largest value \(65504\).*use --dtype bf16"):
        write_hf_directory(hf_conversion(cfg, "fp16"), tmp_path / "fp16", [lambda: dict(part)])
    assert not (tmp_path / "fp16").exists()  # made by the export, and removed with its files
    from shardtrain.export.consolidate import Cast, model_cast

    with pytest.raises(CheckpointError, match=r"holds 1e\+05, past float16's .*use --dtype bf16"):
        Cast(torch.float16).apply("w", torch.tensor([math.inf, 1e5]))  # an inf already there too
    with pytest.raises(CheckpointError, match=r"past bfloat16's largest value .* inf; leave the weights as "
                                              r"stored$"):  # not "use --dtype bf16", given already
        Cast(torch.bfloat16).apply("w", torch.tensor([3.4e38]))
    with pytest.raises(CheckpointError, match=r"^--dtype bfloat16 reads the Hugging Face model's config.json "
                                              r"to keep in fp32 .*; or write the weights as stored"):
        model_cast(ModelConfig(name="hf", path=str(tmp_path / "gone")), torch.bfloat16)


def test_a_failed_export_leaves_none_of_its_files(tmp_path, monkeypatch):
    """Found by review: a failure after the shards (a full disk, the tokenizer gone) left weights, an
    index and config.json, a model to transformers without its tokenizer, and a rerun was refused.
    What the directory held before stays."""
    from shardtrain.export.hf import hf_conversion, write_hf_directory

    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=32, max_seq_len=16)
    part = {"tok_embeddings.weight": torch.randn(32, 16), "norm.weight": torch.ones(16)}
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("mine")

    def full_disk():
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_hf_directory(hf_conversion(cfg), out, [lambda: dict(part), full_disk])
    assert sorted(p.name for p in out.iterdir()) == ["README.md"]
    # safetensors' own error of a full disk (its words, as its Rust side raises them) names the file
    # (found by review: neither file nor filesystem)
    from shardtrain.checkpoint import safetensors_files

    def library_full_disk(*args, **kwargs):
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    with monkeypatch.context() as patched, pytest.raises(
            OSError, match=r"^\[Errno 28\] No space left on device: '.*/w.safetensors'$"):
        patched.setattr(safetensors_files, "save_file", library_full_disk)
        safetensors_files.save_safetensors({"w": torch.ones(4)}, tmp_path / "w.safetensors", {})
    gone = dataclasses.replace(cfg, tokenizer=str(tmp_path / "gone" / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="does not exist"):
        write_hf_directory(hf_conversion(gone), out, [lambda: dict(part)])
    assert sorted(p.name for p in out.iterdir()) == ["README.md"]
    names = {p.name for p in write_hf_directory(hf_conversion(cfg), out, [lambda: dict(part)])}
    assert names == {"model.safetensors", "model.safetensors.index.json", "tokenizer.json",
                     "tokenizer_config.json", "config.json"}


def test_export_check_holds_neither_model_whole(tmp_path):
    """The self-check's peak host memory is under half of one fp32 copy of the model (it held two:
    560 GB for a 70B model). A 6-layer model of 71 MB whose largest tensor is 3 MB, exported from a
    consolidated file; the check's second run is measured, after the first imported its modules."""
    from init_workers import peak_rss_since_reset, reset_peak_rss

    from shardtrain.checkpoint.safetensors_files import MODEL_CONFIG_KEY
    from shardtrain.config.schema import ModelConfig
    from shardtrain.diagnostics.memory import rss_bytes

    cfg = ModelConfig(dim=512, n_layers=6, n_heads=8, n_kv_heads=4, max_seq_len=64)
    torch.manual_seed(0)
    state = {name: p.detach().clone() for name, p in Llama(cfg).named_parameters()}
    model_bytes = sum(t.numel() * 4 for t in state.values())
    assert model_bytes > 70e6 and max(t.numel() * 4 for t in state.values()) < model_bytes / 20
    consolidated = tmp_path / "model.safetensors"
    save_file(state, str(consolidated), metadata={"format": "pt", MODEL_CONFIG_KEY: json.dumps(
        dataclasses.asdict(cfg))})
    del state
    export_hf(consolidated, tmp_path / "hf", max_shard_size="30MB")
    assert verify_export(consolidated, tmp_path / "hf") < 1e-5
    # Memory the first run freed goes back to the system, so the second cannot grow into it unseen.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = rss_bytes()
    reset_peak_rss()
    verify_export(consolidated, tmp_path / "hf")
    grown = peak_rss_since_reset() - before
    print(f"self-check peak growth {grown / 2**20:.1f} MiB; the model in fp32 {model_bytes / 2**20:.1f} MiB")
    assert grown < model_bytes / 2, (grown, model_bytes)


@pytest.fixture(scope="module")
def tiny_hf_llama(tmp_path_factory):
    """A random tiny Llama made by transformers itself (GQA, untied), saved locally."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(str(directory))
    return directory, model


HF_MODEL = ["model.dim=48", "model.n_layers=2", "model.n_heads=6", "model.n_kv_heads=2",
            "model.ffn_hidden_dim=96", "model.max_seq_len=128"]


def test_init_from_hf_refuses_what_the_built_in_llama_computes_otherwise(tiny_hf_llama, tmp_path):
    """Loaded without a word, these gave other logits (found by review: rms_norm_eps 1e-2 0.38 off,
    attention biases 1.8e-2, Llama 3.1's rope scaling 1.7e-3): each is refused, naming it."""
    from shardtrain.config.loader import load_config

    directory, _ = tiny_hf_llama
    cfg = load_config(HF_MODEL)
    with pytest.raises(CheckpointError, match=r"model.norm_eps=0.01 but the checkpoint has 1e-05 \(set it\)"):
        load_hf_into(Llama(cfg.model), dataclasses.replace(cfg.model, norm_eps=1e-2), directory)
    config = json.loads((directory / "config.json").read_text())
    llama3 = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}
    for change, named in ((llama3, "rope_type 'llama3'"), ({"attention_bias": True}, "attention_bias=true"),
                          ({"hidden_act": "gelu"}, "hidden_act 'gelu'"), ({"head_dim": 16}, "head_dim 16")):
        changed = tmp_path / named.split()[0]
        shutil.copytree(directory, changed)
        (changed / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(CheckpointError, match=f"cannot compute: {re.escape(named)}"):
            load_hf_into(Llama(cfg.model), cfg.model, changed)
    # Without the key, transformers computes with its default 1e-6 (found by review: read as 1e-5,
    # the built-in default, so nothing was refused and the norms differed).
    unset = tmp_path / "unset"
    shutil.copytree(directory, unset)
    (unset / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "rms_norm_eps"}))
    with pytest.raises(CheckpointError, match=r"model.norm_eps=1e-05 but the checkpoint has 1e-06"):
        load_hf_into(Llama(cfg.model), cfg.model, unset)
    unreadable = tmp_path / "unreadable"  # found by review: json's own traceback
    shutil.copytree(directory, unreadable)
    (unreadable / "config.json").write_text("{bad")
    with pytest.raises(CheckpointError, match=r"config.json is not readable JSON \(Expecting property name"):
        load_hf_into(Llama(cfg.model), cfg.model, unreadable)


def test_init_from_hf_matches_logits_and_trains_at_two_processes(tmp_path, tiny_hf_llama):
    from shardtrain.config.loader import load_config

    directory, hf = tiny_hf_llama
    cfg = load_config(HF_MODEL)
    ours = Llama(cfg.model)
    load_hf_into(ours, cfg.model, directory)
    ours.eval()
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_error(ours(x), hf(x).logits) < 1e-5

    run_dir = tmp_path / "from-hf"
    proc = run_cli("train", "experiment=quick", *HF_MODEL, f"model.init_from=hf:{directory}",
                   "trainer.max_steps=1", "trainer.devices=2", "trainer.sample_tokens=0",
                   "trainer.log_every=1", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialised weights from hf:" in proc.stderr
    loss = read_metrics(run_dir)[0]["loss"]
    assert 4.5 < loss < 7.0  # a random model's loss on bytes (ln 256 = 5.55), and finite
    # The two ranks trained the Hugging Face weights: after one AdamW step every weight is within one
    # step (the learning rate) of them; a random draw (std 0.02) or a part left unloaded is not.
    consolidated = tmp_path / "from-hf.safetensors"
    assert run_cli("consolidate", str(run_dir / "checkpoints" / "step-1"), str(consolidated)).returncode == 0
    trained = Llama(cfg.model)
    load_safetensors_into(trained, consolidated)
    lr = cfg.trainer.lr
    for (name, after), before in zip(trained.state_dict().items(), ours.state_dict().values(), strict=True):
        assert (after - before).abs().max() <= 1.01 * lr, name
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), ours.parameters()))

    wrong = run_cli("train", "experiment=quick", "model.dim=36", f"model.init_from=hf:{directory}",
                    "trainer.max_steps=1", f"run.dir={tmp_path / 'wrong'}")
    assert wrong.returncode == 2 and "does not fit the model config: model.dim=36" in wrong.stderr
