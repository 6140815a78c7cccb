"""A model whose per-request caches mlx-lm cannot merge is served one request at a time."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from support.helpers import chat_body, data_uri, images
from support.reference import mlx_vlm_text
from support.server import start_server

pytestmark = pytest.mark.slow

MAX_TOKENS = 12


def test_model_whose_caches_cannot_merge_serves_one_at_a_time(monkeypatch, caplog):
    from mlx_lm.models.cache import ConcatenateKVCache
    from mlx_vlm.models import cache as vlm_cache

    real = vlm_cache.make_prompt_cache
    # ConcatenateKVCache has no `merge`: the language model then cannot decode rows together.
    monkeypatch.setattr(
        vlm_cache, "make_prompt_cache", lambda model, *a, **k: [ConcatenateKVCache() for _ in real(model, *a, **k)]
    )
    caplog.set_level(logging.WARNING, logger="vlmserve")
    server = start_server("llava", max_num_seqs=4)
    try:
        assert server.engine.core.sched.max_num_seqs == 1
        assert any("one request at a time" in r.getMessage() for r in caplog.records)
        cases = [("Describe this image.", [images()[0]]), ("Write a poem.", []), ("What is it?", [images()[1]])]
        bodies = [
            chat_body(server.model_id, text, [data_uri(p) for p in paths], max_tokens=MAX_TOKENS, temperature=0)
            for text, paths in cases
        ]

        async def together():
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
                return await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))

        responses = asyncio.run(together())
        assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses]
        got = [r.json()["choices"][0]["message"]["content"] for r in responses]
        assert got == [mlx_vlm_text(server, text, paths, MAX_TOKENS) for text, paths in cases]
    finally:
        server.stop()
