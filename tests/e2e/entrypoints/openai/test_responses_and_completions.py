"""POST /v1/responses and /v1/completions through the real `openai` client."""

from __future__ import annotations

import json

import openai
import pytest

from support.helpers import data_uri, images

from .test_tools import WEATHER, _client, tool_server  # noqa: F401 - the fixture, served with a tool template


def _image_input(text="Describe the image."):
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_image", "image_url": data_uri(images()[0])},
                {"type": "input_text", "text": text},
            ],
        }
    ]


def test_responses_create_with_an_image(qwen_server):
    reply = _client(qwen_server).responses.create(
        model=qwen_server.model_id, input=_image_input(), instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert reply.object == "response" and reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output[0].type == "message" and reply.output[0].status == "incomplete" and reply.output_text
    assert reply.usage.output_tokens == 8 and reply.usage.input_tokens > 8
    # The same text as chat completions gives for the same conversation.
    chat = _client(qwen_server).chat.completions.create(
        model=qwen_server.model_id,
        messages=[
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_uri(images()[0])}},
                    {"type": "text", "text": "Describe the image."},
                ],
            },
        ],
        max_completion_tokens=8,
        temperature=0,
    )
    assert reply.output_text == chat.choices[0].message.content


def test_responses_stream_events_in_order(qwen_server):
    """Cut short by max_output_tokens, the stream ends with `response.incomplete`, as OpenAI's
    does (the SDK's `responses.stream()` helper waits for `response.completed` only)."""
    kinds, deltas, final, numbers = [], [], None, []
    for event in _client(qwen_server).responses.create(
        model=qwen_server.model_id, input="Say something.", max_output_tokens=6, temperature=0, stream=True
    ):
        kinds.append(event.type)
        numbers.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        final = getattr(event, "response", final)
    assert numbers == list(range(len(numbers)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert final.status == "incomplete" and final.usage.output_tokens == 6
    assert "".join(deltas) == final.output_text
    whole = _client(qwen_server).responses.create(
        model=qwen_server.model_id, input="Say something.", max_output_tokens=6, temperature=0
    )
    assert whole.output_text == final.output_text


def test_responses_function_calls_and_their_outputs(tool_server):  # noqa: F811
    tool = {"type": "function", **WEATHER["function"]}
    client = _client(tool_server)
    forced = dict(tools=[tool], tool_choice="required", parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    reply = client.responses.create(model=tool_server.model_id, input=_image_input("Weather?"), **forced)
    calls = [o for o in reply.output if o.type == "function_call"]
    assert (
        len(calls) == 1
        and calls[0].name == "get_weather"
        and json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    )
    follow = _image_input("Weather?") + [
        {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name, "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny."},
    ]
    again = client.responses.create(model=tool_server.model_id, input=follow, tools=[tool], max_output_tokens=4)
    assert again.status in ("completed", "incomplete")
    with client.responses.stream(model=tool_server.model_id, input="Weather?", **forced) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    assert [o.type for o in final.output] == ["function_call"]


def test_responses_refuses_what_it_cannot_do(qwen_server):
    client = _client(qwen_server)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=qwen_server.model_id, input="Hi", previous_response_id="resp_123")
    assert "stores no responses" in err.value.message
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=qwen_server.model_id, input="Hi", tools=[{"type": "web_search"}])


def test_responses_errors_name_its_own_fields(qwen_server):
    """Bad values are reported under the Responses API's names, not Chat Completions' it maps to."""
    client = _client(qwen_server)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=qwen_server.model_id, input="Hi", max_output_tokens=0)
    assert err.value.param == "max_output_tokens" and "'max_output_tokens'" in err.value.message
    assert "max_completion_tokens" not in err.value.message
    with pytest.raises(openai.BadRequestError) as err:  # past the context
        client.responses.create(model=qwen_server.model_id, input="word " * 40000, max_output_tokens=8)
    assert err.value.param == "input"
    context = qwen_server.state.context_length
    with pytest.raises(openai.BadRequestError) as err:  # the prompt fits, not with the answer's room
        words = (context - 2000) // 3  # the fixture's tokenizer makes ~3 tokens of "word "
        client.responses.create(model=qwen_server.model_id, input="word " * words, max_output_tokens=4000)
    assert err.value.param == "max_output_tokens", err.value.message


