"""Reuse for image requests by image content (issue: multi-turn image chats): a later turn about
the same image skips the vision tower and reuses the prompt's KV, images included, with the
tokens a server without any reuse gives; another image behind the same text reuses only the text
before it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from support.helpers import boxed_image_uri
from support.reference import mlx_vlm_chat_text
from support.server import chat_turns, start_server
from vlmserve.entrypoints.openai.chat_request import parse_chat_request
from vlmserve.protocol import ChatMessage

MAX_TOKENS = 12


def _image(colour) -> str:
    """A 112x84 PNG of one colour with a stripe: same size, different pixels per colour."""
    return boxed_image_uri((112, 84), colour, (10, 20, 60, 40), (255 - colour[0], colour[1], 90))


RED, BLUE = _image((200, 30, 30)), _image((30, 30, 200))


def _turn(text, image=None):
    parts = ([{"type": "image_url", "image_url": {"url": image}}] if image else []) + [{"type": "text", "text": text}]
    return {"role": "user", "content": parts}


def _chat(server, messages):
    return {"model": server.model_id, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}


async def _post(client, body):
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _run(server, bodies, concurrent=False):
    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            if concurrent:
                return await asyncio.gather(*(_post(c, b) for b in bodies))
            return [await _post(c, b) for b in bodies]

    return asyncio.run(go())


@pytest.fixture(scope="module", params=["qwen2_vl", "llava"])
def servers(request):
    """With reuse (a small prefix budget, so entries are also evicted) and without any. Qwen2-VL
    reuses its tower's features; LLaVA the image rows of its prompt embedding (image_rows.py)."""
    reuse = start_server(request.param, prefix_cache_tokens=600)
    strict = start_server(request.param, mm_cache=False)
    yield reuse, strict
    reuse.stop()
    strict.stop()


def _three_turns(server, image):
    """A 3-turn chat about one image, each turn sent after the previous answer."""
    return chat_turns(
        server, ("What is in the picture?", "What colour is the stripe?", "And the background?"), image, MAX_TOKENS
    )


def _text(reply):
    return reply["choices"][0]["message"]["content"]


def _cached(reply):
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def _answer_reused(server) -> int:
    """1 if a later turn reuses the KV of the earlier answer: LLaVA's template puts a space token
    between "ASSISTANT:" and the answer that its generation prompt ends without, so there the
    answer's tokens sit one position later and only the earlier prompt matches."""
    return int(server.engine.info.model_type != "llava")


def test_later_turns_reuse_the_image_and_answer_as_without_reuse(servers):
    reuse, strict = servers
    core = reuse.engine.core
    tower_runs = core.model.feature_cache.queries - core.model.feature_cache.hits
    with_reuse, without = _three_turns(reuse, RED), _three_turns(strict, RED)
    assert [_text(r) for r in with_reuse] == [_text(r) for r in without]
    assert [_cached(r) for r in without] == [0, 0, 0]
    # Turn 2 and 3 reuse the whole earlier prompt, the image's tokens included, and the KV of the
    # answer it gave (sent back as the assistant's turn) as far as the template renders it alike.
    for earlier, later in zip(with_reuse, with_reuse[1:]):
        assert _cached(later) >= earlier["usage"]["prompt_tokens"] + _answer_reused(reuse)
    # The tower ran once for the three turns.
    assert core.model.feature_cache.queries - core.model.feature_cache.hits == tower_runs + 1
    metrics = httpx.get(f"{reuse.base_url}/metrics").text
    hits = [
        x
        for x in metrics.splitlines()
        if x.startswith(("vlmserve:mm_prefix_cache_hits_total", "vlmserve:mm_feature_cache_hits_total"))
    ]
    assert len(hits) == 2 and all(float(x.rsplit(" ", 1)[1]) >= 2 for x in hits)
    usage = next(x for x in metrics.splitlines() if x.startswith("vlmserve:mm_prefix_cache_usage_perc{"))
    assert 0 < float(usage.rsplit(" ", 1)[1]) <= 1  # the turns' entries fill part of its budget


