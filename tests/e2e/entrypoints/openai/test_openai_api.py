"""Issue 5: the real `openai` client against the server — streaming, stop strings, n, seed,
logprobs, json_object, errors, model names, context length, mid-stream failure."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from support.helpers import data_uri, images
from support.server import start_server

PROMPT = "Write a haiku about the sea."


@pytest.fixture
def client(qwen_server):
    return openai.OpenAI(base_url=qwen_server.base_url + "/v1", api_key="x", max_retries=0)


def _user(text=PROMPT, image=False):
    content = [{"type": "text", "text": text}]
    if image:
        content.insert(0, {"type": "image_url", "image_url": {"url": data_uri(images()[0])}})
    return [{"role": "user", "content": content}]


def _stream_text(stream):
    text, finish, usage, chunks = "", None, None, []
    for chunk in stream:
        chunks.append(chunk)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    return text, finish, usage, chunks


def test_streaming_include_usage(client, qwen_server):
    kw = dict(
        model=qwen_server.model_id,
        messages=_user(image=True),
        max_completion_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kw)
    text, finish, usage, chunks = _stream_text(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert text == whole.choices[0].message.content
    assert finish == "length"
    assert chunks[-1].choices == [] and usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert usage.completion_tokens == 10 == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + 10
    # without include_usage: no usage chunk at all
    _, _, usage2, chunks2 = _stream_text(client.chat.completions.create(**kw, stream=True))
    assert usage2 is None and all(c.choices for c in chunks2)


def test_max_completion_tokens_wins_over_max_tokens(client, qwen_server):
    r = client.chat.completions.create(
        model=qwen_server.model_id,
        messages=_user(),
        temperature=0,
        max_completion_tokens=3,
        max_tokens=7,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_roles_and_assistant_history(client, qwen_server):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "developer", "content": [{"type": "text", "text": "Answer briefly."}]},
        {"role": "user", "content": _user(image=True)[0]["content"]},
        {"role": "assistant", "content": "A picture."},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "More?", "name": "bob"},
    ]
    r = client.chat.completions.create(
        model=qwen_server.model_id,
        messages=messages,
        max_tokens=3,
        temperature=0,
        user="someone",
        extra_body={"unknown_field": {"x": 1}},
    )
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"


def test_explicit_nulls_mean_defaults(qwen_server):
    """Proxies (LiteLLM and others) send every optional field, unset ones as null."""
    nulls = {
        k: None
        for k in (
            "max_completion_tokens",
            "temperature",
            "top_p",
            "top_k",
            "stop",
            "seed",
            "n",
            "logprobs",
            "top_logprobs",
            "presence_penalty",
            "frequency_penalty",
            "stream",
            "stream_options",
            "response_format",
            "user",
            "ignore_eos",
            "tools",
        )
    }
    with qwen_server.client() as c:
        r = c.post(
            "/v1/chat/completions", json={"model": qwen_server.model_id, "messages": _user(), "max_tokens": 2, **nulls}
        )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None and len(r.json()["choices"]) == 1


def _tokens(client, model, **kw):
    """Greedy output and its per-token texts (from logprobs)."""
    r = client.chat.completions.create(
        model=model,
        messages=_user(),
        temperature=0,
        max_tokens=24,
        logprobs=True,
        extra_body={"ignore_eos": True},
        **kw,
    )
    return r.choices[0].message.content, [t.token for t in r.choices[0].logprobs.content]


def test_stop_string_across_token_boundary(client, qwen_server):
    model = qwen_server.model_id
    text, pieces = _tokens(client, model)
    assert "".join(pieces) == text
    stop = expected = None
    pos = 0
    for a, b in zip(pieces, pieces[1:]):
        pos += len(a)
        if len(a) >= 2 and len(b) >= 2:
            candidate = a[-2:] + b[:2]  # spans the boundary between two tokens
            # first occurrence exactly at the boundary, with some text before it to keep
            if text.find(candidate) == pos - 2 >= 5 and candidate.strip():
                stop, expected = candidate, text[: pos - 2]
                break
    assert stop is not None, f"no usable token boundary in {pieces}"
    kw = dict(model=model, messages=_user(), temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(stop=stop, **kw)
    assert expected and r.choices[0].message.content == expected, (stop, expected)
    assert r.choices[0].finish_reason == "stop"
    # several stops, the matching one not first
    r = client.chat.completions.create(stop=["\x01never", stop], **kw)
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    # streaming: same text, and no chunk ever carries any part of the stop string past the cut
    streamed, finish, _, chunks = _stream_text(client.chat.completions.create(stop=stop, stream=True, **kw))
    assert streamed == expected and finish == "stop"
    assert stop not in streamed


def test_n_choices(client, qwen_server):
    model = qwen_server.model_id
    r = client.chat.completions.create(model=model, messages=_user(), n=3, temperature=0, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 1
    kw = dict(
        model=model, messages=_user(), n=3, temperature=1, seed=1234, max_tokens=12, extra_body={"ignore_eos": True}
    )
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert len(set(texts)) == 3, texts
    assert texts == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 36
    # streaming n=3: each index gets its own text, equal to the non-streaming choices
    _, _, usage, chunks = _stream_text(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    per = {0: "", 1: "", 2: ""}
    for ch in chunks:
        for c in ch.choices:
            per[c.index] += c.delta.content or ""
    assert [per[i] for i in range(3)] == texts
    assert usage.completion_tokens == 36


def test_seed_reproducible(client, qwen_server):
    kw = dict(
        model=qwen_server.model_id, messages=_user(), temperature=1, max_tokens=16, extra_body={"ignore_eos": True}
    )
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    c = client.chat.completions.create(seed=8, **kw).choices[0].message.content
    assert a == b
    assert a != c
    # OpenAI's seed is int64: negative seeds are valid and reproducible too
    d = client.chat.completions.create(seed=-3, **kw).choices[0].message.content
    assert d == client.chat.completions.create(seed=-3, **kw).choices[0].message.content


def test_logprobs_match_direct_computation(client, qwen_server):
    import numpy as np

    from vlmserve.entrypoints.openai.chat_request import parse_chat_request

    model = qwen_server.model_id
    r = client.chat.completions.create(
        model=model,
        messages=_user(),
        temperature=0,
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 3
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token == entry.token and math.isclose(tops[0].logprob, entry.logprob, abs_tol=1e-6)
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())

    chat = parse_chat_request(
        {"model": model, "messages": _user(), "max_tokens": 4},
        qwen_server.config,
        {model},
        qwen_server.engine.info.context_length,
    )
    prepared = qwen_server.state.preprocessor.prepare_sync(chat)

    def reference():
        import mlx.core as mx

        vlm = qwen_server.engine.core.model
        state = vlm.embed_prompt(prepared)
        logits = vlm.prefill(state, 0, prepared.num_prompt_tokens)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, keepdims=True)
        return np.array(lp.tolist())

    lp = qwen_server.on_worker(reference)
    first = content[0]
    token_id = int(np.argmax(lp))
    assert abs(lp[token_id] - first.logprob) < 1e-4
    top3 = np.argsort(-lp)[:3]
    assert [abs(lp[t] - x.logprob) < 1e-4 for t, x in zip(top3, first.top_logprobs)] == [True] * 3


def test_logprobs_in_stream(client, qwen_server):
    stream = client.chat.completions.create(
        model=qwen_server.model_id,
        messages=_user(),
        temperature=0,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    entries = [e for ch in stream if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert len(entries) == 4 and all(len(e.top_logprobs) == 2 for e in entries)


def test_json_object(client, qwen_server):
    r = client.chat.completions.create(
        model=qwen_server.model_id,
        temperature=0,
        max_tokens=400,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Reply with a JSON object."}],
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)
    # Sampled (seeds 0..3 via n=4): every choice that stopped is one complete JSON object, and
    # the constraint lets the model write non-empty ones. (With random weights, strings can run
    # on to max_tokens: those end with "length" and are not checked.)
    r = client.chat.completions.create(
        model=qwen_server.model_id,
        temperature=1,
        seed=0,
        n=4,
        max_tokens=60,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Reply with a JSON object."}],
    )
    stopped = [json.loads(c.message.content) for c in r.choices if c.finish_reason == "stop"]
    assert len(stopped) >= 2 and all(isinstance(o, dict) for o in stopped)
    assert any(stopped), [c.message.content for c in r.choices]


def test_errors_raise_openai_exceptions(client, qwen_server):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=_user(), max_tokens=2)
    assert exc.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=qwen_server.model_id, messages=_user(), temperature=3)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=qwen_server.model_id, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=qwen_server.model_id, messages=_user(), stop=["a"] * 5)


def test_models_list(client, qwen_server):
    models = client.models.list().data
    assert [m.id for m in models] == [qwen_server.model_id]
    assert models[0].object == "model" and models[0].owned_by


def test_mid_stream_error_is_one_event(qwen_server):
    """A failure after the stream began: one `data: {"error":...}` event, then the stream ends."""
    sched = qwen_server.engine.core.runner  # the launch is the runner's; rows are its scheduler's
    original = sched._launch
    marker = 987654321

    def failing_launch(prev):
        if any(s.req.sampling.seed == marker and s.generated >= 3 for s in sched.sched.running):
            raise RuntimeError("injected decode failure")
        return original(prev)

    qwen_server.on_worker(setattr, sched, "_launch", failing_launch)
    try:
        body = {
            "model": qwen_server.model_id,
            "messages": _user(),
            "max_tokens": 50,
            "temperature": 1,
            "seed": marker,
            "stream": True,
            "ignore_eos": True,
        }
        events = []
        with qwen_server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    finally:
        qwen_server.on_worker(delattr, sched, "_launch")
    errors = [e for e in events if e.startswith('{"error"')]
    assert len(errors) == 1 and events[-1] == errors[0], events[-3:]
    err = json.loads(errors[0])["error"]
    assert err["type"] == "server_error" and err["message"] and "param" in err and "code" in err
    content = [json.loads(e) for e in events[:-1]]
    assert sum(1 for ch in content if ch["choices"][0]["delta"].get("content")) >= 2  # it had begun
    assert "[DONE]" not in events
    # the same failure without streaming: a 500 in OpenAI's shape, not retried
    qwen_server.on_worker(setattr, sched, "_launch", failing_launch)
    try:
        with qwen_server.client() as c:
            r = c.post("/v1/chat/completions", json={**body, "stream": False})
    finally:
        qwen_server.on_worker(delattr, sched, "_launch")
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert r.headers["x-should-retry"] == "false"
    with qwen_server.client() as c:  # and the server is fine
        assert c.post("/v1/chat/completions", json={**body, "stream": False}).status_code == 200


@pytest.fixture(scope="module")
def small_server():
    """Served under an alias, with a 64-token context."""
    server = start_server("qwen2_vl", served_model_name="tiny-vlm", max_model_len=64, warmup=False)
    yield server
    server.stop()


def test_served_model_name_and_context_length(small_server):
    c = openai.OpenAI(base_url=small_server.base_url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in c.models.list().data] == ["tiny-vlm"]
    for name in ("tiny-vlm", "qwen2_vl"):  # the alias and the directory name
        r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert r.model == "tiny-vlm"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="qwen2_5_vl", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    steps_before = small_server.on_worker(lambda: small_server.engine.core.stats.steps)
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model="tiny-vlm", messages=[{"role": "user", "content": "word " * 200}], max_tokens=2)
    assert exc.value.body["code"] == "context_length_exceeded"
    assert exc.value.response.headers["x-should-retry"] == "false"
    # rejected before any MLX work: the scheduler never saw it
    assert small_server.on_worker(lambda: small_server.engine.core.stats.steps) == steps_before
    # an image whose tokens alone overflow the context (224x160: 75 prompt tokens) is rejected the
    # same way, also when streaming (before the stream starts)
    large = [p for p in images() if p.name.startswith("large_")][0]
    r = httpx.post(
        small_server.base_url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": "tiny-vlm",
            "stream": True,
            "max_tokens": 2,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_uri(large)}},
                        {"type": "text", "text": "Hi"},
                    ],
                }
            ],
        },
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_max_tokens_past_the_context_is_rejected(small_server):
    """A client's max_tokens that cannot fit after the prompt is a 400 (as OpenAI and vLLM answer),
    before any model work; our default max_tokens is not, and generation stops at the context's end."""
    c = openai.OpenAI(base_url=small_server.base_url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Hi"}]
    fits = c.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=2)
    prompt = fits.usage.prompt_tokens
    steps_before = small_server.on_worker(lambda: small_server.engine.core.stats.steps)
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model="tiny-vlm", messages=messages, **{field: 64 - prompt + 1})
        assert exc.value.body["code"] == "context_length_exceeded" and exc.value.body["param"] == "max_tokens"
        assert (
            f"you requested {65} tokens ({prompt} in the messages, {64 - prompt + 1} in the completion)"
            in exc.value.body["message"]
        )
    assert small_server.on_worker(lambda: small_server.engine.core.stats.steps) == steps_before
    exact = c.chat.completions.create(
        model="tiny-vlm", messages=messages, max_tokens=64 - prompt, extra_body={"ignore_eos": True}
    )
    assert exact.choices[0].finish_reason == "length"
    assert exact.usage.completion_tokens <= 64 - prompt
    implicit = c.chat.completions.create(model="tiny-vlm", messages=messages, extra_body={"ignore_eos": True})
    assert implicit.choices[0].finish_reason == "length"  # the default (512) ends at the context instead
    assert prompt + implicit.usage.completion_tokens <= 64
