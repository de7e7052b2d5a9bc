"""Bring your own Hugging Face model, end to end: make a model directory, write text files
(data=files prepares them into the data cache), train it sharded at 2 processes, generate from
the checkpoint, export it back and load the export with transformers. With --lora: train LoRA
adapters on the frozen model (finetune=lora), export them as a PEFT adapter directory and load it
with peft onto the model, and export the merged model (export-hf --merge) and generate from it
with transformers.

    python examples/finetune_hf/run.py [--workdir DIR] [--steps N] [--lora]

Every step is the command a user would type (printed before it runs); CI runs this file.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers
from make_model import make_llama, sample_texts
from peft import PeftModel


def run(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "shardtrain", *args]
    print("$ shardtrain " + shlex.join(args), flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"failed with exit {done.returncode}:\n{done.stderr[-4000:]}")
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="finetune_hf_work")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lora", action="store_true", help="LoRA adapters on the frozen model")
    args = parser.parse_args()
    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)

    model_dir = make_llama(work / "model")  # what a user downloads once and keeps on disk
    print(f"model directory: {model_dir}")
    data_dir = work / "data"  # the text to fine-tune on: one document per file
    data_dir.mkdir(parents=True)
    for index, text in enumerate(sample_texts(count=60)):
        (data_dir / f"doc{index:03d}.txt").write_text(text)

    run_dir = work / "run"
    log = run("train", "model=hf", f"model.path={model_dir}", "data=files", f"data.paths=[{data_dir}]",
        "data.file_glob=*.txt", "data.val_percent=10", "trainer.devices=2",
        f"trainer.max_steps={args.steps}", "trainer.micro_batch_size=4", "trainer.seq_len=128",
        "trainer.lr=1e-3", "trainer.warmup_steps=5", f"trainer.eval_every={args.steps}",
        "trainer.eval_samples=16", "trainer.sample_tokens=24", "trainer.progress_bar=false",
        f"run.dir={run_dir}", "run.trackers=[]",
        *(["finetune=lora", "finetune.rank=8", "trainer.sample_tokens=0"] if args.lora else []))
    print("\n".join(line for line in log.stderr.splitlines()
                    if "initialised" in line or " | loss " in line or "finetune=" in line))
    checkpoint = run_dir / "checkpoints" / f"step-{args.steps}"
    if args.lora:
        lora_round_trip(checkpoint, model_dir, work / "adapter")
        return
    print(run("generate", str(checkpoint), "--prompt", "def ", "--max-new-tokens", "24").stdout)
    print(run("generate", str(checkpoint), "--prompt", "Write a loop.", "--chat",
              "--max-new-tokens", "16").stdout)
    export = work / "export"
    print(run("export-hf", str(checkpoint), str(export)).stdout.strip().splitlines()[-1])

    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
    inputs = tokenizer("def ", return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    print("transformers generates from the export:", repr(tokenizer.decode(output[0])))


def lora_round_trip(checkpoint: Path, model_dir: Path, adapter: Path) -> None:
    """The adapters as PEFT's directory (checked by export-peft itself), loaded onto the model; the
    merged model (export-hf --merge, checked too), loaded by transformers: both generate the same."""
    print(run("export-peft", str(checkpoint), str(adapter)).stdout.strip().splitlines()[-1])
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    inputs = tokenizer("def ", return_tensors="pt")
    with_adapters = tokenizer.decode(model.generate(**inputs, max_new_tokens=16, do_sample=False)[0])
    print("peft generates with the adapters:", repr(with_adapters))
    merged_dir = adapter.with_name("merged")
    print(run("export-hf", str(checkpoint), str(merged_dir), "--merge").stdout.strip().splitlines()[-1])
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32)
    text = tokenizer.decode(merged.generate(**inputs, max_new_tokens=16, do_sample=False)[0])
    print("transformers generates from the merged export:", repr(text),
          "(the same)" if text == with_adapters else "(DIFFERENT)")


if __name__ == "__main__":
    main()
