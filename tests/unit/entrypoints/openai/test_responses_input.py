"""Responses API input items as chat messages (serving_responses._messages)."""

from __future__ import annotations

import pytest

from vlmserve.entrypoints.openai.errors import APIError
from vlmserve.entrypoints.openai.serving_responses import _messages


def test_items_become_the_chat_turns_a_template_expects():
    messages = _messages(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Rome"}'},
                {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "Sunny"}]},
                {"type": "function_call_output", "call_id": "c2", "output": "noon"},
            ],
        }
    )
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assistant = messages[2]  # its text and both calls: one turn
    assert assistant["content"] == [{"type": "text", "text": "Checking."}]
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert [m["content"] for m in messages[3:]] == ["Sunny", "noon"]


@pytest.mark.parametrize(
    "body",
    [
        {"input": []},
        {"input": [{"type": "reasoning"}]},
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        {"input": "hi", "instructions": 3},
    ],
)
def test_items_it_cannot_take_are_400s(body):
    with pytest.raises(APIError) as err:
        _messages(body)
    assert err.value.status == 400
