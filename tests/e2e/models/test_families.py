"""Every family scripts/make_fixtures.py builds, in float32 and 4-bit with bfloat16 scales: the
server starts, greedy output equals mlx_vlm.generate (three image sizes, text only, two images
in one message, a 3-turn chat with an image), and concurrent requests equal their alone outputs."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from support.families import FORMATS, checkpoint, families, make_fixtures
from support.helpers import IMAGES, data_uri
from support.reference import mlx_vlm_chat_text
from support.server import start_server
from vlmserve.protocol import ChatMessage, ImageRef

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
# Seconds a server may take to start, and a request to finish: a big family's vision tower
# takes ~40 s an image on a 2-core CPU, and its warm-up and 8 concurrent image requests wait on it.
TIMEOUT, BIG_TIMEOUT = 120, 1800
SMALL, PHOTO, WIDE = (IMAGES / n for n in ("small_64x48.png", "photo_100x80.jpg", "large_224x160.jpg"))

# name -> turns; a turn is (role, text, images). The last turn is the user's.
CASES = {
    "small-image": [("user", "Describe this image.", [SMALL])],
    "photo": [("user", "What is in the picture?", [PHOTO])],
    "wide-image": [("user", "Name the colours you see.", [WIDE])],
    "text-only": [("user", "Write a short poem about the sea.", [])],
    "two-images": [("user", "Compare the two pictures.", [SMALL, WIDE])],
    "three-turn-chat": [
        ("user", "What is this?", [PHOTO]),
        ("assistant", "A small picture with a few colours.", []),
        ("user", "Which colour is on the left?", []),
        ("assistant", "Mostly dark on the left.", []),
        ("user", "And on the right?", []),
    ],
}


def _body(model: str, turns) -> dict:
    messages = []
    for role, text, paths in turns:
        if role == "user" and paths:
            content = [{"type": "image_url", "image_url": {"url": data_uri(p)}} for p in paths]
            messages.append({"role": role, "content": [*content, {"type": "text", "text": text}]})
        else:
            messages.append({"role": role, "content": text})
    return {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}


def _chat(turns) -> tuple[list[ChatMessage], list]:
    messages, paths = [], []
    for role, text, images in turns:
        parts = [("image", ImageRef(str(p), "x")) for p in images] + [("text", text)]
        messages.append(ChatMessage(role, parts))
        paths.extend(images)
    return messages, paths


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module", params=[(f, fmt) for f in families() for fmt in FORMATS], ids="-".join)
def family_server(request, tmp_path_factory):
    name, fmt = request.param
    cache_dir = tmp_path_factory.getbasetemp() / "families"
    cache_dir.mkdir(exist_ok=True)
    timeout = BIG_TIMEOUT if name in make_fixtures().NOT_TINY else TIMEOUT
    server = start_server(str(checkpoint(name, fmt, cache_dir)), start_timeout=timeout)
    server.request_timeout = timeout
    yield server
    server.stop()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_mlx_vlm_generate(family_server, case):
    turns = CASES[case]
    with family_server.client(timeout=family_server.request_timeout) as c:
        response = c.post("/v1/chat/completions", json=_body(family_server.model_id, turns))
    limit = family_server.state.max_images
    if sum(len(images) for _, _, images in turns) > limit:  # the model reads fewer: refused, not dropped
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_image"
        return
    got = _text(response)
    messages, paths = _chat(turns)
    expected = mlx_vlm_chat_text(family_server, messages, paths, MAX_TOKENS)
    assert got == expected


def test_concurrent_mixed_requests_equal_their_alone_outputs(family_server):
    limit = family_server.state.max_images
    bodies = [_body(family_server.model_id, t) for t in CASES.values() if sum(len(i) for _, _, i in t) <= limit]
    bodies = (bodies * 2)[:8]  # 8 requests

    async def run():
        async with httpx.AsyncClient(base_url=family_server.base_url, timeout=family_server.request_timeout) as c:
            alone = [_text(await c.post("/v1/chat/completions", json=b)) for b in bodies]
            together = await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))
            return alone, [_text(r) for r in together]

    alone, together = asyncio.run(run())
    assert together == alone


def test_a_later_turn_about_an_image_answers_as_mlx_vlm(family_server):
    """The first turn leaves its prompt (image included) in the server's caches; the next turn,
    which reuses them where the family allows (cached_tokens), still answers as mlx_vlm.generate
    does without any reuse."""
    first = [("user", "What is in the picture?", [PHOTO])]
    turns = [*first, ("assistant", "A small picture with a few colours.", []), ("user", "Say more about it.", [])]
    features = family_server.engine.core.model.feature_cache
    with family_server.client(timeout=family_server.request_timeout) as c:
        _text(c.post("/v1/chat/completions", json=_body(family_server.model_id, first)))
        hits = features.hits
        later = c.post("/v1/chat/completions", json=_body(family_server.model_id, turns))
    messages, paths = _chat(turns)
    assert _text(later) == mlx_vlm_chat_text(family_server, messages, paths, MAX_TOKENS)
    model = family_server.engine.core.model
    qwen = model.info.model_type in ("qwen2_vl", "qwen2_5_vl")  # their own feature path
    assert qwen or model.image_rows.works is not None  # the first image prompt checked the row reuse
    if qwen or model.image_rows.works:
        assert features.hits == hits + 1  # the later turn did not run the vision tower
    if family_server.engine.info.model_type in ("qwen2_vl", "qwen2_5_vl"):
        assert later.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
