"""Rows whose prompts embed wider than the model (a 4-bit PaliGemma's float32 image embeddings in
its bfloat16 language model) decode on a KV pool of their own, and cost twice the blocks
admission reserved from their ids. Warm-up meets that pool with its image prompt; idle time then
compiles its decode shapes as it does the model dtype's, so image requests batched after start
trace nothing while every stream waits. Under a tight KV budget such a row that cannot be paid
for at its join steps aside and joins later, as a preempted row does, instead of failing."""

from __future__ import annotations

import asyncio
import json

import httpx
import mlx.core as mx
import pytest

from support.families import session_checkpoint
from support.helpers import chat_body, data_uri, images
from support.server import start_server
from vlmserve.engine.ops import cuda_kernels
from vlmserve.engine.runner.block_pool import BlockPool
from vlmserve.engine.runner.decode_batch import DecodeBatches

pytestmark = pytest.mark.slow


def _paligemma_4bit(tmp_path_factory) -> str:
    return str(session_checkpoint("paligemma", "4bit", tmp_path_factory))


async def _answers(server, body: dict, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(n)))


def test_the_decode_shapes_of_float32_rows_are_compiled_before_traffic_brings_them(tmp_path_factory):
    server = start_server(
        _paligemma_4bit(tmp_path_factory),
        max_num_seqs=2,
        prefill_chunk=32,
        compile_decode="on",
        warmup_image_sizes=(56,),
    ).wait_warm()
    try:
        step = server.state.engine.core.runner.batches.step
        traced = set(step.traced)
        assert {(rows, str(dtype)) for rows, _, _, dtype in traced if dtype == mx.float32} == {
            (1, str(mx.float32)),
            (2, str(mx.float32)),
        }
        image = [data_uri(images()[0])]
        body = chat_body(server.model_id, "What is in this image?", image, max_tokens=6, temperature=0)
        answers = asyncio.run(_answers(server, body, 2))
        assert all(r.status_code == 200 for r in answers)
        assert len({r.json()["choices"][0]["message"]["content"] for r in answers}) == 1
        assert set(step.traced) == traced  # the two image rows decoded together on compiled shapes
    finally:
        server.stop()


def test_rows_the_budget_cannot_pay_for_at_their_join_step_aside_and_give_what_they_give_alone(tmp_path_factory):
    """Eight image requests at once under a budget of six blocks, where each float32 row takes
    four: they join a few at a time, each with the tokens it gives alone, none failed."""
    model = _paligemma_4bit(tmp_path_factory)
    server = start_server(
        model, max_num_seqs=8, warmup_image_sizes=(), prefill_chunk=64, kv_cache_memory_gb=6 * 8192 / 2**30
    )
    try:
        budget = server.state.engine.core.sched.kv_budget
        assert budget.total == 6 and budget.block_size == 32  # the fixture's KV: 8 KiB a block
        image = [data_uri(images()[0])]
        body = chat_body(
            server.model_id, "Describe it in a few words.", image, max_tokens=24, temperature=0, ignore_eos=True
        )
        alone = asyncio.run(_answers(server, body, 1))[0].json()["choices"][0]["message"]["content"]
        answers = asyncio.run(_answers(server, body, 8))
        assert [r.status_code for r in answers] == [200] * 8, answers[0].text
        assert [r.json()["choices"][0]["message"]["content"] for r in answers] == [alone] * 8
        assert budget.preemptions > 0 and budget.used == 0
    finally:
        server.stop()


def test_a_prompt_whose_wider_kv_the_whole_budget_cannot_hold_is_refused_before_any_token(tmp_path_factory):
    """Its ids fit the budget (so the request is admitted), its float32 KV would not: a 400
    (context_length_exceeded) once it is embedded, before a token is sampled or streamed; a
    request that fits is served beside it. (Warm-up's image prompt showed the engine that this
    model's image prompts keep float32 KV.)"""
    model = _paligemma_4bit(tmp_path_factory)
    server = start_server(model, max_num_seqs=4, warmup_image_sizes=(56,), kv_cache_memory_gb=12 * 8192 / 2**30)
    try:
        assert server.state.engine.core.sched.kv_budget.total == 12  # 384 positions of bf16 KV, 192 of float32
        image = [data_uri(images()[0])]
        long_text = "Describe it. " + " ".join(f"word{i}" for i in range(45))
        too_wide = chat_body(server.model_id, long_text, image, max_tokens=8, temperature=0)
        fits = chat_body(server.model_id, "What is it?", image, max_tokens=8, temperature=0)
        refused, served = asyncio.run(_both(server, [too_wide, fits]))
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        assert "the prompt embeds to" in refused.json()["error"]["message"]  # refused as embedded
        assert served.status_code == 200
        with (
            server.client() as client,
            client.stream("POST", "/v1/chat/completions", json={**too_wide, "stream": True}) as r,
        ):
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [c["delta"].get("content") for e in events for c in e.get("choices", [])]
        assert deltas and not any(deltas)  # the role's empty content only: no token streamed
        assert events[-1]["error"]["code"] == "context_length_exceeded"
    finally:
        server.stop()


async def _both(server, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))


