"""Repository hygiene: CI runs the README's test command, and the code is ruff clean."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    quickstart = [b.strip() for b in blocks[:2]]
    assert len(quickstart) == 2 and all("\n" not in b for b in quickstart)
    assert quickstart[0].endswith("shardtrain train")
    assert quickstart[1] in (ROOT / ".ci" / "run").read_text()


def test_ruff_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is part of the test extra: pip install -e '.[test]'"
    proc = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_configuration_reference_lists_every_key():
    from shardtrain.config.keys import schema_keys

    text = (ROOT / "docs" / "configuration.md").read_text()
    from shardtrain.config.keys import ALIASES

    alias_of = {v: k for k, v in ALIASES.items()}
    leaves = [alias_of.get(k, k) for k, f in schema_keys().items() if "." in k]
    missing = [k for k in leaves if f"`{k}`" not in text]
    assert not missing, f"docs/configuration.md does not document {missing}"
