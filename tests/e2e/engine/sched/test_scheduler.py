"""Issue 3 acceptance: continuous batching equals single runs, per-step admission,
prefix cache isolation, per-request sampling, cancellation and error isolation."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from support.helpers import chat_body, data_uri, images, metric_value
from support.reference import mlx_vlm_text
from support.server import start_server

MAX_TOKENS = 16


def _mixed_requests():
    """16 requests: text-only, one image, two images, different image sizes."""
    imgs = images()
    reqs = []
    for i in range(16):
        kind = i % 4
        text = f"Request {i}: describe what you see, item {i * 7 % 11}."
        if kind == 0:
            paths = []
        elif kind == 3:
            paths = [imgs[i % len(imgs)], imgs[(i + 1) % len(imgs)]]
        else:
            paths = [imgs[i % len(imgs)]]
        reqs.append((text, paths))
    return reqs


async def _post(client, body):
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _body(server, text, paths, **kw):
    return chat_body(server.model_id, text, [data_uri(p) for p in paths], max_tokens=MAX_TOKENS, temperature=0, **kw)


def test_batched_outputs_equal_single_runs_and_mlx_vlm(any_server):
    reqs = _mixed_requests()

    async def alone():
        async with httpx.AsyncClient(base_url=any_server.base_url, timeout=120) as c:
            return [(await _post(c, _body(any_server, t, p)))["choices"][0]["message"]["content"] for t, p in reqs]

    async def together():
        """The first 8 reach the scheduler while the worker is held (admitted and prefilled in one
        step, as a group); the other 8 arrive staggered, joining a batch that is decoding."""
        gate = threading.Event()
        any_server.engine.worker.submit(gate.wait, 30)
        async with httpx.AsyncClient(base_url=any_server.base_url, timeout=120) as c:

            async def one(i, t, p):
                if i >= 8:
                    await asyncio.sleep(0.01 * (i - 7))
                return (await _post(c, _body(any_server, t, p)))["choices"][0]["message"]["content"]

            first = [asyncio.create_task(one(i, t, p)) for i, (t, p) in enumerate(reqs[:8])]
            while any_server.engine.core.num_waiting < 8:
                await asyncio.sleep(0.005)
            gate.set()
            rest = [asyncio.create_task(one(i + 8, t, p)) for i, (t, p) in enumerate(reqs[8:])]
            return await asyncio.gather(*first, *rest)

    singles = asyncio.run(alone())
    # The same prompts again would reuse their cached prefixes (images too) and skip the batched
    # prefill this test is about: start from empty caches.
    any_server.engine.worker.submit(any_server.engine.core.forget_prefixes).result(30)
    stats = any_server.engine.core.stats
    steps_before, grouped_before = stats.decode_steps, stats.batched_prefills
    batched = asyncio.run(together())
    steps = stats.decode_steps - steps_before
    assert batched == singles
    assert steps < 16 * MAX_TOKENS / 2, "requests were not decoded together"
    assert stats.batched_prefills > grouped_before, "no prompts were prefilled together"
    for (text, paths), got in zip(reqs, singles):
        assert got == mlx_vlm_text(any_server, text, paths, MAX_TOKENS)


def test_new_request_is_admitted_while_others_decode(qwen_server):
    long_body = chat_body(
        qwen_server.model_id, "Tell a very long story.", max_tokens=300, temperature=0, ignore_eos=True
    )

    async def scenario():
        async with httpx.AsyncClient(base_url=qwen_server.base_url, timeout=120) as c:
            finished = []

            async def long(i):
                await _post(c, {**long_body, "messages": [{"role": "user", "content": f"story {i}"}]})
                finished.append(time.monotonic())

            tasks = [asyncio.create_task(long(i)) for i in range(8)]
            while qwen_server.engine.core.stats.decode_steps == 0 or qwen_server.engine.num_running < 8:
                await asyncio.sleep(0.005)
            first_token = None
            body = _body(qwen_server, "Quick question", [images()[0]], stream=True)
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        if delta.get("content"):
                            first_token = time.monotonic()
                            break
            await asyncio.gather(*tasks)
            return first_token, finished

    first_token, finished = asyncio.run(scenario())
    assert first_token is not None
    assert first_token < min(finished), "the new request waited for the running batch to drain"


@pytest.fixture(scope="module")
def strict_server():
    """--no-mm-cache: the strict rule, no reuse of any kind for requests with images."""
    server = start_server("qwen2_vl", mm_cache=False)
    yield server
    server.stop()


def test_prefix_cache_never_serves_image_requests(strict_server):
    qwen_server = strict_server
    text = "Prefix cache probe: what colour is the dominant object in the picture?"

    async def run():
        async with httpx.AsyncClient(base_url=qwen_server.base_url, timeout=120) as c:
            first = await _post(c, _body(qwen_server, text, []))
            again = await _post(c, _body(qwen_server, text, []))
            a, b = await asyncio.gather(
                _post(c, _body(qwen_server, text, [images()[0]])), _post(c, _body(qwen_server, text, [images()[2]]))
            )
            return first, again, a, b

    pc = qwen_server.engine.core.prefix_cache
    first, again, a, b = asyncio.run(run())
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert a["choices"][0]["message"]["content"] == mlx_vlm_text(qwen_server, text, [images()[0]], MAX_TOKENS)
    assert b["choices"][0]["message"]["content"] == mlx_vlm_text(qwen_server, text, [images()[2]], MAX_TOKENS)
    assert pc.size_tokens > 0
    # Nothing by image content either: no multimodal prefix cache, no vision features kept.
    assert qwen_server.engine.core.runner.mm_prefix_cache is None
    assert qwen_server.engine.core.model.feature_cache is None
    again_a = asyncio.run(_post_once(qwen_server, _body(qwen_server, text, [images()[0]])))
    assert again_a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def _post_once(server, body):
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
        return await _post(c, body)


def test_mixed_sampling_in_one_batch(qwen_server):
    greedy = _body(qwen_server, "Greedy row", [images()[1]])
    seeded = _body(qwen_server, "Seeded row", [images()[1]]) | {"temperature": 0.9, "top_p": 0.9, "seed": 1234}
    others = [_body(qwen_server, f"noise {i}", []) | {"temperature": 1.3, "top_k": 20} for i in range(6)]

    async def run():
        async with httpx.AsyncClient(base_url=qwen_server.base_url, timeout=120) as c:
            g_alone = await _post(c, greedy)
            s_alone = await _post(c, seeded)
            results = await asyncio.gather(*(_post(c, b) for b in [greedy, seeded, *others]))
            return g_alone, s_alone, results

    g_alone, s_alone, results = asyncio.run(run())
    text = lambda r: r["choices"][0]["message"]["content"]  # noqa: E731
    assert text(results[0]) == text(g_alone)
    assert text(results[1]) == text(s_alone)
    assert text(g_alone) == mlx_vlm_text(qwen_server, "Greedy row", [images()[1]], MAX_TOKENS)
    assert len({text(r) for r in results[2:]}) > 1, "sampled rows shared one random stream"


def _wait_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while server.engine.num_running + server.engine.num_waiting > 0:
        assert time.monotonic() < deadline, "rows were not freed"
        time.sleep(0.01)


def test_disconnect_and_cancel_free_rows(qwen_server):
    body = chat_body(qwen_server.model_id, "Go on forever.", max_tokens=2000, temperature=0, ignore_eos=True)

    async def stream_then_leave():
        async with (
            httpx.AsyncClient(base_url=qwen_server.base_url, timeout=120) as c,
            c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r,
        ):
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n > 5:
                    break  # leaving the block closes the connection

    async def post_then_cancel():
        async with httpx.AsyncClient(base_url=qwen_server.base_url, timeout=120) as c:
            task = asyncio.create_task(c.post("/v1/chat/completions", json=body))
            while qwen_server.engine.num_running == 0:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(stream_then_leave())
    _wait_idle(qwen_server)
    asyncio.run(post_then_cancel())
    _wait_idle(qwen_server)
    assert qwen_server.engine.core.runner.batch is None


def test_failing_request_leaves_others_unchanged(qwen_server, monkeypatch):
    vlm = qwen_server.engine.core.model
    tokenizer = qwen_server.engine.tokenizer.hf

    def poisoned(real):  # each request's own embedding step: mlx_vlm's, or the Qwen host-index one
        def embed(prepared, *args):
            if "POISON" in tokenizer.decode(prepared.prompt_ids.tolist()):
                raise RuntimeError("injected failure")
            return real(prepared, *args)

        return embed

    good = [_body(qwen_server, f"healthy {i}", [images()[i % 3]]) for i in range(4)]

    async def run():
        async with httpx.AsyncClient(base_url=qwen_server.base_url, timeout=120) as c:
            alone = [await _post(c, b) for b in good]
            monkeypatch.setattr(vlm, "embed_prompt", poisoned(vlm.embed_prompt))
            monkeypatch.setattr(vlm, "_embed_image_prompt", poisoned(vlm._embed_image_prompt))
            bad = c.post("/v1/chat/completions", json=_body(qwen_server, "POISON pill", [images()[0]]))
            results = await asyncio.gather(bad, *(_post(c, b) for b in good))
            return alone, results

    alone, results = asyncio.run(run())
    assert results[0].status_code == 500
    assert results[0].json()["error"]["message"]
    assert [r["choices"][0]["message"]["content"] for r in results[1:]] == [
        r["choices"][0]["message"]["content"] for r in alone
    ]


@pytest.mark.slow
def test_compiled_decode_matches_eager():
    """The compiled decode step (the GPU default) gives the eager path's tokens, alone and batched,
    with rows joining and leaving the slots mid-decode. Both servers start fresh with the same
    settings (no prefix cache), so prompts are prefilled the same way on both."""
    from support.server import start_server

    settings = dict(max_num_seqs=4, prefix_cache_tokens=0)
    compiled = start_server("qwen2_vl", compile_decode="on", **settings)
    eager = start_server("qwen2_vl", compile_decode="off", **settings)
    try:
        assert compiled.engine.core.runner.batches.compiled and not eager.engine.core.runner.batches.compiled
        # Warm-up leaves the decode shapes to idle time, after /ready: the idle worker compiles them.
        core = compiled.engine.core
        compiled.wait_warm(60), eager.wait_warm(60)
        assert not core.has_idle_work() and not eager.engine.core.has_idle_work()
        batches = core.runner.batches
        warmed = batches.shapes_to_warm(4, 2 * compiled.config.prefill_chunk)
        assert warmed and set(warmed) <= {(rows, width) for rows, width, *_ in batches.step.traced}
        reqs = _mixed_requests()[:8]

        async def run(target, concurrent):
            async with httpx.AsyncClient(base_url=target.base_url, timeout=120) as c:
                bodies = [
                    chat_body(
                        target.model_id, t, [data_uri(x) for x in p], temperature=0, max_tokens=MAX_TOKENS + 4 * (i % 3)
                    )
                    for i, (t, p) in enumerate(reqs)
                ]
                if concurrent:
                    outs = await asyncio.gather(*(_post(c, b) for b in bodies))
                else:
                    outs = [await _post(c, b) for b in bodies]
                return [o["choices"][0]["message"]["content"] for o in outs]

        for concurrent in (False, True):
            assert asyncio.run(run(compiled, concurrent)) == asyncio.run(run(eager, concurrent))
    finally:
        compiled.stop()
        eager.stop()


def test_running_rows_get_their_tokens_before_a_prefill_step(qwen_server, monkeypatch):
    """A step that prefills holds the worker for vision + prefill: the running rows' tokens from
    the previous decode step are read and handed to the event loop before that work, not after."""
    engine = qwen_server.engine
    core = engine.core
    real = core._prefill
    seen = []

    def watched():
        if core.sched.prefilling and core.sched.running:  # a prefill while other rows decode
            seen.append((core.runner.inflight is None, not engine._outbox))
        return real()

    monkeypatch.setattr(core, "_prefill", watched)
    long_body = chat_body(qwen_server.model_id, "Tell a long story.", max_tokens=120, temperature=0, ignore_eos=True)

    async def scenario():
        async with httpx.AsyncClient(base_url=qwen_server.base_url, timeout=120) as c:
            tasks = [asyncio.create_task(_post(c, long_body)) for _ in range(3)]
            while core.stats.decode_steps == 0 or engine.num_running < 3:
                await asyncio.sleep(0.005)
            for i in range(3):
                await _post(c, _body(qwen_server, f"Quick question {i}", [images()[i]]))
            await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert seen, "no prefill happened while rows were decoding"
    assert all(resolved and flushed for resolved, flushed in seen), seen


def test_a_request_whose_output_cannot_be_decoded_ends_alone(qwen_server, monkeypatch):
    """An exception while accepting one row's token (here: its detokenizer) ends that request
    with an error; the worker and the other rows go on."""
    codec = qwen_server.engine.core.tokenizer
    real = codec.new_detokenizer
    made = []

    class Broken:
        def __init__(self, inner):
            self.inner, self.seen = inner, 0

        def add_token(self, token):
            self.seen += 1
            if self.seen == 3:
                raise KeyError(token)
            self.inner.add_token(token)

        def finalize(self):
            self.inner.finalize()

        @property
        def last_segment(self):
            return self.inner.last_segment

    def new_detokenizer():
        detok = real()
        made.append(1)
        return Broken(detok) if len(made) == 1 else detok

    good = [_body(qwen_server, f"healthy {i}", [images()[i % 3]]) for i in range(3)]

    async def run():
        async with httpx.AsyncClient(base_url=qwen_server.base_url, timeout=120) as c:
            alone = [await _post(c, b) for b in good]
            made.clear()
            monkeypatch.setattr(codec, "new_detokenizer", new_detokenizer)
            first = asyncio.create_task(
                c.post("/v1/chat/completions", json=_body(qwen_server, "broken", [images()[0]]))
            )
            while not made:  # admitted first, so it gets the broken detokenizer
                await asyncio.sleep(0.002)
            results = await asyncio.gather(first, *(c.post("/v1/chat/completions", json=b) for b in good))
            return alone, results

    alone, results = asyncio.run(run())
    assert results[0].status_code == 500 and "decoding the output failed" in results[0].json()["error"]["message"]
    assert [r.json()["choices"][0]["message"]["content"] for r in results[1:]] == [
        r["choices"][0]["message"]["content"] for r in alone
    ]
    assert qwen_server.engine.worker.healthy


def test_idle_buffers_are_handed_back_after_a_pause_not_between_requests():
    # Freeing MLX's buffer pool holds the GIL (an event-loop stall) and makes the next request
    # allocate everything again: not when work runs out, only after --release-cache-after-idle.
    import mlx.core as mx

    server = start_server("qwen2_vl", release_cache_after_idle_s=1.0)
    try:
        assert server.engine.core.idle_release_s == 1.0
        body = chat_body(server.model_id, "Describe it.", [data_uri(images()[0])], max_tokens=4, temperature=0)
        with server.client() as c:
            assert c.post("/v1/chat/completions", json=body).status_code == 200
        _wait_idle(server)
        assert server.on_worker(mx.get_cache_memory) > 0  # kept for the next request
        deadline = time.monotonic() + 10
        while server.on_worker(mx.get_cache_memory) > 0:  # the worker wakes every 0.5 s when idle
            assert time.monotonic() < deadline, "the idle worker never handed its buffers back"
            time.sleep(0.1)
        # ... and /metrics says so then, not after the next request's step
        assert server.on_worker(lambda: server.engine.core.cache_gauges().memory["cache"]) == 0
    finally:
        server.stop()


def test_a_first_token_is_handed_out_before_the_next_step_is_launched(qwen_server, monkeypatch):
    # Time to first token must not include launching another decode step (the host's share of a
    # step is ~5 ms on the H100); later tokens are read back while the next step runs.
    from vlmserve.engine.runner.model_runner import ModelRunner

    accept = ModelRunner._accept
    launched_meanwhile: dict[int, bool] = {}

    def record(self, seq, token, logprobs):
        launched_meanwhile.setdefault(seq.generated, self.inflight is not None)
        return accept(self, seq, token, logprobs)

    monkeypatch.setattr(ModelRunner, "_accept", record)
    body = chat_body(
        qwen_server.model_id, "Describe it.", [data_uri(images()[0])], max_tokens=6, temperature=0, ignore_eos=True
    )
    with qwen_server.client() as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200
    assert launched_meanwhile[0] is False  # the first token: read before the next launch
    assert launched_meanwhile[2] is True  # later ones: still pipelined


_FIXTURE_BLOCK_BYTES = 2 * 32 * 2 * (16 + 16) * 4  # the qwen2_vl fixture: layers, block, KV heads, dims, float32


@pytest.mark.parametrize("compile_decode", ["off", "on"])
def test_rows_preempted_for_kv_blocks_resume_with_the_same_tokens(compile_decode):
    """A KV budget of 12 blocks (384 positions) holds any one of these requests but not all four
    grown: the rows that arrived last are put aside (KV to host memory) and resume where they
    were, with the tokens each gives alone; every block is back once they are done."""
    budget_gb = 12 * _FIXTURE_BLOCK_BYTES / (1 << 30)
    server = start_server(
        "qwen2_vl", compile_decode=compile_decode, max_num_seqs=4, prefix_cache_tokens=0, kv_cache_memory_gb=budget_gb
    )
    try:
        assert server.engine.core.sched.kv_budget.total == 12
        bodies = [
            chat_body(server.model_id, f"Short request {i}.", [], max_tokens=110, temperature=0, ignore_eos=True)
            for i in range(4)
        ]

        async def run(concurrent):
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
                outs = (
                    await asyncio.gather(*(_post(c, b) for b in bodies))
                    if concurrent
                    else [await _post(c, b) for b in bodies]
                )
                return [o["choices"][0]["message"]["content"] for o in outs]

        alone = asyncio.run(run(False))
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert metric_value(metrics, "num_preemptions") == 0
        together = asyncio.run(run(True))
        assert together == alone
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert metric_value(metrics, "num_preemptions") >= 1
        assert metric_value(metrics, "kv_blocks_used") == 0 and metric_value(metrics, "kv_blocks_free") == 12
        pool = next(x for x in metrics.splitlines() if x.startswith("vlmserve:device_memory_bytes") and "kv_pool" in x)
        assert float(pool.rsplit(" ", 1)[1]) > 0  # kept until idle for --release-cache-after-idle
        deadline = time.monotonic() + 60  # the warm-up left for idle time ends, and says so

        def pending() -> float:
            return metric_value(httpx.get(f"{server.base_url}/metrics").text, "warmup_pending")

        while pending() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pending() == 0
        assert not server.engine.core.has_idle_work()
    finally:
        server.stop()


def test_context_is_capped_to_what_the_kv_budget_holds():
    """A prompt longer than the whole KV budget is a 400 before any work, not a request that
    waits forever for blocks."""
    server = start_server("qwen2_vl", kv_cache_memory_gb=4 * _FIXTURE_BLOCK_BYTES / (1 << 30))
    try:
        long_text = "Tell me everything about this long list: " + " ".join(f"item{i}" for i in range(150))
        with server.client() as c:
            r = c.post("/v1/chat/completions", json=chat_body(server.model_id, long_text, [], max_tokens=4))
            assert r.status_code == 400, r.text
            short = chat_body(server.model_id, "Hi.", [], max_tokens=4, temperature=0)
            assert c.post("/v1/chat/completions", json=short).status_code == 200
    finally:
        server.stop()


def test_pixels_of_the_next_steps_requests_are_staged_once_and_used(monkeypatch):
    """Requests the next step will embed have their pixels copied into MLX at the end of this
    step (`ModelRunner.stage`, overlapping device work); their embedding uses that copy, never a
    second one, and the tokens are those of each request alone."""
    from vlmserve.engine.runner.model_runner import ModelRunner
    from vlmserve.models.qwen2_vl.adapter import QwenVLModel

    copies, staged = [], []
    copy, stage = QwenVLModel.stage_inputs, ModelRunner.stage

    def counted(self, prepared):
        copies.append(id(prepared))
        return copy(self, prepared)

    def staging(self, reqs):
        staged.extend(id(r.prepared) for r in reqs)
        return stage(self, reqs)

    monkeypatch.setattr(QwenVLModel, "stage_inputs", counted)
    monkeypatch.setattr(ModelRunner, "stage", staging)
    # A budget below one image prompt: each step embeds one new request, so the next is staged.
    server = start_server("qwen2_vl", prefill_token_budget=60, prefix_cache_tokens=0, mm_cache=False, warmup=False)
    try:
        large = images()[1]  # prompts of ~75 tokens each, whatever order they arrive in
        bodies = [_body(server, f"Picture {i}: what is in it?", [large]) for i in range(3)]

        async def run(concurrent):
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
                if not concurrent:
                    return [(await _post(c, b))["choices"][0]["message"]["content"] for b in bodies]
                gate = threading.Event()
                server.engine.worker.submit(gate.wait, 30)
                tasks = [asyncio.create_task(_post(c, b)) for b in bodies]
                while server.engine.core.num_waiting < len(bodies):
                    await asyncio.sleep(0.005)
                gate.set()
                return [r["choices"][0]["message"]["content"] for r in await asyncio.gather(*tasks)]

        alone = asyncio.run(run(False))
        copies.clear(), staged.clear()
        together = asyncio.run(run(True))
        assert together == alone
        assert len(staged) >= 2  # every request after the first waited a step, staged
        assert len(copies) == len(set(copies)) == len(bodies)  # one copy each, staged or not
    finally:
        server.stop()


@pytest.mark.parametrize("compile_decode", ["off", "on"])
def test_pool_grows_under_running_rows_with_the_same_tokens(compile_decode):
    """A pool that starts small (2 rows x 2 chunks of 64 positions) doubles while rows decode past
    it; the rows' tokens are those they give alone, and the growth is what the pool reports."""
    server = start_server(
        "qwen2_vl", compile_decode=compile_decode, max_num_seqs=2, prefill_chunk=64, prefix_cache_tokens=0
    )
    try:
        bodies = [
            chat_body(server.model_id, f"Tell a long story {i}.", [], max_tokens=200, temperature=0, ignore_eos=True)
            for i in range(2)
        ]

        async def run(concurrent):
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
                if concurrent:
                    return [
                        o["choices"][0]["message"]["content"]
                        for o in await asyncio.gather(*(_post(c, b) for b in bodies))
                    ]
                return [(await _post(c, b))["choices"][0]["message"]["content"] for b in bodies]

        alone = asyncio.run(run(False))
        pool = next(iter(server.engine.core.runner.batches.pools.values()))
        before = pool.num_blocks
        together = asyncio.run(run(True))
        assert together == alone
        assert before == 2 * 2 * 64 // 32 + 1 < pool.num_blocks  # it grew: one row fits in 8 blocks, two do not
    finally:
        server.stop()


