"""POST /v1/responses: OpenAI's Responses API over the chat path.

The request (input items, instructions, function tools, text.format) becomes a chat request;
the answer is a Response object (output items: a message, function calls), or its documented
stream of events. Nothing is stored: `previous_response_id` is a 400 that says so.
"""

from __future__ import annotations

import json
import logging
import secrets
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vlmserve.entrypoints.openai import chat_response, tool_use
from vlmserve.entrypoints.openai.errors import APIError
from vlmserve.entrypoints.openai.serving_chat import (
    answers_in_openai_shape,
    collect,
    event_stream,
    failure,
    parse_chat,
    start,
)
from vlmserve.entrypoints.openai.streams import merge
from vlmserve.protocol import ChatRequest, EngineError

log = logging.getLogger("vlmserve.request")
_PASSED_ON = (
    "model", "temperature", "top_p", "stream", "parallel_tool_calls", "seed", "top_k", "logit_bias",
    "repetition_penalty", "min_p", "min_tokens",
)  # fmt: skip


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _content(content, param: str) -> str | list[dict]:
    """A message's content in chat form: input_text/output_text -> text, input_image -> image_url."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("'content' must be a string or an array of content parts", param)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise _bad("an input_image needs 'image_url' (a URL or a data URI); file ids are not taken", param)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "refusal":
            parts.append({"type": "text", "text": part.get("refusal", "")})
        else:
            raise _bad(f"unsupported content part type {kind!r}", f"{param}[{j}]")
    return parts


def _messages(body: dict) -> list[dict]:
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("'input' must be a string or a non-empty array of items", "input")
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {}}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments", "{}")}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # its text, then its calls: one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):  # content parts: their text (a tool result's images are not taken)
                text = "".join(p.get("text", "") for p in output if isinstance(p, dict))
            else:
                text = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        else:
            raise _bad(f"unsupported input item type {kind!r}", param)
    return messages


def _tools(body: dict) -> dict:
    """Responses' flat function tools and tool_choice in the chat shape."""
    out = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be an array", "tools")
        chat_tools = []
        for j, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise _bad("only function tools are supported", f"tools[{j}]")
            fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            chat_tools.append({"type": "function", "function": fn})
        out["tools"] = chat_tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise _bad("'tool_choice' may name a function only", "tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def _format(body: dict) -> dict:
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("'text.format.type' must be 'text', 'json_object' or 'json_schema'", "text.format")
    if fmt["type"] != "json_schema":
        return {"response_format": {"type": fmt["type"]}}
    spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


# Chat Completions' fields that a Responses request names otherwise (its errors use the latter).
RESPONSES_PARAMS = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}


def parse_response_request(body, server) -> ChatRequest:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    if body.get("previous_response_id") is not None:
        raise _bad(
            "this server stores no responses: send the whole conversation in 'input' instead of 'previous_response_id'",
            "previous_response_id",
        )
    if body.get("conversation") is not None:
        raise _bad("this server keeps no conversations: send the whole conversation in 'input'", "conversation")
    chat_body = {k: body[k] for k in _PASSED_ON if k in body}
    chat_body["messages"] = _messages(body)
    if body.get("max_output_tokens") is not None:
        chat_body["max_completion_tokens"] = body["max_output_tokens"]
    chat_body.update(_tools(body))
    chat_body.update(_format(body))
    return parse_chat(chat_body, server)


# ---- the answer -------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _status(finish: str | None) -> str:
    """A Response's (and its message's) status from the engine's finish reason."""
    return "incomplete" if finish == "length" else "completed"


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [] if status == "in_progress" else [part],
    }


def _call_item(call: dict, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status == "completed" else "",
        "status": status,
    }


class ResponseShape:
    """The Response object around a request's output."""

    def __init__(self, rid: str, body_echo: dict, model: str):
        self.rid, self.echo, self.model = rid, body_echo, model
        self.created = int(time.time())

    def build(self, status: str, output: list[dict], usage: dict | None) -> dict:
        incomplete = status == "incomplete"
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": usage,
            **self.echo,
        }


def _usage(u: dict) -> dict:
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"], "cache_write_tokens": 0},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def _echo(body: dict, chat: ChatRequest) -> dict:
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": chat.sampling.temperature,
        "top_p": chat.sampling.top_p,
        "parallel_tool_calls": chat.parallel_tool_calls,
        "tool_choice": body.get("tool_choice") or "auto",  # an explicit null is "not set"
        "tools": body.get("tools") or [],
        "text": {"format": fmt or {"type": "text"}},
        "metadata": body.get("metadata") or {},
        "store": False,
    }


