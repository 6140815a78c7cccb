"""POST /v1/chat/completions: parse, admit and preprocess, then answer whole or as a stream."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field, replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from vlmserve.entrypoints.openai import chat_response, sse, tool_use
from vlmserve.entrypoints.openai.chat_request import choice_seed, parse_chat_request
from vlmserve.entrypoints.openai.errors import APIError, error_body, error_response
from vlmserve.entrypoints.openai.request_body import read_json
from vlmserve.entrypoints.openai.streams import merge, wait_disconnect
from vlmserve.protocol import ChatRequest, EngineError, FinishReason, TokenEvent, new_request_id

log = logging.getLogger("vlmserve.request")


def _engine_error(exc: EngineError) -> APIError:
    # A 429 (admission's queue_full) says when to retry, as the other "come back later" answers do.
    headers = {"retry-after": "1"} if exc.status == 429 else None
    return APIError(exc.status, exc.message, code=exc.code, param=exc.param, headers=headers)


def answers_in_openai_shape(handler):
    """A route whose bug still answers in OpenAI's error shape, never a bare 500 page."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception:  # noqa: BLE001
            log.exception("%s failed", request.url.path)
            return error_response(APIError(500, "internal server error", code="internal_error"))

    return route


def parse_chat(body, server) -> ChatRequest:
    chat = parse_chat_request(body, server.config, server.model_names, server.context_length, server.max_images)
    return tool_use.prepare(chat, server.tool_parser, server.chat_template)


@dataclass
class Started:
    """A request admitted and preprocessed, its choices generating."""

    chat: ChatRequest
    streams: list
    request_id: str
    created: int
    engine_finish: list = field(default_factory=list)  # each choice's finish reason before tool calls


def _renamed(exc: APIError, params: dict[str, str]) -> APIError:
    """`exc` naming the fields of the API the client spoke (`params`: Chat Completions' name ->
    its). A field inside one (`messages[2].content`) is named by the outer field alone: the
    translated request's indices need not be the client's."""
    outer = re.split(r"[.\[]", exc.param or "", maxsplit=1)[0]
    if outer not in params:
        return exc
    message = exc.message
    for ours, theirs in params.items():
        message = message.replace(f"'{ours}'", f"'{theirs}'")
    return APIError(exc.status, message, code=exc.code, param=params[outer], headers=exc.headers)


async def start(
    request: Request, parse, prefix: str = "chatcmpl", params: dict[str, str] | None = None
) -> Started | Response:
    """Read, parse (`parse(body, server)` -> ChatRequest), admit and preprocess a request, and
    start its choices; an error answers in OpenAI's shape instead, naming the request's fields
    as `params` maps Chat Completions' names to the API `parse` reads."""
    arrival = time.perf_counter()
    server = request.app.state.server
    try:
        server.check_accepting()
        body = await read_json(request, server.config.max_body_bytes)
        chat = parse(body, server)
        # 429 past --max-waiting; times the CPU pool; 400 past the context (inputs/limits.py)
        prepared, holds = await server.prepare(chat)
    except (APIError, EngineError) as exc:
        err = _renamed(exc if isinstance(exc, APIError) else _engine_error(exc), params or {})
        server.count_failure(err)
        return error_response(err)
    request_id = new_request_id(prefix)
    streams = []
    for i in range(chat.n):
        sampling = chat.sampling
        if chat.n > 1 and sampling.seed is not None:
            sampling = replace(sampling, seed=choice_seed(sampling.seed, i))
        streams.append(server.generate(f"{request_id}-{i}", prepared, sampling, arrival, holds[i]))
    return Started(chat, streams, request_id, chat_response.now())


def event_stream(events, request_id: str) -> StreamingResponse:
    return StreamingResponse(
        sse.ending_in_one_error(events),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no", "x-request-id": request_id},
    )


async def collect(request: Request, started: Started) -> tuple[list[dict], dict] | Response:
    """Every choice whole, in Chat Completions' shape (message, with its tool calls); a client that
    leaves aborts them (499), a failed choice answers for the request."""
    server = request.app.state.server
    task = asyncio.create_task(_collect(started.streams, started.chat, server.tool_parser, started.engine_finish))
    disconnect = asyncio.create_task(wait_disconnect(request))
    done, _ = await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if task not in done:  # the client left: cancelling the task aborts every choice
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)
    disconnect.cancel()
    try:
        return task.result()
    except EngineError as exc:
        return error_response(_engine_error(exc))
    except _ChoiceFailed as exc:
        return error_response(APIError(exc.status, exc.message, code=exc.code))