def test_cached_prefixes_give_way_to_running_rows():
    """Cached prompt prefixes hold blocks of the KV pool, and are evicted (oldest first) when
    running rows need the blocks and the pool is as large as the budget lets it grow: no row is
    preempted, the tokens are the same, and no block is left that nothing holds."""
    server = start_server(
        "qwen2_vl",
        max_num_seqs=4,
        prefix_cache_tokens=100_000,
        kv_cache_memory_gb=12 * _FIXTURE_BLOCK_BYTES / (1 << 30),
    )
    try:
        warm = [
            chat_body(server.model_id, f"Cached prompt number {i}.", [], max_tokens=2, temperature=0) for i in range(5)
        ]
        bodies = [
            chat_body(server.model_id, f"Long answer {i}.", [], max_tokens=100, temperature=0, ignore_eos=True)
            for i in range(2)
        ]

        async def run(batch, concurrent=False):
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
                if concurrent:
                    return [
                        o["choices"][0]["message"]["content"]
                        for o in await asyncio.gather(*(_post(c, b) for b in batch))
                    ]
                return [(await _post(c, b))["choices"][0]["message"]["content"] for b in batch]

        alone = asyncio.run(run(bodies))
        asyncio.run(run(warm))
        pc = server.engine.core.prefix_cache
        metrics = httpx.get(f"{server.base_url}/metrics").text
        cached_blocks = metric_value(metrics, "kv_blocks_cached")
        assert pc.size_tokens > 0 and cached_blocks >= 5  # the cached prompts hold blocks, nothing runs
        assert metric_value(metrics, "kv_blocks_used") == 0
        together = asyncio.run(run(bodies, concurrent=True))
        assert together == alone
        _wait_idle(server)
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert metric_value(metrics, "num_preemptions") == 0
        assert metric_value(metrics, "kv_blocks_used") == 0
        left = metric_value(metrics, "kv_blocks_cached")
        pool = next(iter(server.engine.core.runner.batches.pools.values()))
        assert pool.used == left and pool.num_blocks <= 13  # every held block is a cached one; the budget's size
    finally:
        server.stop()


