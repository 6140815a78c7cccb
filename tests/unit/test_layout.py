"""The layout rules of docs/design.md: the generic layers name no model family, and the import
contracts in pyproject.toml ([tool.importlinter]) hold."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.helpers import ROOT

# Layers that serve every family alike: a family's code lives under models/<family>/.
GENERIC_LAYERS = ["entrypoints", "inputs", "engine/sched", "engine/runner"]
FAMILY_NAMES = re.compile(
    r"qwen|gemma|llava|idefics|smolvlm|paligemma|pixtral|mistral|internvl|glm|kimi|lfm2|phi3", re.IGNORECASE
)


def test_generic_layers_name_no_model_family():
    hits = []
    for layer in GENERIC_LAYERS:
        for path in sorted((ROOT / "src" / "vlmserve" / layer).rglob("*.py")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if FAMILY_NAMES.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, f"{len(hits)} model family names in the generic layers:\n" + "\n".join(hits)


def _lint_imports() -> str | None:
    beside_python = Path(sys.executable).with_name("lint-imports")
    return str(beside_python) if beside_python.exists() else shutil.which("lint-imports")


def test_import_contracts_hold():
    exe = _lint_imports()
    if exe is None:
        pytest.skip("lint-imports (import-linter) is not installed")
    proc = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
