"""Issue 2 acceptance: greedy output equals mlx_vlm.generate, streaming, usage, guard, health."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from support.helpers import chat_body, data_uri, images
from support.reference import mlx_vlm_text

MAX_TOKENS = 24


def _complete(server, body):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, body):
    chunks = []
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


@pytest.mark.parametrize("image_index", [0, 1])
def test_greedy_matches_mlx_vlm_generate(any_server, image_index):
    image = images()[image_index]
    text = "Describe this image in detail."
    body = chat_body(any_server.model_id, text, [data_uri(image)], max_tokens=MAX_TOKENS, temperature=0)
    out = _complete(any_server, body)
    expected = mlx_vlm_text(any_server, text, [image], MAX_TOKENS)
    assert out["choices"][0]["message"]["content"] == expected
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == MAX_TOKENS


def test_text_only_matches_mlx_vlm_generate(any_server):
    text = "Write a haiku about the sea."
    out = _complete(any_server, chat_body(any_server.model_id, text, max_tokens=MAX_TOKENS, temperature=0))
    assert out["choices"][0]["message"]["content"] == mlx_vlm_text(any_server, text, [], MAX_TOKENS)


def test_stream_equals_non_stream_and_usage(qwen_server):
    body = chat_body(
        qwen_server.model_id,
        "What is shown?",
        [data_uri(images()[0])],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream_options={"include_usage": True},
    )
    whole = _complete(qwen_server, {k: v for k, v in body.items() if k != "stream_options"})
    chunks = _stream(qwen_server, body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finals = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    # The second request may reuse more of the first's prompt KV (image included): cached_tokens differ.
    details = "prompt_tokens_details"
    assert {k: v for k, v in usage.items() if k != details} == {k: v for k, v in whole["usage"].items() if k != details}
    assert usage[details]["cached_tokens"] >= whole["usage"][details]["cached_tokens"]
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + MAX_TOKENS


def test_prompt_tokens_count_the_image_tokens(qwen_server):
    from vlmserve.entrypoints.openai.chat_request import parse_chat_request

    body = chat_body(qwen_server.model_id, "Hi", [data_uri(images()[0])], max_tokens=2)
    chat = parse_chat_request(body, qwen_server.config, qwen_server.state.model_names, 4096)
    prepared = qwen_server.state.preprocessor.prepare_sync(chat)
    out = _complete(qwen_server, body)
    assert out["usage"]["prompt_tokens"] == prepared.num_prompt_tokens
    image_token = qwen_server.engine.info.image_token_id
    assert int((prepared.prompt_ids == image_token).sum()) > 0


def test_thread_guard_saw_worker_calls(qwen_server, thread_guard_report):
    _complete(qwen_server, chat_body(qwen_server.model_id, "Hi", [data_uri(images()[0])], max_tokens=4))
    calls = thread_guard_report.calls
    assert calls["mx.eval"] > 0 and calls["array.item"] + calls["array.tolist"] > 0
    assert any(name.endswith(".__call__") and n > 0 for name, n in calls.items())
    assert qwen_server.engine.worker.ident in thread_guard_report.owners
    assert not thread_guard_report.violations


def test_thread_guard_catches_off_thread_calls(qwen_server, thread_guard_report):
    """The guard itself must be able to fail: an eval on another thread is recorded."""
    import mlx.core as mx

    before = len(thread_guard_report.violations)
    t = threading.Thread(target=lambda: mx.eval(mx.array([1.0]) + 1), name="intruder")
    t.start()
    t.join()
    assert len(thread_guard_report.violations) == before + 1
    assert thread_guard_report.violations[-1][1] == "intruder"
    del thread_guard_report.violations[before:]


def test_health_is_fast_during_long_generation(qwen_server):
    body = chat_body(
        qwen_server.model_id, "Tell a long story.", [data_uri(images()[1])], max_tokens=400, ignore_eos=True
    )
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", _complete(qwen_server, body)))
    worker.start()
    latencies = []
    with qwen_server.client() as c:
        deadline = time.monotonic() + 60
        while qwen_server.engine.num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        while worker.is_alive() and len(latencies) < 40:
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)
    worker.join()
    assert result["out"]["usage"]["completion_tokens"] == 400
    assert len(latencies) >= 5, "generation finished before /health could be sampled"
    assert max(latencies) < 0.05, latencies


@pytest.mark.slow
def test_missing_model_exits_nonzero(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = subprocess.run(
        [sys.executable, "-m", "vlmserve.cli", "serve", str(missing), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "model path not found" in proc.stderr


@pytest.mark.slow
def test_an_unknown_model_type_exits_nonzero_and_names_it(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_vlm"}')
    proc = subprocess.run(
        [sys.executable, "-m", "vlmserve.cli", "serve", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "model_type 'no_such_vlm'" in proc.stderr and "mlx-vlm" in proc.stderr


def test_models_endpoint(qwen_server):
    with qwen_server.client() as c:
        r = c.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [qwen_server.model_id]
    assert r.json()["data"][0]["object"] == "model"


def test_a_reader_behind_the_steps_gets_the_queued_tokens_as_one_event(qwen_server):
    """Engine.generate joins the events queued for a slow reader; nothing is lost or reordered."""
    import asyncio

    from vlmserve.protocol import ChatMessage, ChatRequest, FinishReason, SamplingParams

    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)
    chat = ChatRequest([ChatMessage("user", [("text", "Tell me a story about a lighthouse.")])], sampling)
    prepared = qwen_server.state.preprocessor.prepare_sync(chat)

    async def read(pause_after_first: float) -> list:
        events = []
        async for event in qwen_server.engine.generate(f"reader-{pause_after_first}", prepared, sampling):
            events.append(event)
            if len(events) == 1:
                await asyncio.sleep(pause_after_first)  # the request's remaining steps run meanwhile
        return events

    prompt, behind = asyncio.run(read(0.0)), asyncio.run(read(1.5))
    for events in (prompt, behind):
        assert sum(len(e.token_ids) for e in events) == MAX_TOKENS == len([x for e in events for x in e.logprobs])
        assert events[-1].finish_reason == FinishReason.LENGTH and events[-1].completion_tokens == MAX_TOKENS
        assert all(e.finish_reason is None for e in events[:-1])
    assert [x for e in behind for x in e.token_ids] == [x for e in prompt for x in e.token_ids]
    assert "".join(e.text for e in behind) == "".join(e.text for e in prompt)
    assert [x.token_id for e in behind for x in e.logprobs] == [x for e in prompt for x in e.token_ids]
    assert len(behind) == 2  # the first token, then everything that queued up while the reader slept