def test_every_step_bounds_its_working_memory(monkeypatch):
    # MLX's memory limit is where its evaluation waits for the GPU to free buffers: each step
    # sets it to the memory in use plus --working-memory (engine/memory.py).
    import mlx.core as mx

    from vlmserve.engine import memory

    gaps = []
    apply = memory.StepMemoryBound.apply

    def record(self):
        apply(self)
        gaps.append(mx.get_memory_limit() - mx.get_active_memory())

    monkeypatch.setattr(memory.StepMemoryBound, "apply", record)
    before = mx.get_memory_limit()
    server = start_server("qwen2_vl", working_memory_gb=0.25, warmup=False)
    try:
        steps = server.engine.core.stats.steps
        body = chat_body(server.model_id, "Describe it.", [data_uri(images()[0])], max_tokens=4, temperature=0)
        with server.client() as c:
            assert c.post("/v1/chat/completions", json=body).status_code == 200
        _wait_idle(server)
        assert len(gaps) >= server.engine.core.stats.steps - steps >= 4  # embed/prefill, then decode steps
        # (less what the device freed or allocated meanwhile: a launched step still runs)
        assert all(abs(gap - (1 << 28)) < (1 << 20) for gap in gaps)
    finally:
        server.stop()
        mx.set_memory_limit(before)


