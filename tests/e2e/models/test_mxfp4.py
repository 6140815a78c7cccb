"""Checkpoints quantized to mxfp4 (mlx-vlm's convert with q_mode="mxfp4": 4-bit floats in groups
of 32 with shared power-of-two scales) load and match mlx_vlm.generate, alone and batched. The
fast paths built for affine quantization (few-row decode kernel, dequantized prefill) leave them
to MLX's own quantized kernels."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from support.helpers import MODELS, chat_body, data_uri, images, on_own_thread
from support.reference import mlx_vlm_text
from support.server import start_server

pytestmark = pytest.mark.slow

MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["qwen2_vl", "llava"])
def mxfp4_server(request, tmp_path_factory):
    from mlx_vlm import convert

    dst = tmp_path_factory.mktemp("mxfp4") / request.param
    on_own_thread(
        lambda: convert(str(MODELS / request.param), str(dst), quantize=True, q_group_size=32, q_bits=4,
                        q_mode="mxfp4", dtype="bfloat16")
    )  # fmt: skip
    server = start_server(str(dst))
    yield server
    server.stop()


def test_mxfp4_matches_mlx_vlm_alone_and_batched(mxfp4_server):
    imgs = images()
    cases = [("Describe the picture.", []), ("What is in this image?", [imgs[1]]), ("Name a colour.", [imgs[2]])]
    bodies = [
        chat_body(mxfp4_server.model_id, text, [data_uri(p) for p in paths], max_tokens=MAX_TOKENS, temperature=0)
        for text, paths in cases
    ]

    async def run():
        async with httpx.AsyncClient(base_url=mxfp4_server.base_url, timeout=120) as c:
            alone = [(await c.post("/v1/chat/completions", json=b)).json() for b in bodies]
            together = await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))
            return alone, [r.json() for r in together]

    alone, together = asyncio.run(run())
    texts = [r["choices"][0]["message"]["content"] for r in alone]
    assert [r["choices"][0]["message"]["content"] for r in together] == texts
    for (text, paths), got in zip(cases, texts):
        assert got == mlx_vlm_text(mxfp4_server, text, paths, MAX_TOKENS)
    model = mxfp4_server.engine.core.model
    modes = {getattr(m, "mode", None) for _, m in model.language_model.named_modules() if hasattr(m, "scales")}
    assert modes == {"mxfp4"}  # the checkpoint really is mxfp4
