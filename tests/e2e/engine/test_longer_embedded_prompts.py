"""LLaVA-NeXT expands each image when it embeds the prompt (240 ids can become 330 positions),
so admission, which reserves a prompt's KV blocks from its ids, reserves too few. Under a tight
budget the difference is found while the prompt prefills into the pool; a row the budget cannot
hold that far goes on in a cache of its own and settles at its join (stepping aside until blocks
free up), instead of failing with "its prompt needs more KV memory than the budget holds"."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from support.families import session_checkpoint
from support.helpers import chat_body, data_uri, images
from support.server import start_server
from vlmserve.engine.core import kv_block_bytes

pytestmark = pytest.mark.slow

LONG = " ".join(f"word{i}" for i in range(80))


def _bodies(model_id: str) -> list[dict]:
    imgs = images()
    cases = [
        ("What is in this image?", [imgs[0]]),
        ("Describe the picture in detail. " + LONG[:200], [imgs[1]]),
        ("Summarise: " + LONG, []),
        ("Background: " + LONG[:300] + " What colour dominates?", [imgs[2]]),
        ("What colour dominates?", [imgs[0]]),
    ]
    return [
        chat_body(model_id, text, [data_uri(p) for p in paths], max_tokens=12, temperature=0, ignore_eos=True)
        for text, paths in cases
    ]


async def _post_all(server, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))


def test_prompts_that_embed_longer_than_their_ids_are_not_failed_under_a_tight_budget(tmp_path_factory):
    model = str(session_checkpoint("llava_next", "float32", tmp_path_factory))
    settings = dict(max_num_seqs=6, prefill_chunk=32, prefix_cache_tokens=0, warmup_image_sizes=())
    server = start_server(model, **settings)
    try:  # each answer alone, and what a block of KV takes
        bodies = _bodies(server.model_id)
        alone = []
        for body in bodies:
            [r] = asyncio.run(_post_all(server, [body]))
            alone.append((r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens"]))
        core = server.state.engine.core
        block = core.sched.kv_budget.block_size
        block_bytes = kv_block_bytes(core.model, block)
    finally:
        server.stop()
    longest = max(tokens for _, tokens in alone) + 12
    blocks = 2 * -(-longest // block)  # about two of the longest rows at once
    server = start_server(model, kv_cache_memory_gb=blocks * block_bytes / 2**30, **settings)
    try:
        budget = server.state.engine.core.sched.kv_budget
        assert budget.total == blocks
        for _ in range(2):
            answers = asyncio.run(_post_all(server, bodies))
            assert [r.status_code for r in answers] == [200] * len(bodies), [r.text for r in answers]
            got = [(r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens"]) for r in answers]
            assert got == alone
        assert budget.used == 0 and budget.preemptions > 0
    finally:
        server.stop()