def test_a_lone_long_prompt_is_prefilled_in_one_forward_and_matches_mlx_vlm(monkeypatch):
    """With no row decoding, a prompt past the chunk takes the step's budget (there is no stream
    whose pace chunks would keep): one forward, as mlx_vlm.generate runs a prompt of up to 2,048
    tokens; the same prompt behind a running stream goes a chunk a step."""
    from vlmserve.models.generic import GenericModel

    spans = []
    real, real_pieces = GenericModel.prefill, GenericModel.prefill_pieces

    def recording(self, state, start, end):
        spans.append((start, end))
        return real(self, state, start, end)

    def recording_pieces(self, states, pieces, bucket=1):  # a prompt's later pieces, under load
        spans.extend(pieces)
        return real_pieces(self, states, pieces, bucket)

    monkeypatch.setattr(GenericModel, "prefill", recording)
    monkeypatch.setattr(GenericModel, "prefill_pieces", recording_pieces)
    server = start_server("qwen2_vl", prefill_chunk=32, prefix_cache_tokens=0, warmup=False)
    try:
        text = "Describe the picture in great detail, every object and colour. " * 6
        body = chat_body(server.model_id, text, [data_uri(images()[0])], max_tokens=8, temperature=0)
        with server.client() as c:
            r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        assert prompt_tokens > 3 * 32
        # One forward over the prompt; its last token rides the first decode step.
        assert len(spans) == 1 and spans[0][0] == 0 and spans[0][1] >= prompt_tokens - 2
        assert r.json()["choices"][0]["message"]["content"] == mlx_vlm_text(server, text, [images()[0]], 8)

        spans.clear()
        with server.client() as c:
            long_story = chat_body(server.model_id, "Go on.", max_tokens=3000, temperature=0, ignore_eos=True)
            with c.stream("POST", "/v1/chat/completions", json={**long_story, "stream": True}) as running:
                lines = running.iter_lines()  # kept: a closed iterator would close the stream
                next(line for line in lines if '"content"' in line)  # it decodes now
                spans.clear()
                assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert spans[0] == (0, 32) and len(spans) >= 3 and all(end - start <= 32 for start, end in spans)
    finally:
        server.stop()


