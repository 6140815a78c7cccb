"""A model whose layers keep state beside their KV reuses only whole cached prompts. Where its
chat template ends the generation prompt with what the next turn's history renders otherwise
(Qwen3.5's opens the thinking; the answer goes back without it), the prefill stops once where
the two part, so that the row's state there is cached too: a later turn resumes the earlier
prompt up to that point and answers as a server without reuse."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from support.families import session_checkpoint
from support.helpers import boxed_image_uri
from support.server import chat_turns, start_server
from vlmserve.entrypoints.openai.chat_request import parse_chat_request

pytestmark = pytest.mark.slow

QUESTIONS = ("Describe the scene in a few words, please, and say what stands out. " * 4, "Why?", "And then?")


def _image() -> str:
    return boxed_image_uri((224, 224), (40, 160, 40), (40, 40, 120, 120), (200, 30, 30))


def _turns(server, image: str | None) -> list[dict]:
    return chat_turns(server, QUESTIONS, image, max_tokens=6)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = str(session_checkpoint("qwen3_5", "float32", tmp_path_factory))
    reuse = start_server(model, warmup_image_sizes=())
    strict = start_server(model, warmup_image_sizes=(), prefix_cache_tokens=0, mm_cache=False)
    yield reuse, strict
    reuse.stop()
    strict.stop()


@pytest.mark.parametrize("with_image", [False, True])
def test_later_turns_resume_the_earlier_prompt_up_to_where_the_next_turn_parts(servers, with_image):
    reuse, strict = servers
    image = _image() if with_image else None
    body = {"model": reuse.model_id, "messages": [{"role": "user", "content": QUESTIONS[0]}]}
    prepared = reuse.state.preprocessor.prepare_sync(parse_chat_request(body, reuse.config, {reuse.model_id}, 4096))
    parts_at = prepared.turn_prefix
    assert reuse.engine.info.whole_prefixes and 0 < parts_at < prepared.num_prompt_tokens  # the case under test

    caches = reuse.engine.core.runner.prefix_caches()
    entries = sum(len(c._entries) for c in caches)
    with_reuse, without = _turns(reuse, image), _turns(strict, image)
    assert sum(len(c._entries) for c in caches) == entries + len(QUESTIONS)  # one a turn: its checkpoint's
    text = [r["choices"][0]["message"]["content"] for r in with_reuse]
    assert text == [r["choices"][0]["message"]["content"] for r in without]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in with_reuse]
    assert cached[0] == 0
    gap = prepared.num_prompt_tokens - parts_at  # what the generation prompt adds past the part
    for earlier, later in zip(with_reuse, cached[1:]):
        assert later >= earlier["usage"]["prompt_tokens"] - gap
    if not with_image:  # the first turn again: all but the generation prompt's tail is cached
        with reuse.client() as client:
            r = client.post("/v1/chat/completions", json={**body, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        again = r.json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == parts_at
        assert again["choices"][0]["message"]["content"] == text[0]


def test_chats_whose_first_turns_were_prefilled_together_resume_them(servers, monkeypatch):
    """First turns arriving together share the new prompts' forward, which stops each at its
    checkpoint (its rows of the batch's cache go on alone); their second turns resume them."""
    from vlmserve.engine.runner.model_runner import ModelRunner

    reuse, strict = servers
    stopped_in_group = []
    together = ModelRunner._prefill_together

    def spy(self, group, bucket):
        stopped_in_group.extend(s.checkpoint for s in group if s.checkpoint and not s.prefilled)
        return together(self, group, bucket)

    monkeypatch.setattr(ModelRunner, "_prefill_together", spy)
    firsts = [[{"role": "user", "content": f"Chat {i}: tell me about the number {i}, at length please. " * 3}]
              for i in range(4)]  # fmt: skip

    async def gather(server, conversations):
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            bodies = [
                {"model": server.model_id, "messages": m, "max_tokens": 5, "temperature": 0} for m in conversations
            ]
            replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
            assert all(r.status_code == 200 for r in replies)
            return [r.json() for r in replies]

    def two_turns(server):
        first = asyncio.run(gather(server, firsts))
        seconds = [
            m
            + [
                {"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Go on."},
            ]
            for m, r in zip(firsts, first)
        ]
        return first, asyncio.run(gather(server, seconds))

    (first, second), (first_strict, second_strict) = two_turns(reuse), two_turns(strict)
    assert stopped_in_group  # the case under test: rows that stopped at their checkpoint in the shared forward
    text = lambda replies: [r["choices"][0]["message"]["content"] for r in replies]  # noqa: E731
    assert text(first) == text(first_strict) and text(second) == text(second_strict)
    for messages, later in zip(firsts, second):
        body = {"model": reuse.model_id, "messages": messages}
        chat = parse_chat_request(body, reuse.config, {reuse.model_id}, 4096)
        parts_at = reuse.state.preprocessor.prepare_sync(chat).turn_prefix
        assert parts_at > 0 and later["usage"]["prompt_tokens_details"]["cached_tokens"] >= parts_at
