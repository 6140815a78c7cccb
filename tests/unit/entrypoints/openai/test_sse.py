"""The pre-rendered content chunk is byte for byte the chunk dict's JSON line."""

from __future__ import annotations

import json

import pytest

from vlmserve.entrypoints.openai import sse

TEXTS = [" word", "", 'a "quoted" \\ back\\slash', "line\nbreak\ttab", "héllo 日本 🙂", "\x00\x1f", "</s>"]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["qwen2-vl-2b", 'odd "name" é/\\', "\x00vlmserve-content\x00"])
def test_content_line_equals_full_chunk(model, include_usage):
    lines = sse.ChunkLines("chatcmpl-1", model, 1700000000, include_usage)
    for index in (0, 3):
        for text in TEXTS:
            fast = lines.content(index, text)
            assert fast == lines.choice(index, {"content": text})
            body = json.loads(fast[len("data: ") :])
            assert body["choices"] == [
                {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
            ]
            assert ("usage" in body) == include_usage and body["model"] == model
