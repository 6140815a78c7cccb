"""The real `openai` package against a uvicorn server on 127.0.0.1."""

from __future__ import annotations

import openai
import pytest

from support.helpers import data_uri, images


@pytest.fixture
def client(qwen_server):
    return openai.OpenAI(base_url=qwen_server.base_url + "/v1", api_key="test-key", max_retries=0)


def _messages():
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri(images()[0])}},
                {"type": "text", "text": "Describe the image."},
            ],
        }
    ]


def test_openai_client_non_streaming(client, qwen_server):
    reply = client.chat.completions.create(
        model=qwen_server.model_id, messages=_messages(), max_completion_tokens=8, temperature=0
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens == 8
    assert reply.choices[0].finish_reason == "length"


def test_openai_client_streaming(client, qwen_server):
    reply = client.chat.completions.create(
        model=qwen_server.model_id, messages=_messages(), max_completion_tokens=8, temperature=0
    )
    stream = client.chat.completions.create(
        model=qwen_server.model_id,
        messages=_messages(),
        max_completion_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == reply.choices[0].message.content
    assert usage.completion_tokens == 8
