"""Ministral 3's forward traces into the compiled decode step (models/mistral3/adapter.py: each
row's query scale comes from its own positions, with no read-back of row 0's), and the compiled
step gives the eager one's tokens for rows at different positions, past the rope's original
length (16 positions in the test checkpoint)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from support.families import session_checkpoint
from support.helpers import chat_body
from support.server import start_server

pytestmark = pytest.mark.slow


def test_the_compiled_decode_step_traces_and_matches_eager(tmp_path_factory):
    path = str(session_checkpoint("ministral3", "float32", tmp_path_factory))
    settings = dict(max_num_seqs=4, prefix_cache_tokens=0)
    compiled = start_server(path, compile_decode="on", **settings)
    eager = start_server(path, compile_decode="off", **settings)
    try:
        texts = ["Hi.", "Tell me about the sea and the sky.", "One two three four five six seven eight nine.", "Why?"]

        async def run(server):
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
                bodies = [chat_body(server.model_id, t, [], max_tokens=12, temperature=0) for t in texts]
                outs = await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))
                assert all(r.status_code == 200 for r in outs)
                return [r.json()["choices"][0]["message"]["content"] for r in outs]

        assert asyncio.run(run(compiled)) == asyncio.run(run(eager))
        step = compiled.engine.core.runner.batches.step
        assert step.compiled is not None and step.traced  # traced, not fallen back to eager
    finally:
        compiled.stop()
        eager.stop()
