"""Agent frameworks against the server as they ship: LangChain's ChatOpenAI (bind_tools,
with_structured_output) and LiteLLM (tools, response_format)."""

from __future__ import annotations

import json
import os

import pydantic
import pytest

from support.helpers import data_uri, images

from .test_tools import WEATHER, tool_server  # noqa: F401 - the fixture, served with a tool template

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=9)


def _image_message_parts(text):
    return [{"type": "image_url", "image_url": {"url": data_uri(images()[0])}}, {"type": "text", "text": text}]


def _check_weather_args(args: dict):
    assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 9


def _chat(server, **kwargs):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        base_url=server.base_url + "/v1", api_key="k", model=server.model_id, max_retries=0, **kwargs
    )


def test_langchain_bind_tools_gets_tool_calls(tool_server):  # noqa: F811
    from langchain_core.messages import HumanMessage

    llm = _chat(tool_server, temperature=0, max_tokens=200).bind_tools([WEATHER], tool_choice="get_weather")
    reply = llm.invoke([HumanMessage(content=_image_message_parts("Weather?"))])
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    _check_weather_args(reply.tool_calls[0]["args"])


@pytest.mark.parametrize("server", ["qwen_server", "llava_server"])
def test_langchain_structured_output(server, request):
    from langchain_core.messages import HumanMessage

    server = request.getfixturevalue(server)
    llm = _chat(server, temperature=0, max_tokens=80).with_structured_output(Weather)
    result = llm.invoke([HumanMessage(content=_image_message_parts("The weather, as JSON."))])
    assert isinstance(result, Weather) and 1 <= result.days <= 9


def test_litellm_tools_and_response_format(tool_server):  # noqa: F811
    litellm = pytest.importorskip("litellm")
    common = dict(model=f"openai/{tool_server.model_id}", api_base=tool_server.base_url + "/v1", api_key="k")
    messages = [{"role": "user", "content": _image_message_parts("Weather?")}]
    reply = litellm.completion(
        messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0, **common
    )
    calls = reply.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    _check_weather_args(json.loads(calls[0].function.arguments))
    assert reply.choices[0].finish_reason == "tool_calls"
    structured = litellm.completion(messages=messages, response_format=Weather, max_tokens=80, temperature=0, **common)
    Weather.model_validate_json(structured.choices[0].message.content)