@answers_in_openai_shape
async def chat_completions(request: Request) -> Response:
    started = await start(request, parse_chat)
    if isinstance(started, Response):
        return started
    server = request.app.state.server
    rid, model, chat = started.request_id, server.model_id, started.chat
    if chat.stream:
        return event_stream(_sse(rid, model, started.created, chat, started.streams, server.tool_parser), rid)
    result = await collect(request, started)
    if isinstance(result, Response):
        return result
    choices, usage = result
    body = chat_response.completion_response(rid, model, started.created, choices, usage)
    return JSONResponse(body, headers={"x-request-id": rid})


class _ChoiceFailed(Exception):
    def __init__(self, message: str, status: int = 500, code: str | None = "generation_failed"):
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


def failure(event: TokenEvent) -> _ChoiceFailed:
    if event.finish_reason == FinishReason.ABORT:
        return _ChoiceFailed("the request was aborted", 503, "aborted")
    if event.finish_reason == FinishReason.UNAVAILABLE:
        return _ChoiceFailed(event.error or "the server could not finish the request", 503, "worker_unavailable")
    if event.error_code is not None:  # the request cannot be served as sent
        return _ChoiceFailed(event.error or "invalid request", 400, event.error_code)
    return _ChoiceFailed(event.error or "generation failed")


def _with_calls(finish: str | None) -> str | None:
    """The finish reason of an answer with tool calls: `tool_calls` where it ended on its own;
    one the token limit cut stays `length` (its calls may be missing one)."""
    return "tool_calls" if finish == "stop" else finish


async def _collect(streams, chat, parser, engine_finish: list | None = None):
    n, want_logprobs = chat.n, chat.sampling.logprobs
    texts = [""] * n
    logprobs: list[list] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    prompt = cached = completion = 0
    async for i, event in merge(streams):
        if event.finish_reason is not None and event.finish_reason.failed:
            raise failure(event)
        texts[i] += event.text
        logprobs[i].extend(event.logprobs)
        if event.finish_reason is not None:
            finish[i] = chat_response.finish_reason_str(event.finish_reason)
            prompt, cached = event.prompt_tokens, event.cached_tokens
            completion += event.completion_tokens
    if engine_finish is not None:
        engine_finish[:] = finish
    choices = []
    for i in range(n):
        message = {"role": "assistant", "content": texts[i], "refusal": None}
        if tool_use.uses_tools(chat):
            content, calls = tool_use.split(texts[i], parser, chat)
            if calls:
                message = {**message, "content": content or None, "tool_calls": [c.to_openai() for c in calls]}
                finish[i] = _with_calls(finish[i])
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_response.logprobs_dict(logprobs[i]) if want_logprobs else None,
                "finish_reason": finish[i],
            }
        )
    return choices, chat_response.usage_dict(prompt, completion, cached)


async def _sse(request_id, model, created, chat, streams, parser):
    lines = sse.ChunkLines(request_id, model, created, chat.include_usage)
    tools = [tool_use.stream(parser, chat) for _ in range(chat.n)] if tool_use.uses_tools(chat) else None
    for i in range(chat.n):
        yield lines.choice(i, {"role": "assistant", "content": ""})
    prompt = cached = completion = 0
    async for i, event in merge(streams):
        text = tools[i].feed(event.text) if tools is not None and event.text else event.text
        if event.finish_reason is None and not event.logprobs:
            if text:  # the common chunk: pre-rendered, see sse.py
                yield lines.content(i, text)
            continue
        if event.finish_reason is not None and event.finish_reason.failed:
            failed = failure(event)
            yield sse.line(error_body(failed.status, failed.message, failed.code))
            return
        finish = chat_response.finish_reason_str(event.finish_reason)
        if tools is not None and event.finish_reason is not None:
            rest, calls = tools[i].finish()
            text += rest
            if calls:
                if text:
                    yield lines.content(i, text)
                    text = ""
                yield lines.choice(i, {"tool_calls": [c.to_openai(k) for k, c in enumerate(calls)]})
                finish = _with_calls(finish)
        yield lines.choice(
            i,
            {"content": text} if text else {},
            chat_response.logprobs_dict(event.logprobs) if event.logprobs else None,
            finish,
        )
        if event.finish_reason is not None:
            prompt, cached = event.prompt_tokens, event.cached_tokens
            completion += event.completion_tokens
    if chat.include_usage:
        yield lines.chunk([], chat_response.usage_dict(prompt, completion, cached))
    yield "data: [DONE]\n\n"
