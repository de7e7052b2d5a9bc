"""The import layers of shardtrain/tools/layers.py hold, and the checker catches what it should."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shardtrain.tools.layers import check

ROOT = Path(__file__).parent.parent
LAZY = "import inside a function: lazy imports belong in shardtrain/cli only"

CLEAN = {
    "__init__.py": "__version__ = '0'\n",
    "errors.py": "class ShardtrainError(Exception):\n    pass\n",
    "config/__init__.py": "from .loader import load\n",
    "config/loader.py": (
        "from __future__ import annotations\n\n"
        "import os\n"
        "from typing import TYPE_CHECKING\n\n"
        "from shardtrain import errors\n\n"
        "if TYPE_CHECKING:\n"
        "    from shardtrain.distributed.env import Env\n\n"
        "try:\n"
        "    import yaml\n"
        "except ImportError:\n"
        "    yaml = None\n\n\n"
        "def load(env: Env) -> str:\n"
        "    return os.environ.get('X', errors.__name__)\n"
    ),
    "distributed/__init__.py": "",
    "distributed/env.py": "from ..config import loader\nfrom shardtrain.errors import ShardtrainError\n",
    "cli/__init__.py": "",
    "cli/main.py": (
        "import shardtrain.config\n\n\n"
        "def main() -> int:\n"
        "    import json\n\n"
        "    from shardtrain.distributed import env\n\n"
        "    return len(json.dumps(env.__name__))\n"
    ),
}


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "shardtrain"
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def _layers(pkg: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardtrain.tools.layers", "--root", str(pkg)],
                          cwd=ROOT, capture_output=True, text=True)


def test_package_layers_clean():
    violations = check(ROOT / "shardtrain")
    assert violations == [], "\n".join(violations)


def test_planted_violations_are_caught(tmp_path):
    clean = _package(tmp_path / "clean", CLEAN)
    assert check(clean) == []
    proc = _layers(clean)
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout == "layers: 8 modules, 6 shardtrain imports, no violations\n"

    planted = {
        "upward": ({"config/schema.py": "\nfrom shardtrain.distributed.env import Env\n"},
                   ["shardtrain/config/schema.py:2: shardtrain.config.schema (config) imports "
                    "shardtrain.distributed.env (distributed): a lower layer must not import a higher one"]),
        "two-circle": ({"config/a.py": "from shardtrain.config import b\n",
                        "config/b.py": "from . import a\n"},
                       ["shardtrain/config/a.py:1: import circle: "
                        "shardtrain.config.a -> shardtrain.config.b -> shardtrain.config.a"]),
        "three-circle": ({"config/a.py": "import shardtrain.config.b\n",
                          "config/b.py": "import os\nfrom .c import X\n",
                          "config/c.py": "from shardtrain.config.a import Y\nX = 1\n"},
                         ["shardtrain/config/a.py:1: import circle: shardtrain.config.a -> "
                          "shardtrain.config.b -> shardtrain.config.c -> shardtrain.config.a"]),
        "lazy": ({"distributed/launch.py": (
                    "def run():\n"
                    "    if True:\n"
                    "        try:\n"
                    "            from shardtrain.config import loader\n"
                    "        finally:\n"
                    "            pass\n\n\n"
                    "class A:\n"
                    "    async def go(self):\n"
                    "        import signal\n")},
                 [f"shardtrain/distributed/launch.py:4: shardtrain.distributed.launch imports "
                  f"shardtrain.config.loader: {LAZY}",
                  f"shardtrain/distributed/launch.py:11: shardtrain.distributed.launch imports "
                  f"signal: {LAZY}"]),
        "no layer": ({"stray.py": "import os\n"},
                     ["shardtrain/stray.py:1: module shardtrain.stray is in no layer; "
                      "add it to LAYERS in shardtrain/tools/layers.py"]),
    }
    for name, (files, expected) in planted.items():
        pkg = _package(tmp_path / name, {**CLEAN, **files})
        assert check(pkg) == expected, name

    proc = _layers(tmp_path / "upward" / "shardtrain")
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == planted["upward"][1]


# What a run of the built-in model imports, in a fresh interpreter: training (and its checks before
# launch), generation, planning, inspecting and consolidating checkpoints.
BUILT_IN_RUN = """
import sys
import shardtrain.checkpoint.inspect, shardtrain.cli.preflight, shardtrain.export.consolidate
import shardtrain.generation.inference, shardtrain.train.loop, shardtrain.train.simulate
print(" ".join(sorted(m for m in ("transformers", "peft", "torchao") if m in sys.modules)))
"""


def test_built_in_runs_do_not_import_optional_libraries():
    """transformers, PEFT and torchao each add seconds to every process's start-up; only the runs
    that ask for them load them (model=hf: models/registry; finetune=lora: models/lora; qlora's
    NF4: distributed/qlora; strategy.float8: cli/main)."""
    proc = subprocess.run([sys.executable, "-c", BUILT_IN_RUN], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "", proc.stdout
