"""The server's processes load the model's processor without importing torch, even where torch
is installed (transformers would import it: seconds of start-up on a CUDA machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "qwen2_vl"

PROBE = """
import sys
from pathlib import Path
from vlmserve.torchless import keep_torch_out
if sys.argv[1] == "hide":
    keep_torch_out()
from vlmserve.models.processor import load_processor
processor = load_processor(Path(sys.argv[2]))
print("loaded", type(processor).__name__, sys.modules.get("torch"))
"""


def _installed_torch(root: Path) -> Path:
    """A stand-in torch package, as pip installs one (with metadata), that fails when imported."""
    site = root / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("raise RuntimeError('torch was imported')\n")
    dist = site / "torch-2.9.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.0\n")
    return site


def _probe(site: Path, mode: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "VLMSERVE_IMPORT_TORCH"}
    environ["PYTHONPATH"] = os.pathsep.join([str(site), *sys.path[1:]])
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(FIXTURE)], capture_output=True, text=True, env=environ, timeout=300
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return _installed_torch(tmp_path_factory.mktemp("torch"))


def test_the_processor_loads_with_torch_kept_out(site):
    done = _probe(site, "hide")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded" in done.stdout and done.stdout.strip().endswith("None")


def test_without_it_transformers_imports_an_installed_torch(site):
    # What keep_torch_out prevents: the stand-in is found and imported.
    done = _probe(site, "plain")
    assert done.returncode != 0 and "torch was imported" in done.stderr


def test_an_operator_can_let_torch_in(site):
    done = _probe(site, "hide", VLMSERVE_IMPORT_TORCH="1")
    assert done.returncode != 0 and "torch was imported" in done.stderr
