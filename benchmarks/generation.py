"""Generation speed: shardtrain's generate vs transformers' generate on the same exported model.

Run by benchmarks/run.py (--only generation). One process: trains the default model for a few steps
(speed does not depend on the weights), exports it with export-hf, then times greedy generation of
the same number of new tokens from the same prompt with both, alternating, in this one process.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def main(new_tokens: int = 200, rounds: int = 3) -> None:
    import transformers
    from safetensors.torch import load_file

    from shardtrain.checkpoint.weights import model_config_of
    from shardtrain.generation.generate import generate
    from shardtrain.models.llama import Llama

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cli = [sys.executable, "-m", "shardtrain"]
        subprocess.run([*cli, "train", "trainer.max_steps=5", "trainer.sample_tokens=0",
                        "trainer.eval_every=0", f"run.dir={run}"], check=True, capture_output=True)
        ckpt = run / "checkpoints" / "step-5"
        single = Path(tmp) / "m.safetensors"
        subprocess.run([*cli, "consolidate", str(ckpt), str(single)], check=True, capture_output=True)
        subprocess.run([*cli, "export-hf", str(ckpt), str(Path(tmp) / "hf")], check=True,
                       capture_output=True)
        ours = Llama(model_config_of(single))
        ours.load_state_dict(load_file(single))
        ours.eval()
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(Path(tmp) / "hf"),
                                                               dtype=torch.float32).eval()
    prompt = list(b"def main():\n    ")
    ids = torch.tensor([prompt])
    times = {"shardtrain": [], "transformers": []}
    for _ in range(rounds):
        start = time.perf_counter()
        generate(ours, prompt, new_tokens, vocab_limit=256)
        times["shardtrain"].append(time.perf_counter() - start)
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)
        times["transformers"].append(time.perf_counter() - start)
        assert out.shape[1] == len(prompt) + new_tokens
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"new_tokens": new_tokens, "prompt_tokens": len(prompt), "rounds": rounds,
                      "seconds": medians,
                      "tokens_per_s": {k: new_tokens / v for k, v in medians.items()},
                      "transformers_version": transformers.__version__,
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