def test_a_step_trace_records_every_step_with_its_phases(monkeypatch, tmp_path):
    """VLMSERVE_STEP_TRACE (engine/step_trace.py): a JSON line per step, its phases timed."""
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("VLMSERVE_STEP_TRACE", str(path))
    server = start_server("qwen2_vl", warmup=False)
    try:
        body = chat_body(server.model_id, "Describe it.", [data_uri(images()[0])], max_tokens=5, temperature=0)
        with server.client() as c:
            assert c.post("/v1/chat/completions", json=body).status_code == 200
        _wait_idle(server)
        deadline = time.monotonic() + 10
        while True:  # the last step ends (a step that starts meanwhile counts before its line is written)
            counted = server.engine.core.stats.steps
            steps = [json.loads(line) for line in path.read_text().splitlines()]
            if len(steps) >= counted and server.engine.core.stats.steps == counted:
                break
            assert time.monotonic() < deadline, "a step left no trace line"
            time.sleep(0.01)
        assert len(steps) == counted
        phases = ("admit_ms", "embed_ms", "prefill_ms", "stage_ms", "decode_ms")
        # (each figure rounded to the microsecond)
        assert all(all(s[p] >= 0 for p in phases) and s["step_ms"] + 0.01 >= sum(s[p] for p in phases) for s in steps)
        # the host's share of each phase: until it returned, before the device's rest of it
        assert all(0 <= s[p.replace("_ms", "_queued_ms")] <= s[p] + 0.01 for s in steps for p in phases)
        first = steps[0]
        assert first["embedded"] == 1 and first["images"] == 1 and first["prefill_tokens"] > 0
        assert first["embed_ms"] > 0 and first["prefill_ms"] > 0
        assert sum(s["decode_rows"] > 0 for s in steps) >= 4  # the first token rides a decode step, then 4 more
        # The host's share of a decode phase: a step with rows left launched one, within its phase.
        decoding = [s for s in steps if s["decode_rows"] > 0]
        assert all(0 < s["launch_host_ms"] <= s["decode_ms"] + 0.01 for s in decoding)
        assert all(s["resolve_host_ms"] >= 0 for s in steps)
    finally:
        server.stop()


