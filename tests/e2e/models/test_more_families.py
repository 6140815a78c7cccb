"""The general case: families beyond the two required ones (M-RoPE qwen2_5_vl, gemma3 with a
fixed image-token count and template-owned BOS) match mlx_vlm.generate alone and in a batch."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from support.helpers import chat_body, data_uri, greedy_bodies, images
from support.reference import mlx_vlm_text
from support.server import start_server
from vlmserve.models.qwen2_vl import adapter as qwen_adapter

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["qwen2_5_vl", "gemma3"])
def family_server(request):
    server = start_server(request.param)
    yield server
    server.stop()


def _cases():
    imgs = images()
    return [
        ("Describe the picture.", []),
        ("What is in this image?", [imgs[1]]),
        ("Compare the two images.", [imgs[0], imgs[2]]),
        ("Name one colour.", [imgs[3]]),
    ]


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_family_matches_mlx_vlm_alone_and_batched(family_server):
    bodies = greedy_bodies(family_server.model_id, _cases(), MAX_TOKENS)

    async def run():
        async with httpx.AsyncClient(base_url=family_server.base_url, timeout=120) as c:
            alone = [_text(await c.post("/v1/chat/completions", json=b)) for b in bodies]
            together = [
                _text(r) for r in await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))
            ]
            return alone, together

    alone, together = asyncio.run(run())
    assert together == alone
    for (text, paths), got in zip(_cases(), alone):
        assert got == mlx_vlm_text(family_server, text, paths, MAX_TOKENS)


def test_images_of_several_requests_share_one_vision_call(family_server, monkeypatch):
    """embed_prompts (the scheduler's path for requests admitted together) gives each request the
    embeddings and M-RoPE positions it gets alone; grid towers encode all images in one call, or in
    one call per request when TOWER_PATCHES bounds each call to less than any two images."""
    import numpy as np

    from vlmserve.entrypoints.openai.chat_request import parse_chat_request

    st = family_server.state
    bodies = [chat_body(family_server.model_id, t, [data_uri(p) for p in ps], max_tokens=4) for t, ps in _cases()]
    prepared = [
        asyncio.run(st.prepare(parse_chat_request(b, st.config, st.model_names, st.context_length)))[0] for b in bodies
    ]
    vlm = st.engine.core.model

    def compare():
        import mlx.core as mx

        # Every tower call, mlx_vlm's or one built on the host (models/qwen2_vl/embedding.py), embeds
        # its patches once.
        tower = vlm.model.vision_tower
        tower_cls = type(getattr(tower, "patch_embed", tower))
        calls = []
        original = tower_cls.__call__

        def counting(self, *args, **kwargs):
            calls.append(1)
            return original(self, *args, **kwargs)

        tower_cls.__call__ = counting
        features, vlm.feature_cache = vlm.feature_cache, None  # earlier requests cached these images
        try:
            together = vlm.embed_prompts(prepared)
            n_together = len(calls)
            alone = [vlm.embed_prompt(p) for p in prepared]
            n_alone = len(calls) - n_together
            monkeypatch.setattr(qwen_adapter, "TOWER_PATCHES", 1)  # every image past the bound: a call each
            split = vlm.embed_prompts(prepared)
            n_split = len(calls) - n_together - n_alone
        finally:
            tower_cls.__call__ = original
            vlm.feature_cache = features
        rows = []
        for a, b in [*zip(together, alone), *zip(split, alone)]:
            pos = (None, None) if a.position_ids is None else (np.array(a.position_ids), np.array(b.position_ids))
            rows.append(
                (
                    np.array(a.embeds.astype(mx.float32)),
                    np.array(b.embeds.astype(mx.float32)),
                    a.position_offset,
                    b.position_offset,
                    *pos,
                )
            )
        return n_together, n_alone, n_split, rows

    n_together, n_alone, n_split, rows = family_server.on_worker(compare)
    assert n_alone == 3  # three of the four requests carry images
    if family_server.state.engine.info.model_type in ("qwen2_vl", "qwen2_5_vl"):
        assert n_together == 1 and n_split == 3
    for emb_t, emb_a, delta_t, delta_a, pos_t, pos_a in rows:
        np.testing.assert_allclose(emb_t, emb_a, rtol=1e-5, atol=1e-5)
        assert delta_t == delta_a
        if pos_t is not None:
            np.testing.assert_array_equal(pos_t, pos_a)
