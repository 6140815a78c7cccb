"""Hostile input: hundreds of bodies a client must not be able to turn into a 5xx. Each one
gets a 4xx in OpenAI's error shape, and the server keeps serving (checked after every case,
and with a real chat every 50). A property-based fuzz of the request schema runs within a
fixed budget too."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

M = "__model__"  # replaced by the served model id
_HEAD = b'{"model": "__model__", "messages": [{"role": "user", "content": "Hi"}]'  # a body's start, to finish

pytestmark = pytest.mark.slow


def _valid(**overrides) -> dict:
    return {"model": M, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **overrides}


def _msg(**fields) -> dict:
    return _valid(messages=[{"role": "user", "content": "Hi", **fields}])


def _parts(*parts) -> dict:
    return _valid(messages=[{"role": "user", "content": list(parts)}])


def _image_part(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _png(width: int = 24, height: int = 16) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (30, 200, 90)).save(buf, "PNG")
    return buf.getvalue()


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.effect_noise((40, 30), 50).convert("RGB").save(buf, "JPEG")
    return buf.getvalue()


def _png_bomb(side: int = 40_000) -> bytes:
    """A tiny PNG whose header claims side x side pixels (a decompression bomb)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    rows = zlib.compress(b"\0" * (side + 1) * 8)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def _cases() -> list[tuple[str, bytes | dict | list | str, int | None]]:
    """(name, body: raw bytes or JSON-able, the one 4xx expected or None for any 4xx)."""
    cases: list[tuple[str, object, int | None]] = []
    add = cases.append

    # 1. JSON that does not parse: every truncation of a valid body, and broken bytes.
    text = json.dumps(_valid(temperature=0.5, stop=["x"], messages=[{"role": "user", "content": "Describe it."}]))
    for end in range(1, len(text) - 1):
        add((f"truncated-{end}", text[:end].encode(), 400))
    parts = json.dumps(_parts({"type": "text", "text": "What is it?"}, _image_part("data:image/png;base64,AAAA")))
    for end in range(1, len(parts) - 1, 2):
        add((f"truncated-parts-{end}", parts[:end].encode(), 400))
    for label, source in (("text", text), ("parts", parts)):  # one structural character blanked
        for at, char in enumerate(source):
            if char in '{}[]:,"':
                add((f"blanked-{label}-{at}", (source[:at] + " " + source[at + 1 :]).encode(), 400))
    for name, raw in {
        "invalid-utf8-ff": b'{"model": "__model__", "messages": [{"role": "user", "content": "\xff"}]}',
        "overlong-utf8": b'{"model": "__model__", "messages": [{"role": "user", "content": "\xc0\x80"}]}',
        "cut-multibyte": b'{"model": "__model__", "messages": [{"role": "user", "content": "\xe2\x82"}]}',
        "utf16-body": json.dumps(_valid()).encode("utf-16"),
        "nan-token": _HEAD + b', "temperature": NaN}',
        "infinity-token": _HEAD + b', "top_p": Infinity}',
        "huge-exponent": _HEAD + b', "max_tokens": 1e999}',
        "trailing-garbage": json.dumps(_valid()).encode() + b" garbage",
        "two-objects": json.dumps(_valid()).encode() * 2,
        "single-quotes": b"{'model': 'x'}",
        "comment": b'{"model": "x" /* hi */}',
        "nul-body": b"\0" * 64,
        "deep-array-body": b"[" * 50_000 + b"]" * 50_000,
        "deep-object-body": b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    }.items():
        add((name, raw, 400))
    for name, raw in {"empty": b"", "spaces": b"   ", "null": b"null", "true": b"true", "number": b"123"}.items():
        add((f"odd-body-{name}", raw, 400))
    for name, value in {"array": [1], "string": "hi", "empty-array": [], "list-of-bodies": [_valid()]}.items():
        add((f"odd-body-{name}", value, 400))

    # 2. Unpaired surrogates wherever a string goes.
    surrogate = "\\ud800"
    for where, template in {
        "text": '{"model": "__model__", "messages": [{"role": "user", "content": "a%sb"}]}',
        "model": '{"model": "%s", "messages": [{"role": "user", "content": "Hi"}]}',
        "role": '{"model": "__model__", "messages": [{"role": "%s", "content": "Hi"}]}',
        "stop": '{"model": "__model__", "messages": [{"role": "user", "content": "Hi"}], "stop": ["%s"]}',
        "key": '{"model": "__model__", "messages": [{"role": "user", "content": "Hi"}], "%s": 1}',
        "part-text": '{"model": "__model__", "messages": [{"role": "user", "content": '
        '[{"type": "text", "text": "%s"}]}]}',
        "image-url": '{"model": "__model__", "messages": [{"role": "user", "content": '
        '[{"type": "image_url", "image_url": {"url": "%s"}}]}]}',
    }.items():
        for variant, s in {"high": surrogate, "low": "\\udfff", "reversed": "\\udc00\\ud800"}.items():
            add((f"surrogate-{variant}-in-{where}", (template % s).encode(), 400))
        add((f"surrogate-raw-in-{where}", (template % "X").encode().replace(b"X", b"\xed\xa0\x80"), 400))

    # 3. Wrong types and out-of-range values, field by field.
    bad_values = {
        "model": [7, None, [], {}, True, 1.5],
        "messages": [None, "Hi", 5, {}, [], [None], [1], [[]], ["Hi"], [{"content": "Hi"}], [{"role": "user"}]],
        "max_tokens": [-1, 0, "5", 1.5, [], {}, 10**30, -(10**30)],
        "max_completion_tokens": [-5, "x", 2.5, {}],
        "temperature": [-1, 2.5, "hot", [], {}, 1e308],
        "top_p": [-0.1, 1.5, "x", [], 1e308],
        "top_k": [-5, "x", 1.5],
        "n": [0, -1, 10**9, "2", 1.5, []],
        "stream": ["yes", 1, [], {}],
        "stop": [5, [5], [None], {}, ["x"] * 100],
        "seed": ["x", 1.5, [], 2**70],
        "logprobs": ["yes", 5, []],
        "top_logprobs": [-1, 1000, "x"],
        "presence_penalty": [5, -5, "x"],
        "frequency_penalty": [3, -3, []],
        "stream_options": [5, "x", {"include_usage": "yes"}],
        "response_format": [5, "json", {"type": "xml"}, {"type": 5}],
    }
    for field, values in bad_values.items():
        for i, value in enumerate(values):
            add((f"{field}-bad-{i}", _valid(**{field: value}), 400 if field != "model" else None))
    for i, role in enumerate([None, 5, [], {}, "", "robot", "USER", "system ", "tool-ish"]):
        add((f"role-bad-{i}", _msg(role=role), 400))
    for i, content in enumerate([5, {}, True, [5], ["x"], [{}], [None], [[]]]):
        add((f"content-bad-{i}", _valid(messages=[{"role": "user", "content": content}]), 400))
    bad_parts = [
        {"type": "text"},
        {"type": "text", "text": 5},
        {"type": "text", "text": None},
        {"type": "video", "video": "x"},
        {"type": 5},
        {"type": "image_url"},
        {"type": "image_url", "image_url": 5},
        {"type": "image_url", "image_url": {}},
        {"type": "image_url", "image_url": {"url": 5}},
        {"type": "image_url", "image_url": {"url": ""}},
        {"type": "image_url", "image_url": {"url": None}},
        {"type": "image_url", "image_url": {"url": "x", "detail": 5}},
        {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}},
    ]
    for i, part in enumerate(bad_parts):
        add((f"part-bad-{i}", _parts(part, {"type": "text", "text": "Hi"}), 400))
    add(("image-in-system", _valid(messages=[{"role": "system", "content": [_image_part(_uri(_png()))]}]), 400))
    add(
        (
            "image-in-assistant",
            _valid(
                messages=[
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": [_image_part(_uri(_png()))]},
                    {"role": "user", "content": "Hi"},
                ]
            ),
            400,
        )
    )
    add(("unknown-model", _valid(model="gpt-4o"), 404))
    add(("unicode-model-name", _valid(model="ｍｏｄｅｌ\u202e"), 404))
    add(("nul-in-model-name", _valid(model="qwen\0"), 404))
    add(("long-model-name", _valid(model="m" * 100_000), 404))

    # 4. Nesting (raw: deeper than Python's own JSON encoder goes).
    head = b'{"model": "__model__", "messages": [{"role": "user", "content": '
    add(("deep-content", head + b"[" * 2_000 + b'"Hi"' + b"]" * 2_000 + b"}]}", 400))
    add(("deep-object-field", _HEAD + b', "response_format": ' + b'{"a": ' * 2_000 + b"1" + b"}" * 2_001, 400))

    # 5. Images that must not be accepted.
    png, jpeg = _png(), _jpeg()
    for end in (0, 1, 8, 16, 33, 40, len(png) // 2):
        add((f"png-truncated-{end}", _parts(_image_part(_uri(png[:end])), {"type": "text", "text": "Hi"}), 400))
    for end in (0, 2, 4, 20, len(jpeg) // 4, len(jpeg) // 2):
        add(
            (
                f"jpeg-truncated-{end}",
                _parts(_image_part(_uri(jpeg[:end], "image/jpeg")), {"type": "text", "text": "?"}),
                400,
            )
        )
    for side in (30_000, 40_000, 65_535):
        add((f"png-bomb-{side}", _parts(_image_part(_uri(_png_bomb(side))), {"type": "text", "text": "Hi"}), 400))
    odd = {
        "svg": (b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>', "image/svg+xml"),
        "pdf": (b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF", "application/pdf"),
        "html": (b"<html><body>hi</body></html>", "text/html"),
        "text": (b"just text", "text/plain"),
        "zip": (b"PK\x03\x04" + b"\0" * 26, "application/zip"),
        "png-then-zip": (png[:20] + b"PK\x03\x04" + b"\0" * 26, "image/png"),
        "gif-header-only": (b"GIF89a", "image/gif"),
        "empty": (b"", "image/png"),
        "elf": (b"\x7fELF" + b"\0" * 60, "image/png"),
    }
    for name, (data, mime) in odd.items():
        add((f"image-{name}", _parts(_image_part(_uri(data, mime)), {"type": "text", "text": "Hi"}), 400))
    for i, url in enumerate(
        [
            "data:image/png;base64,!!!!",
            "data:image/png;base64,",
            "data:image/png,notbase64",
            "data:;base64,AAAA",
            "data:image/png;base64," + "A" * 5,
            "javascript:alert(1)",
            "ftp://example.com/a.png",
            "file:///etc/passwd",
            "http://127.0.0.1/a.png",
            "http://localhost:1/a.png",
            "http://169.254.169.254/latest/meta-data/",
            "http://[::1]/a.png",
            "http://0.0.0.0/a.png",
            "gopher://x/",
            "//example.com/a.png",
            "   ",
            "http://" + "a" * 5000 + ".com/x.png",
        ]
    ):
        add((f"image-url-bad-{i}", _parts(_image_part(url), {"type": "text", "text": "Hi"}), 400))
    add(("too-many-images", "__too_many_images__", 400))
    return cases


CASES = _cases()


def _materialize(value, server):
    if value == "__too_many_images__":
        n = server.config.max_images_per_request + 1
        value = _parts(*([_image_part(_uri(_png()))] * n), {"type": "text", "text": "Hi"})
    if isinstance(value, bytes):
        return value.replace(b"__model__", server.model_id.encode())
    return json.loads(json.dumps(value).replace('"__model__"', json.dumps(server.model_id)))


def test_the_corpus_has_at_least_500_cases():
    assert len(CASES) >= 500, len(CASES)
    assert len({name for name, _, _ in CASES}) == len(CASES)


def _assert_4xx_shape(r, expected):
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if expected is not None:
        assert r.status_code == expected, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "param" in err and "code" in err


def test_every_hostile_body_gets_a_4xx_and_the_server_keeps_serving(qwen_server):
    headers = {"content-type": "application/json"}
    with qwen_server.client(timeout=60) as c:
        for i, (name, value, expected) in enumerate(CASES):
            body = _materialize(value, qwen_server)
            if isinstance(body, bytes):
                r = c.post("/v1/chat/completions", content=body, headers=headers)
            else:
                r = c.post("/v1/chat/completions", json=body)
            try:
                _assert_4xx_shape(r, expected)
            except AssertionError as exc:
                raise AssertionError(f"case {name}: {exc}") from None
            assert c.get("/health").status_code == 200, name
            if i % 50 == 0:
                ok = c.post("/v1/chat/completions", json=_materialize(_valid(temperature=0), qwen_server))
                assert ok.status_code == 200, (name, ok.text)


_numbers = st.integers() | st.floats(allow_nan=False, allow_infinity=False)  # what a JSON encoder can send
_json_leaf = st.none() | st.booleans() | _numbers | st.text(max_size=20)
_json = st.recursive(
    _json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_fields = [
    "model",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "response_format",
    "stream_options",
]


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(overrides=st.dictionaries(st.sampled_from(_fields), _json, min_size=1, max_size=4))
def test_no_request_schema_fuzz_gets_a_5xx(qwen_server, overrides):
    """Random values in the request's fields: any status but a 5xx, and 4xx ones in OpenAI's shape."""
    body = {**_materialize(_valid(), qwen_server), **overrides}
    body["max_tokens"] = body["max_tokens"] if "max_tokens" in overrides else 2
    with qwen_server.client(timeout=60) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code < 500, (overrides, r.status_code, r.text[:300])
        if r.status_code >= 400:
            _assert_4xx_shape(r, None)
        elif body.get("stream") is not True:
            assert "choices" in r.json()
