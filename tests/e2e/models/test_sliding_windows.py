"""A model that masks its sliding-window layers itself (Gemma 3) serves them from plain caches:
the paged pool, a KV budget, pieces and whole prompts prefilled together. With a window far
shorter than the prompts, greedy output still equals mlx_vlm.generate's through the model's own
rotating caches (support.reference runs it so), alone and batched."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import pytest

from support.helpers import MODELS, greedy_bodies, images
from support.reference import mlx_vlm_text, own_caches
from support.server import start_server

WINDOW = 12  # positions a sliding layer sees: every prompt below is longer
CHUNK = 32  # the prefill chunk: the short prompts fit whole, the long ones go in pieces
MAX_TOKENS = 12
WORDS = " ".join(f"item{i}" for i in range(90))


@pytest.fixture(scope="module")
def window_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("windows") / "gemma3"
    shutil.copytree(MODELS / "gemma3", path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["sliding_window"] = WINDOW
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def window_server(window_model):
    """No reuse across requests: each run prefills every prompt (together: in shared forwards)."""
    server = start_server(str(window_model), prefill_chunk=CHUNK, max_num_seqs=8, prefix_cache_tokens=0, mm_cache=False)
    yield server.wait_warm()
    server.stop()


def _cases():
    imgs = images()
    return [
        ("List them back: " + WORDS, []),
        ("Describe the picture, then repeat: " + WORDS[:300], [imgs[1]]),
        ("Count: " + WORDS[:200], []),
        ("Compare the two pictures. " + WORDS[:150], [imgs[0], imgs[2]]),
        ("Name a colour of the sea.", []),
        ("Say something about birds.", []),
    ]


def _spy(model, name: str) -> list[int]:
    """The row count of each call of model.<name> from now on."""
    rows: list[int] = []
    method = getattr(model, name)

    def spy(states, *args, **kwargs):
        rows.append(len(states))
        return method(states, *args, **kwargs)

    setattr(model, name, spy)
    return rows


def test_the_sliding_window_layers_take_the_paged_pool_and_a_kv_budget(window_server):
    from mlx_vlm.models.cache import KVCache, RotatingKVCache

    core = window_server.engine.core
    language_model = core.model.language_model
    assert all(type(c) is KVCache for c in window_server.on_worker(language_model.make_cache))
    with own_caches(language_model):
        own = window_server.on_worker(language_model.make_cache)
    assert any(type(c) is RotatingKVCache for c in own) and own[0].max_size == WINDOW
    assert core.runner.batches.paged and core.model.prefills_pieces
    assert core.runner.budget.total < 1 << 30  # a budget from the device's memory, not "none"


def test_greedy_equals_mlx_vlm_through_rotating_caches_alone_and_batched(window_server):
    bodies = greedy_bodies(window_server.model_id, _cases(), MAX_TOKENS)

    async def run():
        async with httpx.AsyncClient(base_url=window_server.base_url, timeout=120) as c:

            async def answer(body):
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()

            alone = [await answer(b) for b in bodies]
            # The worker held meanwhile: every request waits, and one step admits them all.
            held = asyncio.create_task(asyncio.to_thread(window_server.on_worker, time.sleep, 1.0))
            together = list(await asyncio.gather(*(answer(b) for b in bodies)))
            await held
            return alone, together

    model = window_server.engine.core.model
    pieces, groups = _spy(model, "prefill_pieces"), _spy(model, "prefill_batch")
    try:
        alone, together = asyncio.run(run())
    finally:
        del model.prefill_pieces, model.prefill_batch
    assert all(a["usage"]["prompt_tokens"] > WINDOW for a in alone)
    assert any(n >= 2 for n in pieces) and any(n >= 2 for n in groups)  # both shared forwards ran
    texts = [a["choices"][0]["message"]["content"] for a in alone]
    assert [t["choices"][0]["message"]["content"] for t in together] == texts
    assert texts == [mlx_vlm_text(window_server, t, ps, MAX_TOKENS) for t, ps in _cases()]


def test_prompt_kv_reused_past_the_window_gives_the_same_tokens(window_model):
    """The second time, each prompt's KV comes from the prefix caches (cached_tokens), then its
    sliding layers attend through the window over that reused KV. (The KV pool starts at
    max_num_seqs rows of two chunks: room for every prompt's cached blocks at once.)"""
    server = start_server(str(window_model), prefill_chunk=CHUNK, max_num_seqs=64)
    try:
        bodies = greedy_bodies(server.model_id, _cases(), MAX_TOKENS)
        with server.client() as c:
            answers = [[c.post("/v1/chat/completions", json=b).json() for b in bodies] for _ in range(2)]
        first, second = ([a["choices"][0]["message"]["content"] for a in run] for run in answers)
        assert second == first == [mlx_vlm_text(server, t, ps, MAX_TOKENS) for t, ps in _cases()]
        cached = [a["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for a in answers[1]]
        assert all(n > WINDOW for n in cached), cached
    finally:
        server.stop()
