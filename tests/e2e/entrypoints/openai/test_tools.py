"""Tool calling and JSON Schema outputs through the real `openai` client: calls forced by a
grammar come back as OpenAI tool calls (whole and streamed), tool results render through the
chat template, a template without tools is a 400, and `parse()` gets its object."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pydantic
import pytest

from support.helpers import data_uri, images
from support.server import start_server

TEMPLATES = Path(__file__).parents[3] / "support" / "templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


@pytest.fixture(scope="module")
def tool_server():
    """The Qwen2-VL fixture served with a chat template that shows tools (hermes format)."""
    server = start_server("qwen2_vl", chat_template=str(TEMPLATES / "qwen_vl_tools.jinja"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def llava_tool_server():
    """The LLaVA fixture served with a template that asks for Llama-3 JSON calls."""
    server = start_server("llava", chat_template=str(TEMPLATES / "llama3_json_tools.jinja"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pythonic_tool_server():
    """The LLaVA fixture again, told its calls are pythonic lists."""
    server = start_server(
        "llava", chat_template=str(TEMPLATES / "llama3_json_tools.jinja"), tool_call_parser="pythonic"
    )
    yield server
    server.stop()


def _client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="k", max_retries=0)


def _ask(text="What is the weather like there?"):
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri(images()[0])}},
                {"type": "text", "text": text},
            ],
        }
    ]


def _check_call(call, names):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 9 and set(args) == {"city", "days"}
    else:
        assert args == {}


@pytest.mark.parametrize("server", ["tool_server", "llava_tool_server", "pythonic_tool_server"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_come_back_as_calls(server, choice, request):
    """Two families, three formats (hermes and llama3_json detected from the templates, pythonic named)."""
    tool_server = request.getfixturevalue(server)
    formats = {"tool_server": "hermes", "llava_tool_server": "llama3_json", "pythonic_tool_server": "pythonic"}
    assert tool_server.state.tool_parser.name == formats[server]
    reply = _client(tool_server).chat.completions.create(
        model=tool_server.model_id,
        messages=_ask(),
        tools=[WEATHER, TIME],
        tool_choice=choice,
        max_completion_tokens=200,
        temperature=0.8,
        seed=3,
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls
    names = {"get_weather"} if isinstance(choice, dict) else {"get_weather", "get_time"}
    for call in message.tool_calls:
        _check_call(call, names)


def test_streamed_tool_calls_match_the_whole_answer(tool_server):
    kwargs = dict(
        model=tool_server.model_id,
        messages=_ask(),
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_completion_tokens=200,
        temperature=0,
    )
    client = _client(tool_server)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" == whole.finish_reason
    assert len(whole.message.tool_calls) == 1  # parallel_tool_calls false: one call
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (whole.message.tool_calls[0].function.name, json.loads(whole.message.tool_calls[0].function.arguments))
    ]


def test_an_answer_cut_by_the_token_limit_says_length_not_tool_calls(tool_server):
    """A forced call that the token limit cuts short (before its closing tag or EOS) may still
    parse, but the answer did not end on its own: `length`, whole and streamed, as OpenAI says."""
    kwargs = dict(
        model=tool_server.model_id,
        messages=_ask(),
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    client = _client(tool_server)
    whole = client.chat.completions.create(max_completion_tokens=200, **kwargs)
    assert whole.choices[0].finish_reason == "tool_calls"
    tokens = whole.usage.completion_tokens
    for limit in (tokens - 1, tokens - 2, tokens - 3):
        cut = client.chat.completions.create(max_completion_tokens=limit, **kwargs).choices[0]
        assert cut.finish_reason == "length", (limit, cut.message)
        finish = [
            c.choices[0].finish_reason
            for c in client.chat.completions.create(max_completion_tokens=limit, stream=True, **kwargs)
            if c.choices and c.choices[0].finish_reason
        ]
        assert finish == ["length"], limit


def test_tool_results_render_through_the_template(tool_server):
    messages = _ask() + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C."},
    ]
    reply = _client(tool_server).chat.completions.create(
        model=tool_server.model_id, messages=messages, tools=[WEATHER], max_completion_tokens=4, temperature=0
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")

    from vlmserve.entrypoints.openai.chat_request import parse_chat_request

    chat = parse_chat_request(
        {"model": tool_server.model_id, "messages": messages, "tools": [WEATHER]},
        tool_server.config,
        {tool_server.model_id},
        4096,
    )
    prompt = tool_server.state.preprocessor.render(chat)
    assert '"name": "get_weather"' in prompt  # the definition, shown to the model
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>' in prompt
    assert "<tool_response>\nSunny, 24 C.\n</tool_response>" in prompt


def test_no_tools_in_the_template_is_a_400(qwen_server):
    with pytest.raises(openai.BadRequestError) as err:
        _client(qwen_server).chat.completions.create(
            model=qwen_server.model_id, messages=_ask(), tools=[WEATHER], max_completion_tokens=4
        )
    assert err.value.code == "tools_not_supported"
    # tool_choice "none": the tools are not shown, and the request is answered
    reply = _client(qwen_server).chat.completions.create(
        model=qwen_server.model_id, messages=_ask(), tools=[WEATHER], tool_choice="none", max_completion_tokens=4
    )
    assert reply.choices[0].message.tool_calls is None


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=9)
    sunny: bool


@pytest.mark.parametrize("server", ["qwen_server", "llava_server"])
def test_parse_returns_the_schema_object_with_an_image(server, request):
    server = request.getfixturevalue(server)
    reply = _client(server).beta.chat.completions.parse(
        model=server.model_id,
        messages=_ask("Describe the weather."),
        response_format=Weather,
        max_completion_tokens=120,
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Weather) and 1 <= parsed.days <= 9


def test_bad_schemas_and_choices_are_400s(qwen_server):
    client = _client(qwen_server)
    bad = [
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}),
        dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
        dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}),
        dict(tool_choice="required"),
        dict(
            tools=[WEATHER],
            tool_choice="required",
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        ),
    ]
    for extra in bad:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model=qwen_server.model_id, messages=_ask(), max_completion_tokens=4, **extra
            )


def test_mm_processor_kwargs_bound_the_image_tokens(qwen_server):
    """Per request, min_pixels / max_pixels scale each image before the processor: fewer or more
    image tokens; other keys are a 400."""
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (120, 120), (200, 40, 90)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]}
    ]
    client = _client(qwen_server)

    def prompt_tokens(**kwargs):
        reply = client.chat.completions.create(
            model=qwen_server.model_id, messages=messages, max_completion_tokens=1, extra_body=kwargs
        )
        return reply.usage.prompt_tokens

    plain = prompt_tokens()
    small = prompt_tokens(mm_processor_kwargs={"max_pixels": 56 * 56})
    large = prompt_tokens(mm_processor_kwargs={"min_pixels": 200 * 200})
    assert small < plain < large
    for bad in ({"do_resize": False}, {"min_pixels": 10}, {"min_pixels": 90000, "max_pixels": 4000}):
        with pytest.raises(openai.BadRequestError):
            prompt_tokens(mm_processor_kwargs=bad)