def test_the_pools_of_both_kv_dtypes_stay_within_one_budget(tmp_path_factory, monkeypatch):
    """Text rows (bfloat16 KV) and image rows (float32) at once under 40 blocks. Each dtype's
    pool used to grow to the whole budget on its own (2x the budget at the peak); now a pool
    grows into what the other gives back (its free tail, its cached prefixes, the free blocks
    between its rows' after renumbering them), and every answer is still the one given alone."""
    server = start_server(
        _paligemma_4bit(tmp_path_factory),
        max_num_seqs=8,
        warmup_image_sizes=(),
        prefill_chunk=64,
        kv_cache_memory_gb=40 * 8192 / 2**30,
    )
    try:
        batches = server.state.engine.core.runner.batches
        budget = server.state.engine.core.sched.kv_budget
        assert budget.total == 40
        peaks, shrinks = [], []
        grow, make, compact = BlockPool._grow, DecodeBatches.pool, DecodeBatches._compact_running

        def held():  # the pools' blocks, in budget blocks (float32 ones count twice)
            peaks.append(sum((p.num_blocks - 1) * batches.weight(d) for d, p in batches.pools.items()))

        def tracked_grow(pool, blocks):
            grow(pool, blocks)
            held()

        def tracked_pool(self, dtype):
            made = make(self, dtype)
            held()
            return made

        def tracked_compact(self, pool, rows, size):
            shrinks.append(compact(self, pool, rows, size))
            return shrinks[-1]

        monkeypatch.setattr(BlockPool, "_grow", tracked_grow)
        monkeypatch.setattr(DecodeBatches, "pool", tracked_pool)
        monkeypatch.setattr(DecodeBatches, "_compact_running", tracked_compact)
        image = images()
        greedy = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
        bodies = [chat_body(server.model_id, f"Story {i}: " + "the sea " * 6 * i, **greedy) for i in range(12)] + [
            chat_body(
                server.model_id,
                f"Describe picture {i}.",
                [data_uri(image[i % len(image)])],
                **greedy,
            )
            for i in range(12)
        ]

        async def run(together: bool) -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
                if together:
                    return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
                return [await client.post("/v1/chat/completions", json=b) for b in bodies]

        answers = asyncio.run(run(True))  # first: no cached prefix makes a row's KV smaller
        assert [r.status_code for r in answers] == [200] * len(bodies), answers[0].text
        assert True in shrinks  # a pool gave blocks back while its rows ran
        # 80 before (each pool at the whole budget); 41-45 now (a block of room per row where a
        # pool compacts, and its sizes rounded to steps of the budget)
        assert max(peaks) <= budget.total * 3 // 2, peaks
        alone = [r.json()["choices"][0]["message"]["content"] for r in asyncio.run(run(False))]
        # On CUDA a bfloat16 row's decode kernels depend on the batch's rows (equal to bf16
        # rounding only): there the float32 image rows are compared, elsewhere every row.
        compared = slice(12, None) if cuda_kernels.on_cuda() else slice(None)
        assert [r.json()["choices"][0]["message"]["content"] for r in answers][compared] == alone[compared]
        assert budget.used == 0
    finally:
        server.stop()


def test_pools_shrink_while_prompts_prefill_into_them_and_answers_stay_those_given_alone(tmp_path_factory, monkeypatch):
    """Kimi-VL 4-bit: long text prompts sharing a prefix prefill in pieces straight into the
    bfloat16 pool (and hit its cached prefixes) while float32 image rows take room in their own
    pool. The bfloat16 pool is compacted under its running rows (and, as timing has it, prompts
    prefilling into it); every answer is the one given alone."""
    model = str(session_checkpoint("kimi_vl", "4bit", tmp_path_factory))
    server = start_server(
        model, max_num_seqs=8, warmup_image_sizes=(), prefill_chunk=16, kv_cache_memory_gb=160 * 8192 / 2**30
    )
    try:
        batches = server.state.engine.core.runner.batches
        budget = server.state.engine.core.sched.kv_budget
        shrinks, compact = [], DecodeBatches._compact_running

        def tracked_compact(self, pool, holders, size):
            shrinks.append(compact(self, pool, holders, size))
            return shrinks[-1]

        monkeypatch.setattr(DecodeBatches, "_compact_running", tracked_compact)
        image = images()
        greedy = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
        common = "Once upon a time in a land far away there lived a king who had three daughters and a dragon. " * 3
        bodies = [
            chat_body(server.model_id, common + f"story {i}: " + "the sea and the sky " * (4 + 3 * i), **greedy)
            for i in range(12)
        ] + [
            chat_body(server.model_id, f"Describe picture {i}." + " and more" * i, [data_uri(image[i % 2])], **greedy)
            for i in range(10)
        ]
        order = [i for pair in zip(range(12), range(12, 22)) for i in pair] + [10, 11]  # text and images interleaved

        async def run(together: bool) -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
                if not together:
                    return [await client.post("/v1/chat/completions", json=b) for b in bodies]

                async def staggered(k: int, i: int) -> tuple[int, httpx.Response]:
                    await asyncio.sleep(0.01 * k)
                    return i, await client.post("/v1/chat/completions", json=bodies[i])

                done = dict(await asyncio.gather(*(staggered(k, i) for k, i in enumerate(order))))
                return [done[i] for i in range(len(bodies))]

        answers = asyncio.run(run(True))  # first: the pools start without cached prefixes
        assert [r.status_code for r in answers] == [200] * len(bodies), answers[0].text
        assert True in shrinks and len(batches.kv_dtypes) == 2
        alone = [r.json()["choices"][0]["message"]["content"] for r in asyncio.run(run(False))]
        compared = slice(12, None) if cuda_kernels.on_cuda() else slice(None)  # as above
        assert [r.json()["choices"][0]["message"]["content"] for r in answers][compared] == alone[compared]
        assert budget.used == 0
    finally:
        server.stop()