def test_a_piece_length_warmed_while_idle_runs_one_padded_forward_and_leaves_nothing_behind(qwen_server, monkeypatch):
    """On CUDA the idle warm-up runs each padded length a lone prompt's piece past a chunk can
    take: one pieces forward of that length on a throwaway prompt, padded as a real piece is,
    that touches no request's state, no KV pool and no cache."""
    core = qwen_server.wait_warm().engine.core  # on CUDA its own idle forwards are done first
    model = core.model
    calls = []
    real = model.prefill_pieces

    def spy(states, spans, bucket=1):
        calls.append((list(spans), bucket, states[0].input_ids.shape[1]))
        return real(states, spans, bucket)

    monkeypatch.setattr(model, "prefill_pieces", spy)

    def state():
        g = core.cache_gauges()
        return core.stats.batched_prefills, g.kv_tokens, g.kv_blocks_used, g.kv_blocks_cached, g.prefix_usage

    before = state()
    length = core.runner.piece_lengths_to_warm()[0]
    qwen_server.on_worker(core.runner.warm_piece_length, length, 7)
    head = max(1, core.sched.prefill_bucket)
    assert length > core.sched.prefill_chunk and length % max(1, core.sched.prefill_bucket) == 0
    [(spans, multiple, prompt_len)] = calls
    assert spans == [(head, head + length)] and prompt_len == head + length + 1
    assert -(-length // multiple) * multiple == length  # the forward ran exactly that length, unpadded
    assert state() == before
