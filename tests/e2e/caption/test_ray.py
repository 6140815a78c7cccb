"""`vlmserve caption --ray` on a two-node Ray cluster on this machine (`ray start --head`, then a
second node joining it): the captions equal the plain tool's greedy ones, Parquet and JSONL, and
a resumed run skips what is written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.helpers import MODELS, free_port

pytest.importorskip("ray")
pyarrow_parquet = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.slow
IMAGES = Path(__file__).parents[3] / "fixtures" / "images"
# A throwaway cluster on loopback: no token authentication (Ray's default asks every process for one).
RAY_ENV = {"RAY_DISABLE_USAGE_STATS": "1", "RAY_AUTH_MODE": "disabled"}
COMMON = ["--in-process", str(MODELS / "qwen2_vl"), "--max-tokens", "8", "--temperature", "0", "-q"]


def _ray_cli() -> str:
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else shutil.which("ray")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head node and a second node, one CPU each, on this machine; its address."""
    ray = _ray_cli()
    env = {**os.environ, **RAY_ENV}
    temp = tmp_path_factory.mktemp("ray")
    for _ in range(2):  # a busy machine can make the head miss Ray's own start-up deadline
        port = str(free_port())
        head = [ray, "start", "--head", "--port", port, "--num-cpus", "1", "--temp-dir", str(temp)]
        started = subprocess.run(
            [*head, "--include-dashboard=false"], env=env, capture_output=True, text=True, timeout=120
        )
        if started.returncode == 0:
            break
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)
    assert started.returncode == 0, started.stderr[-3000:] + started.stdout[-2000:]
    try:
        address = f"127.0.0.1:{port}"
        subprocess.run(
            [ray, "start", "--address", address, "--num-cpus", "1"],
            check=True,
            env=env,
            capture_output=True,
            timeout=120,
        )
        yield address
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)


def _caption(*argv, env_extra=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **RAY_ENV, **(env_extra or {})}
    cmd = [sys.executable, "-m", "vlmserve.caption", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _captions_jsonl(path: Path) -> dict:
    return {r["path"]: r["caption"] for r in map(json.loads, path.read_text().splitlines())}


def test_two_node_cluster_captions_like_the_plain_tool(cluster, tmp_path):
    plain = tmp_path / "plain.jsonl"
    assert _caption(str(IMAGES), "-o", str(plain), *COMMON).returncode == 0
    expected = _captions_jsonl(plain)
    assert len(expected) == 6 and all(expected.values())

    out = tmp_path / "ray.parquet"
    run = _caption(str(IMAGES), "-o", str(out), "--ray", cluster, "--num-replicas", "2", "--batch-size", "1", *COMMON)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = pyarrow_parquet.read_table(out).to_pylist()
    assert {r["path"]: r["caption"] for r in rows} == expected
    # Each row names the engine that captioned it. (Which actors took images is Ray's choice: the
    # first actor ready may caption all six before the other has loaded its model.)
    assert all(r["server"].startswith("http://127.0.0.1:") for r in rows)

    # Resume: drop two rows from a JSONL output; only those two are captioned again.
    jsonl = tmp_path / "ray.jsonl"
    lines = plain.read_text().splitlines()
    jsonl.write_text("\n".join(lines[:4]) + "\n")
    run = _caption(str(IMAGES), "-o", str(jsonl), "--ray", cluster, "--resume", *COMMON)
    assert run.returncode == 0, run.stderr[-3000:]
    assert _captions_jsonl(jsonl) == expected
    assert [json.loads(x)["server"] for x in jsonl.read_text().splitlines()[:4]] == [
        json.loads(x)["server"] for x in lines[:4]
    ]  # the rows already written were kept as they were