def test_responses_json_schema_format(qwen_server):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    reply = _client(qwen_server).responses.create(
        model=qwen_server.model_id,
        input=_image_input(),
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
        max_output_tokens=60,
    )
    data = json.loads(reply.output_text)
    assert set(data) == {"ok", "n"} and isinstance(data["ok"], bool) and 0 <= data["n"] <= 9


def test_completions_raw_prompt_whole_and_streamed(qwen_server):
    client = _client(qwen_server)
    kwargs = dict(model=qwen_server.model_id, prompt="Once upon a time", max_tokens=6, temperature=0)
    whole = client.completions.create(**kwargs)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 6
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == whole.choices[0].text
    echoed = client.completions.create(echo=True, logprobs=2, **kwargs)
    assert echoed.choices[0].text == "Once upon a time" + whole.choices[0].text
    lp = echoed.choices[0].logprobs
    assert len(lp.tokens) == 6 and all(len(top) == 2 for top in lp.top_logprobs)
    # No chat template: the prompt is tokenized as it is.
    prompt_tokens = len(qwen_server.state.preprocessor.tokenizer("Once upon a time")["input_ids"])
    assert whole.usage.prompt_tokens == prompt_tokens


def test_an_explicit_null_tool_choice_is_echoed_as_auto(qwen_server):
    """An explicit null means "not set": the Response echoes OpenAI's default, which its schema requires."""
    from openai.types.responses import Response

    body = {"model": qwen_server.model_id, "input": "Hi", "max_output_tokens": 2, "tool_choice": None}
    with qwen_server.client() as c:
        r = c.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert Response.model_validate(r.json()).tool_choice == "auto"


def test_streamed_completions_keep_every_logprob_past_a_stop_string(qwen_server):
    """Tokens whose text is held back as the possible start of a stop string still carry their
    logprobs in a stream: as many entries as the whole answer has."""
    client = _client(qwen_server)
    kwargs = dict(model=qwen_server.model_id, prompt="Once upon a time", max_tokens=24, temperature=0, logprobs=0)
    text = client.completions.create(**kwargs).choices[0].text
    checked = 0
    for start in range(2, len(text) - 4, 3):
        stop = text[start : start + 4]
        if not stop.strip() or text.find(stop) != start:
            continue
        whole = client.completions.create(stop=stop, **kwargs).choices[0]
        chunks = [c for c in client.completions.create(stop=stop, stream=True, **kwargs) if c.choices]
        streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert streamed == whole.logprobs.tokens, stop
        offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
        assert offsets == whole.logprobs.text_offset, stop
        assert "".join(c.choices[0].text for c in chunks) == whole.text == text[:start]
        checked += 1
    assert checked >= 3


def test_request_id_header(qwen_server):
    raw = _client(qwen_server).chat.completions.with_raw_response.create(
        model=qwen_server.model_id, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=2
    )
    assert raw.headers["x-request-id"] == raw.parse().id


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_failure_after_the_headers_ends_the_stream_with_one_error_event(qwen_server, monkeypatch, route):
    """Once a stream's headers are sent, an unexpected error becomes its one error event (and a
    logged 500), never a cut connection; chat completions and completions alike."""
    import httpx

    from vlmserve.entrypoints.openai import sse

    def broken(*args, **kwargs):
        raise RuntimeError("renderer broke")

    if route == "chat":
        monkeypatch.setattr(sse.ChunkLines, "content", broken)
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to ten."}]}
    else:
        from vlmserve.entrypoints.openai import serving_completions

        monkeypatch.setattr(serving_completions, "_legacy_logprobs", broken)
        path, body = "/v1/completions", {"prompt": "Count to ten:"}
    body |= {"model": qwen_server.model_id, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.Client(base_url=qwen_server.base_url, timeout=60) as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    errors = [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: {") and '"error"' in line]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "internal_error"
    assert lines[-1] != "data: [DONE]" and json.loads(lines[-1][len("data: ") :]) == errors[0]
