"""Issue 5: every malformed request gets a 4xx in OpenAI's error shape, never a 5xx, and the
server keeps serving (a valid request right after each one succeeds)."""

from __future__ import annotations

import base64
import json

import pytest

from support.helpers import data_uri, images

M = "__model__"  # replaced by the served model id
USER = [{"role": "user", "content": "Hi"}]
PNG = None  # data URI of a fixture image, filled lazily


def _img() -> dict:
    global PNG
    PNG = PNG or data_uri(images()[0])
    return {"type": "image_url", "image_url": {"url": PNG}}


def body(**kw) -> dict:
    return {"model": M, "messages": USER, "max_tokens": 2, **kw}


def user(*parts) -> list:
    return [{"role": "user", "content": list(parts)}]


TEXT = {"type": "text", "text": "Describe."}


def _png_uri(width: int, height: int) -> str:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


NOT_IMAGE = "data:image/png;base64," + base64.b64encode(b"this is plain text, not a png").decode()

# (id, method, path, json body | raw bytes | None, extra headers, expected status, expected code or None)
CASES = [
    ("malformed-json", "POST", "/v1/chat/completions", b'{"model": "x", "messages": [', {}, 400, "invalid_json"),
    ("not-utf8", "POST", "/v1/chat/completions", b"\xff\xfe{}", {}, 400, "invalid_json"),
    ("empty-body", "POST", "/v1/chat/completions", b"", {}, 400, "invalid_json"),
    (
        "large-malformed-json",
        "POST",
        "/v1/chat/completions",  # past the size parsed off the event loop
        b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * 200_000,
        {},
        400,
        "invalid_json",
    ),
    (
        "large-deeply-nested-json",
        "POST",
        "/v1/chat/completions",
        b"[" * 100_000 + b"]" * 100_000,
        {},
        400,
        "invalid_json",
    ),
    ("body-is-array", "POST", "/v1/chat/completions", [1, 2], {}, 400, None),
    ("body-is-string", "POST", "/v1/chat/completions", "hello", {}, 400, None),
    (
        "text-plain-content-type",
        "POST",
        "/v1/chat/completions",
        json.dumps(body()).encode(),
        {"content-type": "text/plain"},
        400,
        "invalid_content_type",
    ),
    (
        "form-content-type",
        "POST",
        "/v1/chat/completions",
        b"model=x&messages=y",
        {"content-type": "application/x-www-form-urlencoded"},
        400,
        "invalid_content_type",
    ),
    (
        "lone-surrogate-escaped",
        "POST",
        "/v1/chat/completions",
        b'{"model": "__model__", "messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
        {},
        400,
        "invalid_json",
    ),
    (
        "lone-surrogate-raw-bytes",
        "POST",
        "/v1/chat/completions",
        b'{"model": "__model__", "messages": [{"role": "user", "content": "a\xed\xa0\x80b"}], "max_tokens": 2}',
        {},
        400,
        "invalid_json",
    ),
    (
        "lone-surrogate-in-model",
        "POST",
        "/v1/chat/completions",
        b'{"model": "\\udfff", "messages": [{"role": "user", "content": "Hi"}]}',
        {},
        400,
        "invalid_json",
    ),
    ("role-is-list", "POST", "/v1/chat/completions", body(messages=[{"role": [], "content": "Hi"}]), {}, 400, None),
    ("role-is-object", "POST", "/v1/chat/completions", body(messages=[{"role": {}, "content": "Hi"}]), {}, 400, None),
    (
        "image-placeholder-in-text",  # the processor would find two placeholders for one image
        "POST",
        "/v1/chat/completions",
        body(messages=user("__image__", {"type": "text", "text": "<|image_pad|> what is it?"})),
        {},
        400,
        "invalid_prompt",
    ),
    ("trailing-slash", "POST", "/v1/chat/completions/", body(), {}, 404, "not_found"),
    ("missing-model", "POST", "/v1/chat/completions", {"messages": USER}, {}, 400, None),
    ("model-wrong-type", "POST", "/v1/chat/completions", body(model=7), {}, 400, None),
    ("unknown-model", "POST", "/v1/chat/completions", body(model="gpt-4o"), {}, 404, "model_not_found"),
    ("missing-messages", "POST", "/v1/chat/completions", {"model": M}, {}, 400, None),
    ("empty-messages", "POST", "/v1/chat/completions", body(messages=[]), {}, 400, None),
    ("messages-not-list", "POST", "/v1/chat/completions", body(messages="Hi"), {}, 400, None),
    ("message-not-object", "POST", "/v1/chat/completions", body(messages=["Hi"]), {}, 400, None),
    ("bad-role", "POST", "/v1/chat/completions", body(messages=[{"role": "robot", "content": "Hi"}]), {}, 400, None),
    ("missing-role", "POST", "/v1/chat/completions", body(messages=[{"content": "Hi"}]), {}, 400, None),
    ("user-content-missing", "POST", "/v1/chat/completions", body(messages=[{"role": "user"}]), {}, 400, None),
    (
        "user-content-null",
        "POST",
        "/v1/chat/completions",
        body(messages=[{"role": "user", "content": None}]),
        {},
        400,
        None,
    ),
    ("content-number", "POST", "/v1/chat/completions", body(messages=[{"role": "user", "content": 5}]), {}, 400, None),
    ("part-without-type", "POST", "/v1/chat/completions", body(messages=user({"text": "x"})), {}, 400, None),
    ("text-part-without-text", "POST", "/v1/chat/completions", body(messages=user({"type": "text"})), {}, 400, None),
    (
        "unknown-part-type",
        "POST",
        "/v1/chat/completions",
        body(messages=user({"type": "input_audio", "input_audio": {}})),
        {},
        400,
        None,
    ),
    ("max-tokens-zero", "POST", "/v1/chat/completions", body(max_tokens=0), {}, 400, None),
    ("max-tokens-negative", "POST", "/v1/chat/completions", body(max_tokens=-5), {}, 400, None),
    ("max-tokens-huge", "POST", "/v1/chat/completions", body(max_tokens=10**12), {}, 400, None),
    ("max-tokens-string", "POST", "/v1/chat/completions", body(max_tokens="10"), {}, 400, None),
    ("max-tokens-float", "POST", "/v1/chat/completions", body(max_tokens=2.5), {}, 400, None),
    ("max-completion-tokens-negative", "POST", "/v1/chat/completions", body(max_completion_tokens=-1), {}, 400, None),
    (
        "bad-max-tokens-beside-good-max-completion",
        "POST",
        "/v1/chat/completions",
        body(max_completion_tokens=2, max_tokens="x"),
        {},
        400,
        None,
    ),
    ("temperature-too-high", "POST", "/v1/chat/completions", body(temperature=2.5), {}, 400, None),
    ("temperature-negative", "POST", "/v1/chat/completions", body(temperature=-0.1), {}, 400, None),
    ("temperature-string", "POST", "/v1/chat/completions", body(temperature="hot"), {}, 400, None),
    (
        "temperature-nan",
        "POST",
        "/v1/chat/completions",
        b'{"model": "__model__", "messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
        {},
        400,
        None,
    ),
    ("top-p-zero", "POST", "/v1/chat/completions", body(top_p=0), {}, 400, None),
    ("top-p-above-one", "POST", "/v1/chat/completions", body(top_p=1.5), {}, 400, None),
    ("top-k-float", "POST", "/v1/chat/completions", body(top_k=1.5), {}, 400, None),
    ("n-zero", "POST", "/v1/chat/completions", body(n=0), {}, 400, None),
    ("n-too-many", "POST", "/v1/chat/completions", body(n=129), {}, 400, None),
    ("n-fractional", "POST", "/v1/chat/completions", body(n=1.5), {}, 400, None),
    ("stop-five-strings", "POST", "/v1/chat/completions", body(stop=["a", "b", "c", "d", "e"]), {}, 400, None),
    ("stop-number", "POST", "/v1/chat/completions", body(stop=5), {}, 400, None),
    ("seed-string", "POST", "/v1/chat/completions", body(seed="42"), {}, 400, None),
    ("seed-too-big", "POST", "/v1/chat/completions", body(seed=1 << 70), {}, 400, None),
    ("logprobs-string", "POST", "/v1/chat/completions", body(logprobs="yes"), {}, 400, None),
    ("top-logprobs-without-logprobs", "POST", "/v1/chat/completions", body(top_logprobs=3), {}, 400, None),
    ("top-logprobs-21", "POST", "/v1/chat/completions", body(logprobs=True, top_logprobs=21), {}, 400, None),
    ("presence-penalty-3", "POST", "/v1/chat/completions", body(presence_penalty=3), {}, 400, None),
    ("frequency-penalty-minus-3", "POST", "/v1/chat/completions", body(frequency_penalty=-3), {}, 400, None),
    ("stream-string", "POST", "/v1/chat/completions", body(stream="true"), {}, 400, None),
    (
        "stream-options-not-object",
        "POST",
        "/v1/chat/completions",
        body(stream=True, stream_options=True),
        {},
        400,
        None,
    ),
    (
        "include-usage-string",
        "POST",
        "/v1/chat/completions",
        body(stream=True, stream_options={"include_usage": "yes"}),
        {},
        400,
        None,
    ),
    (
        "response-format-json-schema-not-a-schema",
        "POST",
        "/v1/chat/completions",
        body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}}),
        {},
        400,
        None,
    ),
    ("response-format-string", "POST", "/v1/chat/completions", body(response_format="json_object"), {}, 400, None),
    ("ignore-eos-string", "POST", "/v1/chat/completions", body(ignore_eos="no"), {}, 400, None),
    # images
    (
        "bad-data-uri",
        "POST",
        "/v1/chat/completions",
        body(
            messages=user({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@not-base64@@@"}}, TEXT)
        ),
        {},
        400,
        None,
    ),
    (
        "non-image-data-uri",
        "POST",
        "/v1/chat/completions",
        body(messages=user({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGVsbG8="}}, TEXT)),
        {},
        400,
        None,
    ),
    (
        "png-data-uri-holding-text",
        "POST",
        "/v1/chat/completions",
        body(messages=user({"type": "image_url", "image_url": {"url": NOT_IMAGE}}, TEXT)),
        {},
        400,
        "invalid_image",
    ),
    (
        "image-url-not-a-url",
        "POST",
        "/v1/chat/completions",
        body(messages=user({"type": "image_url", "image_url": {"url": "not a url"}}, TEXT)),
        {},
        400,
        None,
    ),
    (
        "extreme-aspect-ratio-image",
        "POST",
        "/v1/chat/completions",  # Qwen's processor refuses > 200:1
        body(messages=user({"type": "image_url", "image_url": {"url": _png_uri(2, 500)}}, TEXT)),
        {},
        400,
        "invalid_image",
    ),
    (
        "image-part-without-url",
        "POST",
        "/v1/chat/completions",
        body(messages=user({"type": "image_url", "image_url": {}}, TEXT)),
        {},
        400,
        "invalid_image_url",
    ),
    (
        "image-part-without-image-url",
        "POST",
        "/v1/chat/completions",
        body(messages=user({"type": "image_url"}, TEXT)),
        {},
        400,
        "invalid_image_url",
    ),
    (
        "image-in-assistant-message",
        "POST",
        "/v1/chat/completions",
        body(
            messages=[
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": ["__image__"]},
                {"role": "user", "content": "And?"},
            ]
        ),
        {},
        400,
        None,
    ),
    ("too-many-images", "POST", "/v1/chat/completions", "__too_many_images__", {}, 400, "invalid_image"),
    # routes and methods
    ("get-chat-completions", "GET", "/v1/chat/completions", None, {}, 405, None),
    ("put-chat-completions", "PUT", "/v1/chat/completions", body(), {}, 405, None),
    ("post-models", "POST", "/v1/models", body(), {}, 405, None),
    ("unknown-route", "GET", "/v1/nope", None, {}, 404, None),
    ("completions-token-ids", "POST", "/v1/completions", {"model": M, "prompt": [1, 2]}, {}, 400, None),
    ("completions-no-prompt", "POST", "/v1/completions", {"model": M}, {}, 400, None),
    ("completions-suffix", "POST", "/v1/completions", {"model": M, "prompt": "a", "suffix": "b"}, {}, 400, None),
    ("completions-bad-logprobs", "POST", "/v1/completions", {"model": M, "prompt": "a", "logprobs": 9}, {}, 400, None),
    ("responses-no-input", "POST", "/v1/responses", {"model": M}, {}, 400, None),
    ("responses-bad-item", "POST", "/v1/responses", {"model": M, "input": [{"type": "reasoning"}]}, {}, 400, None),
    ("responses-unknown-model", "POST", "/v1/responses", {"model": "nope", "input": "Hi"}, {}, 404, None),
]


def _materialize(value, server):
    """Fill in placeholders that need the running server."""
    if value == "__too_many_images__":
        n = server.config.max_images_per_request + 1
        value = body(messages=user(*([_img()] * n), TEXT))
    if isinstance(value, bytes):
        return value.replace(b"__model__", server.model_id.encode())
    text = json.dumps(value).replace('"__model__"', json.dumps(server.model_id))
    out = json.loads(text)
    if isinstance(out, dict) and isinstance(out.get("messages"), list):
        for msg in out["messages"]:
            if isinstance(msg, dict) and msg.get("content") == ["__image__"]:
                msg["content"] = [_img(), TEXT]
            elif isinstance(msg, dict) and isinstance(msg.get("content"), list):
                msg["content"] = [_img() if part == "__image__" else part for part in msg["content"]]
    return out


def test_at_least_30_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("name,method,path,payload,headers,status,code", CASES, ids=[c[0] for c in CASES])
def test_malformed_request(qwen_server, name, method, path, payload, headers, status, code):
    kwargs: dict = {"headers": headers}
    if payload is not None:
        payload = _materialize(payload, qwen_server)
        if isinstance(payload, bytes):
            kwargs["content"] = payload
            kwargs["headers"] = {"content-type": "application/json", **headers}
        else:
            kwargs["json"] = payload
    with qwen_server.client() as c:
        r = c.request(method, path, **kwargs)
        assert r.status_code == status, (r.status_code, r.text)
        assert 400 <= r.status_code < 500
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str) and err["type"]
        assert "param" in err and "code" in err
        if code is not None:
            assert err["code"] == code, err
        assert r.headers.get("x-should-retry") == "false"
        # the server is still serving
        ok = c.post(
            "/v1/chat/completions",
            json={"model": qwen_server.model_id, "messages": USER, "max_tokens": 1, "temperature": 0},
        )
        assert ok.status_code == 200, ok.text


def test_a_large_body_is_parsed_off_the_event_loop(qwen_server, monkeypatch):
    import io
    import threading

    import numpy as np
    from PIL import Image

    from vlmserve.entrypoints.openai import request_body

    parse, threads = request_body._parse_json, []

    def recording(body):
        threads.append(threading.current_thread().name)
        return parse(body)

    monkeypatch.setattr(request_body, "_parse_json", recording)
    noise = np.random.default_rng(0).integers(0, 255, (200, 200, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, "PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    assert len(uri) > request_body._PARSE_OFF_LOOP_BYTES
    big = body(
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "What is it?"}],
            }
        ],
        model=qwen_server.model_id,
    )
    with qwen_server.client() as c:
        r = c.post("/v1/chat/completions", json=big)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 20  # the image's tokens are in it
        assert c.post("/v1/chat/completions", json=body(model=qwen_server.model_id)).status_code == 200
    loop_thread = qwen_server.thread.name
    assert threads[0] != loop_thread  # the large body
    assert threads[1] == loop_thread  # a small one: parsed in place


def test_a_body_without_content_type_is_refused(qwen_server):
    """A web page can POST a body cross-origin without a preflight when it names no type."""
    payload = json.dumps({"model": qwen_server.model_id, "messages": USER, "max_tokens": 1}).encode()
    with qwen_server.client() as c:
        request = c.build_request("POST", "/v1/chat/completions", content=payload)
        assert "content-type" not in request.headers
        r = c.send(request)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"


def test_a_text_longer_than_any_tokenization_of_the_context_is_refused_before_tokenizing(qwen_server, monkeypatch):
    state = qwen_server.state

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the text was tokenized")

    monkeypatch.setattr(state.preprocessor, "encode_chat", no_tokenizing)
    if state.preprocess_processes is not None:
        monkeypatch.setattr(state.preprocess_processes, "prepare", no_tokenizing)
    chars = 2 * state.preprocessor.max_token_chars * (state.engine.info.context_length + 1)
    big = {"model": qwen_server.model_id, "messages": [{"role": "user", "content": "a" * chars}], "max_tokens": 1}
    with qwen_server.client() as c:
        r = c.post("/v1/chat/completions", json=big)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_models_answers_503_until_the_model_is_ready(qwen_server, monkeypatch):
    with qwen_server.client() as c:
        assert c.get("/v1/models").status_code == 200
        monkeypatch.setattr(qwen_server.state, "ready", False)
        r = c.get("/v1/models")
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
    assert r.headers.get("retry-after") == "1"


def test_a_template_that_refuses_the_messages_gives_a_400(qwen_server, monkeypatch):
    preprocessor = qwen_server.state.preprocessor  # holds the template it renders with, resolved at start
    monkeypatch.setattr(preprocessor, "chat_template", "{{ raise_exception('Conversation roles must alternate') }}")
    with qwen_server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": qwen_server.model_id, "messages": USER, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_messages"
    assert "alternate" in r.json()["error"]["message"]
