"""Models whose layers keep fixed-size state beside their KV (recurrent and convolution state:
LFM2-VL, Qwen3.5) decode on the paged KV pool, the state kept per row beside it, under the KV
budget: admission counts each row's positions and fixed state, and when the budget runs out
the rows that arrived last go to host memory, KV and state, and resume where they were, with
the tokens each gives alone."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from support.families import session_checkpoint
from support.helpers import chat_body, metric_value
from support.server import start_server

pytestmark = pytest.mark.slow

BUDGET_BLOCKS = 12  # holds any one request below, grown, but not all four


@pytest.mark.parametrize("family", ["lfm2_vl", "qwen3_5"])
def test_state_rows_preempted_for_the_budget_resume_with_the_same_tokens(family, tmp_path_factory):
    path = session_checkpoint(family, "float32", tmp_path_factory)
    probe = start_server(str(path), max_num_seqs=4, prefix_cache_tokens=0)
    try:
        core = probe.engine.core
        per_position, fixed = probe.on_worker(core.model.row_memory)
        assert core.runner.batches.paged and core.runner.batches.state_layout is not None
        assert core.sched.kv_budget.bounded
    finally:
        probe.stop()
    block_bytes = per_position * 32
    # The state of the four decode slots comes off the budget first; the blocks get the rest.
    memory = BUDGET_BLOCKS * block_bytes + 4 * fixed + block_bytes // 2
    server = start_server(str(path), max_num_seqs=4, prefix_cache_tokens=0, kv_cache_memory_gb=memory / (1 << 30))
    try:
        budget = server.engine.core.sched.kv_budget
        assert fixed > 0 and budget.total == BUDGET_BLOCKS and budget.row_blocks == 0
        assert server.engine.core.info.context_length == BUDGET_BLOCKS * 32  # what the blocks hold
        bodies = [
            chat_body(server.model_id, f"Short request {i}.", [], max_tokens=110, temperature=0, ignore_eos=True)
            for i in range(4)
        ]

        async def run(concurrent):
            async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as c:

                async def text(body):
                    r = await c.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    return r.json()["choices"][0]["message"]["content"]

                if concurrent:
                    return list(await asyncio.gather(*(text(b) for b in bodies)))
                return [await text(b) for b in bodies]

        alone = asyncio.run(run(False))
        assert metric_value(httpx.get(f"{server.base_url}/metrics").text, "num_preemptions") == 0
        together = asyncio.run(run(True))
        assert together == alone
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert metric_value(metrics, "num_preemptions") >= 1
        assert metric_value(metrics, "kv_blocks_used") == 0 and metric_value(metrics, "kv_blocks_free") == BUDGET_BLOCKS
    finally:
        server.stop()