def test_another_image_behind_the_same_text_reuses_only_the_text_before_it(servers):
    reuse, strict = servers
    question = [_turn("Describe this picture in detail, please.", RED)]
    red = _run(reuse, [_chat(reuse, question)])[0]
    blue_body = _chat(reuse, [_turn("Describe this picture in detail, please.", BLUE)])
    blue = _run(reuse, [blue_body])[0]
    prompt = reuse.state.preprocessor.render(parse_chat_request(blue_body, reuse.config, {reuse.model_id}, 4096))
    ids = reuse.state.preprocessor.tokenizer(prompt)["input_ids"]
    before_image = ids.index(reuse.engine.info.image_token_id)
    assert _cached(blue) <= before_image  # same text and size, other pixels: nothing of the image
    assert _text(blue) == _text(_run(strict, [_chat(strict, blue_body["messages"])])[0])
    assert _text(red) == _text(_run(strict, [_chat(strict, question)])[0])


def test_batched_turns_with_reuse_answer_as_without(servers):
    reuse, strict = servers
    first = [_turn("What is in the picture?", image) for image in (RED, BLUE)]
    answers = _run(strict, [_chat(strict, [m]) for m in first])
    follow = [
        _chat(reuse, [m, {"role": "assistant", "content": _text(a)}, _turn(f"Say more about it, take {i}.")])
        for m, a in zip(first, answers)
        for i in range(3)
    ]
    _run(reuse, [_chat(reuse, [m]) for m in first])  # the first turns, cached
    together = _run(reuse, follow, concurrent=True)
    alone = _run(strict, [dict(b, model=strict.model_id) for b in follow])
    assert [_text(r) for r in together] == [_text(r) for r in alone]
    assert any(_cached(r) > 0 for r in together)


def test_questions_about_one_new_image_at_once_run_the_tower_once(servers, monkeypatch):
    """Eight different questions about one image, arriving together: one image through the tower."""
    import threading

    from vlmserve.models.qwen2_vl.adapter import QwenVLModel

    reuse, strict = servers
    images_seen = []
    if isinstance(reuse.engine.core.model, QwenVLModel):  # all new images of a step in one tower call
        tower = QwenVLModel._tower

        def counting(self, pixels, grid):
            images_seen.append(len(grid))
            return tower(self, pixels, grid)

        monkeypatch.setattr(QwenVLModel, "_tower", counting)
    else:  # one tower call per request
        tower_cls = type(reuse.engine.core.model.model.vision_tower)
        call = tower_cls.__call__

        def counting(self, *args, **kwargs):
            images_seen.append(1)
            return call(self, *args, **kwargs)

        monkeypatch.setattr(tower_cls, "__call__", counting)
    green = _image((30, 180, 40))
    bodies = [_chat(reuse, [_turn(f"Question {i}: what do you see?", green)]) for i in range(8)]

    async def together():
        gate = threading.Event()
        reuse.engine.worker.submit(gate.wait, 30)
        async with httpx.AsyncClient(base_url=reuse.base_url, timeout=120) as c:
            tasks = [asyncio.create_task(_post(c, b)) for b in bodies]
            while reuse.engine.core.num_waiting < len(bodies):
                await asyncio.sleep(0.005)
            gate.set()
            return await asyncio.gather(*tasks)

    features = reuse.engine.core.model.feature_cache
    queries, hits = features.queries, features.hits
    replies = asyncio.run(together())
    assert sum(images_seen) == 1
    # What the metrics say: 8 lookups, 7 of them skipped the tower (hits, or served by the one run).
    assert features.queries - queries == 8 and features.hits - hits == 7
    alone = _run(strict, [dict(b, model=strict.model_id) for b in bodies])
    assert [_text(r) for r in replies] == [_text(r) for r in alone]


def test_new_image_requests_do_not_take_a_hit_of_only_the_templates_opening(servers):
    """Every chat prompt opens alike, so a new image request always finds that much cached; such a
    short hit is not taken (it would make the row prefill alone, a forward of its own, instead of
    joining the batched prefill of new prompts), and the tokens are the strict server's."""
    reuse, strict = servers
    _run(reuse, [_chat(reuse, [_turn("Warm the cache with this picture.", RED)])])  # the opening is cached now
    text = "Describe the colours, the stripe and the layout of this picture in a few careful words."
    bodies = [
        _chat(reuse, [_turn(f"{text} Take {i}.", image)]) for i, image in enumerate((BLUE, _image((20, 160, 20))))
    ]
    replies = _run(reuse, bodies, concurrent=True)
    assert [_cached(r) for r in replies] == [0, 0]
    assert [_text(r) for r in replies] == [
        _text(r) for r in _run(strict, [_chat(strict, b["messages"]) for b in bodies])
    ]


