"""Tool calls read back out of each format's text, whole and streamed in pieces."""

from __future__ import annotations

import json

import pytest

from vlmserve.entrypoints.openai.tool_stream import ToolCallStream
from vlmserve.models.tool_calls import PARSERS, detect, supports_tools

WEATHER = {"city": "Paris", "days": 3}
CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        "Let me check.",
        [("weather", WEATHER)],
    ),
    (
        "hermes",
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": 1}}',
        "",
        [("a", {}), ("b", {"x": 1})],
    ),  # the second block unterminated: the output ran out there
    (
        "mistral",
        '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris", "days": 3}}]',
        "",
        [("weather", WEATHER)],
    ),
    ("mistral", '[TOOL_CALLS]weather[ARGS]{"city": "Paris", "days": 3}', "", [("weather", WEATHER)]),
    ("mistral", '[{"name": "weather", "arguments": {"city": "Paris", "days": 3}}]', "", [("weather", WEATHER)]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris", "days": 3}}',
        "",
        [("weather", WEATHER)],
    ),
    (
        "llama3_json",
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
        "",
        [("a", {}), ("b", {"x": 1})],
    ),
    ("pythonic", '[weather(city="Paris", days=3), tools.ping()]', "", [("weather", WEATHER), ("tools.ping", {})]),
]
CASES.append(
    (
        "hermes",
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "argu',
        "",
        [("a", {})],
    )
)  # the output ran out inside the second call: the first stands
CASES.append(
    (
        "llama3_json",
        '{"name": "run", "parameters": {"code": "a; {b}"}}',
        "",
        [("run", {"code": "a; {b}"})],
    )
)  # a ";" inside a string is no separator
NOT_CALLS = [
    ("hermes", "Plain words, no call."),
    ("hermes", "<tool_call>not json</tool_call>"),
    ("mistral", "[TOOL_CALLS] nothing here"),
    ("llama3_json", '{"no": "name"}'),
    ("llama3_json", "A sentence {with braces}."),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[weather(city=open('x'))]"),  # only literals: nothing is evaluated
    ("pythonic", "[f(x={1, 2})]"),  # values JSON cannot hold
    ("pythonic", '[f(x=b"a")]'),
    ("pythonic", "[f(x={[1]: 2})]"),
    ("hermes", '<tool_call>{"name": "create", "arguments": {"user": {"name": "Bob"}'),  # cut inside its arguments
    ("mistral", '[{"name": "Alice", "age": 3}]'),  # an answer, not a call: no marker, no arguments
    ("llama3_json", '{"name": "Paris", "country": "France"}'),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt,text,content,expected", CASES)
def test_calls_are_read_whole_and_streamed(fmt, text, content, expected):
    parser = PARSERS[fmt]()
    got_content, calls = parser.extract(text)
    assert (got_content, _calls(calls)) == (content, expected)
    for size in (1, 3, 7):  # streamed in pieces: the same content (in order) and calls
        stream = ToolCallStream(parser)
        sent = "".join(stream.feed(text[i : i + size]) for i in range(0, len(text), size))
        rest, streamed = stream.finish()
        assert ((sent + rest).strip(), _calls(streamed)) == (content, expected)


@pytest.mark.parametrize("fmt,text", NOT_CALLS)
def test_text_that_is_not_a_call_stays_text(fmt, text):
    parser = PARSERS[fmt]()
    assert parser.extract(text) == (text, [])
    stream = ToolCallStream(parser)
    sent = "".join(stream.feed(ch) for ch in text)
    rest, calls = stream.finish()
    assert (sent + rest, calls) == (text, [])


def test_content_before_a_marker_streams_before_the_output_ends():
    stream = ToolCallStream(PARSERS["hermes"]())
    assert stream.feed("Checking the ") == "Checking the "
    assert stream.feed("weather <tool") == "weather "  # "<tool" may open a call: held
    assert stream.feed('_call>{"name": "w", "arguments": {}}') == ""
    assert _calls(stream.finish()[1]) == [("w", {})]


def test_format_detected_from_the_template():
    assert detect("... <tool_call> ... tools ...") == "hermes"
    assert detect("{{ '[TOOL_CALLS]' }} tools") == "mistral"
    assert detect("<|python_tag|> tools") == "llama3_json"
    assert detect("{% if tools %}") == "hermes"
    assert supports_tools("{% if tools %}x{% endif %}") and not supports_tools("{{ messages }}")


def test_every_format_has_a_grammar_llguidance_takes():
    import llguidance

    tools = [
        {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris"]}, "days": {"type": "integer"}, "hot": {"type": "boolean"}},
                "required": ["city"],
            },
        },
        {"name": "ping", "parameters": {"type": "object", "properties": {}}},
        {
            "name": "opt",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}},
        },
    ]
    for name, parser in PARSERS.items():
        for parallel in (False, True):
            grammar = parser().grammar(tools, parallel)
            assert grammar and llguidance.LLMatcher.validate_grammar(grammar) == "", (name, parallel)


def test_pythonic_calls_read_json_literals():
    """A forced pythonic call writes its values as JSON (true, null): they read back as such."""
    content, calls = PARSERS["pythonic"]().extract('[f(a=true, b=null, c=[1, {"k": false}])]')
    assert content == "" and _calls(calls) == [("f", {"a": True, "b": None, "c": [1, {"k": False}]})]


def test_grammars_keep_nested_schema_definitions_reachable():
    """Pydantic-made parameters ($defs and $ref) stay valid inside the call wrapper."""
    import llguidance

    nested = {
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/Loc"}, "flag": True},
        "required": ["where"],
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    }
    tools = [{"name": "a", "parameters": nested}, {"name": "b", "parameters": nested}]
    for name, parser in PARSERS.items():
        grammar = parser().grammar(tools, True)
        assert grammar and llguidance.LLMatcher.validate_grammar(grammar) == "", name
    # Names a Python call cannot spell: the pythonic format asks instead of forcing.
    assert PARSERS["pythonic"]().grammar([{"name": "get-weather", "parameters": {}}], False) is None


def test_a_call_to_an_undeclared_function_stays_text():
    """Whole and streamed: only functions the request declared become calls."""
    from vlmserve.entrypoints.openai import tool_use
    from vlmserve.protocol import ChatRequest, SamplingParams

    chat = ChatRequest([], SamplingParams(), tools=[{"name": "weather"}], tool_choice="auto")
    parser = PARSERS["hermes"]()
    text = 'Sure.<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>'
    assert tool_use.split(text, parser, chat) == (text, [])
    stream = tool_use.stream(parser, chat)
    sent = stream.feed(text)
    rest, calls = stream.finish()
    assert (sent + rest, calls) == (text, [])
    ok = '<tool_call>{"name": "weather", "arguments": {}}</tool_call>'
    assert _calls(tool_use.split(ok, parser, chat)[1]) == [("weather", {})]
