"""A model that masks its sliding-window layers itself (Gemma 3) serves them from plain caches:
the paged pool, a KV budget, pieces prefilled together. With a window far shorter than the
prompts, greedy output still equals mlx_vlm.generate's through the model's own rotating caches,
alone and batched."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil

import httpx
import pytest

from support.helpers import MODELS, chat_body, data_uri, images
from support.reference import mlx_vlm_text
from support.server import start_server

WINDOW = 24  # positions a sliding layer sees: every prompt below is longer
MAX_TOKENS = 12
WORDS = " ".join(f"item{i}" for i in range(90))


@pytest.fixture(scope="module")
def window_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("windows") / "gemma3"
    shutil.copytree(MODELS / "gemma3", path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["sliding_window"] = WINDOW
    (path / "config.json").write_text(json.dumps(config))
    server = start_server(str(path), prefill_chunk=32, max_num_seqs=8)
    yield server.wait_warm()
    server.stop()


@contextlib.contextmanager
def _rotating_caches(server):
    """mlx_vlm.generate on the model's own caches (RotatingKVCache for the sliding layers), not the
    plain ones the engine swapped in."""
    language_model = server.engine.core.model.language_model
    plain = language_model.make_cache
    del language_model.make_cache  # the class's own
    try:
        yield
    finally:
        language_model.make_cache = plain


def _cases():
    imgs = images()
    return [
        ("List them back: " + WORDS, []),
        ("Describe the picture, then repeat: " + WORDS[:300], [imgs[1]]),
        ("Count: " + WORDS[:200], []),
        ("Compare the two pictures. " + WORDS[:150], [imgs[0], imgs[2]]),
    ]


def test_the_sliding_window_layers_take_the_paged_pool_and_a_kv_budget(window_server):
    from mlx_vlm.models.cache import KVCache, RotatingKVCache

    core = window_server.engine.core
    language_model = core.model.language_model
    made = window_server.on_worker(language_model.make_cache)
    assert all(type(c) is KVCache for c in made)
    with _rotating_caches(window_server):
        own = window_server.on_worker(language_model.make_cache)
    assert any(type(c) is RotatingKVCache for c in own) and own[0].max_size == WINDOW
    assert core.runner.batches.paged and core.model.prefills_pieces
    assert core.runner.budget.total < 1 << 30  # a budget from the device's memory, not "none"


def test_greedy_equals_mlx_vlm_through_rotating_caches_alone_and_batched(window_server):
    bodies = [
        chat_body(window_server.model_id, t, [data_uri(p) for p in ps], max_tokens=MAX_TOKENS, temperature=0)
        for t, ps in _cases()
    ]

    async def run():
        async with httpx.AsyncClient(base_url=window_server.base_url, timeout=120) as c:

            async def text(body):
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["message"]["content"]

            alone = [await text(b) for b in bodies]
            together = list(await asyncio.gather(*(text(b) for b in bodies)))
            return alone, together

    alone, together = asyncio.run(run())
    assert together == alone
    with _rotating_caches(window_server):
        reference = [mlx_vlm_text(window_server, t, ps, MAX_TOKENS) for t, ps in _cases()]
    assert alone == reference