def test_a_text_chat_reuses_the_answer_it_gave_and_answers_as_mlx_vlm(servers):
    reuse, _ = servers
    turns = [ChatMessage("user", [("text", "Tell me a story about the sea.")])]
    first = _run(reuse, [_chat(reuse, [{"role": "user", "content": "Tell me a story about the sea."}])])[0]
    messages = [
        {"role": "user", "content": "Tell me a story about the sea."},
        {"role": "assistant", "content": _text(first)},
        {"role": "user", "content": "And then?"},
    ]
    later = _run(reuse, [_chat(reuse, messages)])[0]
    assert _cached(later) >= first["usage"]["prompt_tokens"] + _answer_reused(reuse)
    turns += [ChatMessage("assistant", [("text", _text(first))]), ChatMessage("user", [("text", "And then?")])]
    assert _text(later) == mlx_vlm_chat_text(reuse, turns, [], MAX_TOKENS)


def test_requests_sharing_a_tower_run_count_as_feature_cache_hits(servers):
    """Several requests about one new image embedded in one call: the tower runs once, and the
    metrics say so (one miss, the others skipped the tower: hits)."""
    reuse, _ = servers
    st = reuse.state
    model = reuse.engine.core.model
    purple = _image((120, 40, 160))
    bodies = [_chat(reuse, [_turn(f"Question {i} about it.", purple)]) for i in range(3)]
    prepared = [
        asyncio.run(st.prepare(parse_chat_request(b, st.config, st.model_names, st.context_length)))[0] for b in bodies
    ]
    queries, hits = model.feature_cache.queries, model.feature_cache.hits
    reuse.on_worker(lambda: model.embed_prompts(prepared))
    assert model.feature_cache.queries - queries == 3
    assert model.feature_cache.hits - hits == 2


def test_reuse_after_an_idle_pool_shrinks_answers_as_without_and_no_block_is_left_held(servers):
    """Cached prefixes are blocks of the KV pool that rows share: after batched follow-ups, an
    idle pool's compaction (block ids renumbered) and more follow-ups, every answer equals the
    one without reuse, the pool holds exactly the blocks the caches hold, and none once they
    forget."""
    reuse, strict = servers
    core = reuse.engine.core
    first = [_turn("Describe the picture.", image) for image in (RED, BLUE)] + [_turn("Count to five in words.")]
    answers = _run(strict, [_chat(strict, [m]) for m in first])
    follow = [
        [m, {"role": "assistant", "content": _text(a)}, _turn(f"Tell me more, part {i}.")]
        for m, a in zip(first, answers)
        for i in range(2)
    ]
    expected = [_text(r) for r in _run(strict, [_chat(strict, f) for f in follow])]
    _run(reuse, [_chat(reuse, [m]) for m in first])
    together = _run(reuse, [_chat(reuse, f) for f in follow], concurrent=True)

    def held():
        pools = list(core.runner.batches.pools.values())
        cached = sum(c.blocks_held() for c in (core.prefix_cache, core.runner.mm_prefix_cache) if c is not None)
        return sum(p.used for p in pools), cached, core.sched.kv_budget.used

    reuse.engine.worker.submit(core.runner.release_memory).result(30)  # idle: the pool shrinks
    after_idle = _run(reuse, [_chat(reuse, f) for f in follow])
    counts = reuse.engine.worker.submit(held).result(30)
    reuse.engine.worker.submit(core.forget_prefixes).result(30)
    forgotten = reuse.engine.worker.submit(held).result(30)
    assert [_text(r) for r in together] == expected
    assert [_text(r) for r in after_idle] == expected
    assert any(_cached(r) > 0 for r in after_idle)
    used, cached, budget_used = counts
    assert used == cached > 0 and budget_used == 0
    assert forgotten == (0, 0, 0)
