"""What a chat request's tools mean for its generation and for its answer.

Before generation: tools need a chat template that renders them (else a 400), and a forced
choice (`required`, or a named function) becomes the parser format's grammar. After: each
choice's text is split into content and calls, whole or as a stream (tool_stream.py).
"""

from __future__ import annotations

from dataclasses import replace

import llguidance

from vlmserve.entrypoints.openai.errors import APIError
from vlmserve.entrypoints.openai.tool_stream import ToolCallStream, settle
from vlmserve.models.tool_calls import PARSERS, ToolCall, ToolParser, detect, supports_tools
from vlmserve.protocol import ChatRequest


def choose_parser(name: str, template: str | None) -> ToolParser:
    """--tool-call-parser, or (auto) the format the chat template asks for."""
    return PARSERS[detect(template) if name == "auto" else name]()


def uses_tools(chat: ChatRequest) -> bool:
    return bool(chat.tools) and chat.tool_choice != "none"


def prepare(chat: ChatRequest, parser: ToolParser, template: str | None) -> ChatRequest:
    """400 for tools the template cannot show; a forced choice's grammar in the sampling params."""
    if not uses_tools(chat):
        return chat
    if not supports_tools(template):
        raise APIError(
            400,
            "this model's chat template does not support tools (serve it with a --chat-template that does)",
            param="tools",
            code="tools_not_supported",
        )
    named = chat.tool_choice.get("name") if isinstance(chat.tool_choice, dict) else None
    if chat.tool_choice != "required" and named is None:
        return chat
    tools = [t for t in chat.tools if t["name"] == named] if named else chat.tools
    grammar = parser.grammar(tools, chat.parallel_tool_calls and named is None)
    if grammar is None:
        return chat  # this format has no grammar: the model is asked, not forced
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise APIError(400, f"unsupported tool parameters schema: {problem.splitlines()[0]}", param="tools")
    return replace(chat, sampling=replace(chat.sampling, grammar=grammar))


def split(text: str, parser: ToolParser, chat: ChatRequest) -> tuple[str, list[ToolCall]]:
    """A finished choice's (content, calls)."""
    return settle(text, *parser.extract(text), lambda calls: _allowed(calls, chat))


def _allowed(calls: list[ToolCall], chat: ChatRequest) -> list[ToolCall]:
    """Calls to functions the request declared (anything else stays text), at most one unless parallel."""
    declared = {t["name"] for t in chat.tools or []}
    if any(c.name not in declared for c in calls):
        return []
    return calls if chat.parallel_tool_calls else calls[:1]


def stream(parser: ToolParser, chat: ChatRequest) -> ToolCallStream:
    """A streamed choice's content deltas, with its calls held back to the end."""
    return ToolCallStream(parser, lambda calls: _allowed(calls, chat))
