"""A model whose prefill runs a prompt's last position too (`samples_in_prefill`: the Qwen
family's own prompt forward on CUDA) takes each request's first token from that forward: alone,
in a batched group, in a piece after a cached prefix; a request that ends on its first token
never decodes. Forced on here, on any backend: the answers are the ones the decode step gives."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from support.helpers import IMAGES, chat_body, data_uri
from support.server import start_server

MAX_TOKENS = 10
IMAGE = data_uri(sorted(IMAGES.glob("*.png"))[0])


@pytest.fixture(scope="module")
def servers():
    """The same model with the first token from prefill (forced) and from the first decode step."""
    folded, plain = start_server("qwen2_vl"), start_server("qwen2_vl")
    folded.engine.core.model.samples_in_prefill = True
    plain.engine.core.model.samples_in_prefill = False  # on CUDA it is on by default
    yield folded, plain
    folded.stop()
    plain.stop()


def _ask(server, bodies, concurrent=False):
    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:

            async def post(body):
                r = await client.post("/v1/chat/completions", json={**body, "model": server.model_id})
                assert r.status_code == 200, r.text
                return r.json()

            if concurrent:
                return await asyncio.gather(*(post(b) for b in bodies))
            return [await post(b) for b in bodies]

    return asyncio.run(go())


def _answers(replies):
    return [(r["choices"][0]["message"]["content"], r["usage"]["completion_tokens"]) for r in replies]


def test_alone_and_together_answers_are_the_decode_steps(servers):
    folded, plain = servers
    bodies = [
        chat_body(
            "m",
            f"Question {i}: what do you see? " + "word " * (7 * i),
            [IMAGE] if i % 2 else [],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        for i in range(5)
    ]
    steps = {}
    for name, server in (("folded", folded), ("plain", plain)):
        before = server.engine.core.runner.stats.decode_steps
        steps[name] = (_answers(_ask(server, bodies[:1])), server.engine.core.runner.stats.decode_steps - before)
    assert steps["folded"][0] == steps["plain"][0]
    assert steps["folded"][1] == steps["plain"][1] - 1  # its first token came from the prefill
    together = _ask(folded, bodies, concurrent=True)
    assert _answers(together) == _answers(_ask(plain, bodies))


def test_a_later_turn_after_a_cached_prefix_answers_as_the_decode_step(servers):
    folded, plain = servers
    first = chat_body("m", "Describe the picture.", [IMAGE], max_tokens=MAX_TOKENS, temperature=0)
    answer = _ask(plain, [first])[0]["choices"][0]["message"]["content"]
    later = dict(
        first,
        messages=first["messages"]
        + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the colours?"}],
    )
    for server in (folded, plain):
        _ask(server, [first])  # the first turn, cached
    replies = {name: _ask(server, [later])[0] for name, server in (("folded", folded), ("plain", plain))}
    assert _answers([replies["folded"]]) == _answers([replies["plain"]])
    assert replies["folded"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_request_that_ends_on_its_first_token_never_decodes(servers):
    folded, _ = servers
    steps = folded.engine.core.runner.stats.decode_steps
    replies = _ask(
        folded,
        [chat_body("m", f"One word {i}.", max_tokens=1, temperature=0, logprobs=True) for i in range(3)],
        concurrent=True,
    )
    for reply in replies:
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 1
        assert len(choice["logprobs"]["content"]) == 1
    assert folded.engine.core.runner.stats.decode_steps == steps
    assert folded.engine.core.num_running == 0 and not folded.engine.core.sched.prefilling
