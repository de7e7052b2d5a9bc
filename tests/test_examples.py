"""The examples run as documented (CI runs them here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_finetune_hf_example(tmp_path):
    """Make a Hugging Face model directory, write text files, train at 2 processes, generate, export
    (with its self-check) and load the export with transformers."""
    done = subprocess.run([sys.executable, str(EXAMPLES / "finetune_hf" / "run.py"),
                           "--workdir", str(tmp_path / "work"), "--steps", "8"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "initialised weights from" in out and "step 8/8 | loss" in out
    assert "verified: transformers' logits match the checkpoint's" in out
    assert "transformers generates from the export:" in out
    assert (tmp_path / "work" / "export" / "tokenizer.json").is_file()


def test_finetune_hf_example_with_lora(tmp_path):
    """The same with finetune=lora: adapters trained at 2 processes, export-peft (with its
    self-check), PEFT loads them onto the model and generates; export-hf --merge's model generates
    the same."""
    done = subprocess.run([sys.executable, str(EXAMPLES / "finetune_hf" / "run.py"),
                           "--workdir", str(tmp_path / "work"), "--steps", "4", "--lora"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "finetune=lora: rank 8" in out and "step 4/4 | loss" in out
    assert "verified: peft.PeftModel's logits match the checkpoint's" in out
    assert "peft generates with the adapters:" in out
    assert "transformers generates from the merged export:" in out and "(the same)" in out
