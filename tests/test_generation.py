"""Generation: sharded == consolidated, gathers do not grow with length, KV cache == no cache."""

from __future__ import annotations

import torch
from cli_utils import run_cli
from distributed import run_on_ranks
from generation_workers import count_all_gathers

from shardtrain.config.schema import ModelConfig
from shardtrain.generation.generate import generate
from shardtrain.models.llama import Llama

QUICK = ["experiment=quick", "trainer.eval_every=0", "trainer.sample_tokens=0", "run.tensorboard=false"]


def test_sharded_generation_equals_consolidated(tmp_path):
    run_dir = tmp_path / "run"
    trained = run_cli("train", *QUICK, "trainer.max_steps=40", f"run.dir={run_dir}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    ckpt = run_dir / "checkpoints" / "step-40"
    assert run_cli("consolidate", str(ckpt), str(tmp_path / "m.safetensors")).returncode == 0
    for options in (["--temperature", "0"], ["--temperature", "0.9", "--top-k", "20", "--top-p", "0.9",
                                              "--seed", "3"]):
        sharded = run_cli("generate", str(ckpt), "--prompt", "def ", "--max-new-tokens", "48",
                          "--devices", "2", *options)
        single = run_cli("generate", str(tmp_path / "m.safetensors"), "--prompt", "def ",
                         "--max-new-tokens", "48", *options)
        assert sharded.returncode == 0 and single.returncode == 0, sharded.stderr[-2000:]
        assert sharded.stdout == single.stdout  # token for token (bytes)
        assert sharded.stdout.startswith("def ") and len(sharded.stdout.encode()) >= 4 + 48
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def \nclass \n")
    multi = run_cli("generate", str(tmp_path / "m.safetensors"), "--prompts-file", str(prompts),
                    "--max-new-tokens", "8")
    assert multi.returncode == 0 and multi.stdout.count("\n") >= 2
    evaluated = run_cli("eval", str(ckpt), "--samples", "16", "--devices", "2")
    assert evaluated.returncode == 0 and "perplexity" in evaluated.stdout, evaluated.stderr[-2000:]


def test_all_gathers_do_not_grow_with_tokens(tmp_path):
    run_on_ranks(count_all_gathers, 2, str(tmp_path), tmp_path=tmp_path)
    counts = torch.load(tmp_path / "counts.pt")
    assert counts[4] > 0  # the weights were gathered ...
    assert counts[24] == counts[4]  # ... once, whatever the number of new tokens


def test_kv_cache_generation_equals_full_recompute():
    torch.manual_seed(0)
    model = Llama(ModelConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, max_seq_len=128)).eval()
    prompt = list(b"import os\n")
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 50, "seed": 7}):
        cached = generate(model, prompt, 40, use_cache=True, **sampling)
        full = generate(model, prompt, 40, use_cache=False, **sampling)
        assert cached == full
    # and the cached forward's logits equal the full forward's, chunked prefill included
    x = torch.randint(0, 256, (2, 30))
    cache = model.new_cache(30)
    with torch.no_grad():
        parts = [model(x[:, :10], cache=cache), model(x[:, 10:11], cache=cache),
                 model(x[:, 11:], cache=cache)]
        torch.testing.assert_close(torch.cat(parts, dim=1), model(x), rtol=1e-5, atol=1e-5)