@answers_in_openai_shape
async def responses(request: Request) -> Response:
    seen: dict = {}

    def parse(body, server):
        seen["body"] = body
        return parse_response_request(body, server)

    started = await start(request, parse, prefix="resp", params=RESPONSES_PARAMS)
    if isinstance(started, Response):
        return started
    server = request.app.state.server
    rid = "resp_" + started.request_id.split("-", 1)[1]
    shape = ResponseShape(rid, _echo(seen["body"], started.chat), server.model_id)
    if started.chat.stream:
        return event_stream(_events(shape, started, server.tool_parser), rid)
    result = await collect(request, started)
    if isinstance(result, Response):
        return result
    choices, usage = result
    message = choices[0]["message"]
    status = _status(started.engine_finish[0])
    output = [_message_item(_id("msg"), message["content"], status)] if message.get("content") else []
    output += [_call_item(c) for c in message.get("tool_calls") or []]
    return JSONResponse(shape.build(status, output, _usage(usage)), headers={"x-request-id": rid})


def _event(kind: str, seq: list[int], **fields) -> str:
    seq[0] += 1
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq[0] - 1, **fields})}\n\n"


async def _events(shape: ResponseShape, started, parser):
    chat, seq = started.chat, [0]
    tools = tool_use.stream(parser, chat) if tool_use.uses_tools(chat) else None
    yield _event("response.created", seq, response=shape.build("in_progress", [], None))
    yield _event("response.in_progress", seq, response=shape.build("in_progress", [], None))
    item_id, text, output = _id("msg"), "", []

    def deltas(piece: str):
        nonlocal text
        if not piece:
            return
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        if not text:
            opening = _message_item(item_id, "", "in_progress")
            yield _event("response.output_item.added", seq, output_index=0, item=opening)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield _event("response.content_part.added", seq, **where, part=part)
        text += piece
        yield _event("response.output_text.delta", seq, **where, delta=piece, logprobs=[])

    try:
        async for _, event in merge(started.streams):
            if event.finish_reason is not None and event.finish_reason.failed:
                f = failure(event)
                yield _event("error", seq, code=f.code, message=f.message, param=None)
                yield _failed(shape, seq, f.code, f.message)
                return
            piece = tools.feed(event.text) if tools is not None and event.text else event.text
            for line in deltas(piece):
                yield line
            if event.finish_reason is None:
                continue
            calls = []
            if tools is not None:
                rest, calls = tools.finish()
                for line in deltas(rest):
                    yield line
            status = _status(event.finish_reason.value)
            if text:
                item = _message_item(item_id, text, status)
                part = item["content"][0]
                where = {"item_id": item_id, "output_index": 0, "content_index": 0}
                yield _event("response.output_text.done", seq, **where, text=text, logprobs=[])
                yield _event("response.content_part.done", seq, **where, part=part)
                yield _event("response.output_item.done", seq, output_index=0, item=item)
                output.append(item)
            for call in calls:
                item = _call_item(call.to_openai())
                index = len(output)
                pending = {**item, "arguments": "", "status": "in_progress"}
                yield _event("response.output_item.added", seq, output_index=index, item=pending)
                args = item["arguments"]
                yield _event(
                    "response.function_call_arguments.delta", seq, item_id=item["id"], output_index=index, delta=args
                )
                yield _event(
                    "response.function_call_arguments.done",
                    seq,
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
                yield _event("response.output_item.done", seq, output_index=index, item=item)
                output.append(item)
            usage = _usage(chat_response.usage_dict(event.prompt_tokens, event.completion_tokens, event.cached_tokens))
            kind = "response.incomplete" if status == "incomplete" else "response.completed"
            yield _event(kind, seq, response=shape.build(status, output, usage))
    except EngineError as exc:
        yield _event("error", seq, code=exc.code, message=exc.message, param=exc.param)
        yield _failed(shape, seq, exc.code, exc.message)
    except Exception:  # noqa: BLE001 - the headers are gone: end the stream with its failure
        log.exception("response stream failed")
        yield _event("error", seq, code="internal_error", message="internal server error", param=None)
        yield _failed(shape, seq, "internal_error", "internal server error")


def _failed(shape: ResponseShape, seq: list[int], code, message: str) -> str:
    failed = {**shape.build("failed", [], None), "error": {"code": code or "server_error", "message": message}}
    return _event("response.failed", seq, response=failed)
