"""The compile rehearsal's side process (engine/compile_rehearsal.py main) on the embedded
fixture: it loads the model as the engine does, waits for the warm-up prompts, warms up and
exits cleanly, and the engine's side files what it wrote and leaves the marker."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from vlmserve.config import DEFAULT_MODEL_DIR, ServerConfig
from vlmserve.engine import compile_rehearsal, kernel_staging
from vlmserve.engine.ops.cuda_kernels import on_cuda
from vlmserve.protocol import PreparedRequest


@pytest.mark.slow
def test_the_side_process_warms_the_model_up_and_exits(tmp_path, monkeypatch):
    cache = tmp_path / "ptx"
    cache.mkdir()
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(cache))
    monkeypatch.delenv("MLX_DISABLE_COMPILE", raising=False)
    monkeypatch.setattr(compile_rehearsal.mx, "disable_compile", lambda: None)  # this test process stays as it is
    config = ServerConfig(model=str(DEFAULT_MODEL_DIR), max_num_seqs=4, prefill_chunk=64, prefill_bucket=32)
    rehearsal = compile_rehearsal.start(DEFAULT_MODEL_DIR, "qwen2_vl", config)
    assert rehearsal is not None
    time.sleep(0.5)
    assert not rehearsal.done()  # loaded, it waits for the engine's warm-up prompts
    rehearsal.hand_over([PreparedRequest(prompt_ids=np.arange(3, 40, dtype=np.int32))])
    deadline = time.monotonic() + 240
    while not rehearsal.done() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rehearsal.build.proc.returncode == 0, rehearsal.build.proc.stderr.read().decode(errors="replace")[-2000:]
    assert rehearsal.finish()
    assert json.loads(rehearsal.marker.read_text())["ok"] is True
    assert list(kernel_staging.staging_root(cache).iterdir()) == []
    if on_cuda():  # MLX files kernels on CUDA only: the fused ones the warm-up compiled are in the cache now
        # (a fused module is named by its graph, from an upper-case letter on; MLX's others by op)
        fused = [p.name for p in cache.glob("*.ptx") if p.name[0].isupper()]
        assert fused, sorted(p.name for p in cache.glob("*"))
