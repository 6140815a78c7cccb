"""Rows whose prompts embed wider than the model (a 4-bit PaliGemma's float32 image embeddings in
its bfloat16 language model) decode on a KV pool of their own. Warm-up meets that pool with its
image prompt; idle time then compiles its decode shapes as it does the model dtype's, so image
requests batched after start trace nothing while every stream waits."""

from __future__ import annotations

import asyncio

import httpx
import mlx.core as mx
import pytest

from support.families import checkpoint
from support.helpers import chat_body, data_uri, images
from support.server import start_server

pytestmark = pytest.mark.slow


def test_the_decode_shapes_of_float32_rows_are_compiled_before_traffic_brings_them(tmp_path_factory):
    cache_dir = tmp_path_factory.getbasetemp() / "families"
    cache_dir.mkdir(exist_ok=True)
    server = start_server(
        str(checkpoint("paligemma", "4bit", cache_dir)),
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

        async def both():
            async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
                return await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(2)))

        answers = asyncio.run(both())
        assert all(r.status_code == 200 for r in answers)
        assert len({r.json()["choices"][0]["message"]["content"] for r in answers}) == 1
        assert set(step.traced) == traced  # the two image rows decoded together on compiled shapes
    finally:
        server.stop()
