"""The general case: families beyond the two required ones (M-RoPE qwen2_5_vl, gemma3 with a
fixed image-token count and template-owned BOS) match mlx_vlm.generate alone and in a batch."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import chat_body, data_uri, images, start_server
from reference import mlx_vlm_text

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["qwen2_5_vl", "gemma3"])
def family_server(request):
    server = start_server(request.param)
    yield server
    server.stop()


def _cases():
    imgs = images()
    return [("Describe the picture.", []), ("What is in this image?", [imgs[1]]),
            ("Compare the two images.", [imgs[0], imgs[2]]), ("Name one colour.", [imgs[3]])]


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_family_matches_mlx_vlm_alone_and_batched(family_server):
    bodies = [chat_body(family_server.model_id, t, [data_uri(p) for p in ps], max_tokens=MAX_TOKENS, temperature=0)
              for t, ps in _cases()]

    async def run():
        async with httpx.AsyncClient(base_url=family_server.base_url, timeout=120) as c:
            alone = [_text(await c.post("/v1/chat/completions", json=b)) for b in bodies]
            together = [_text(r) for r in await asyncio.gather(*(c.post("/v1/chat/completions", json=b)
                                                                  for b in bodies))]
            return alone, together

    alone, together = asyncio.run(run())
    assert together == alone
    for (text, paths), got in zip(_cases(), alone):
        assert got == mlx_vlm_text(family_server, text, paths, MAX_TOKENS)
