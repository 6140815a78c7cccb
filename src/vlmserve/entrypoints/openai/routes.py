"""HTTP routes: chat completions, models, health, readiness, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from vlmserve.entrypoints.openai import chat_schema as oai
from vlmserve.entrypoints.openai import sse
from vlmserve.entrypoints.openai.errors import APIError, error_body, error_response
from vlmserve.entrypoints.openai.streams import merge, wait_disconnect
from vlmserve.protocol import EngineError, FinishReason, TokenEvent, new_request_id

log = logging.getLogger("vlmserve.request")


def _state(request: Request):
    return request.app.state.server


def _check_content_type(request: Request) -> None:
    """JSON bodies only; a missing Content-Type is tolerated (the body must still parse)."""
    ctype = request.headers.get("content-type")
    if ctype is None:
        return
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(
            400, f"Content-Type must be application/json, got {media or 'nothing'!r}", code="invalid_content_type"
        )


# Bodies carrying images (hundreds of KB) are parsed on a thread: a burst of 64 parsed on the
# event loop back to back delayed every stream's writes and /health by their sum (H100, W1).
_PARSE_OFF_LOOP_BYTES = 64 * 1024


def _parse_json(body: bytes | bytearray):
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise APIError(400, "request body is not valid JSON", code="invalid_json") from None


async def _read_json(request: Request, limit: int):
    _check_content_type(request)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    if len(body) > _PARSE_OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, _parse_json, body)
    return _parse_json(body)


def _engine_error(exc: EngineError) -> APIError:
    return APIError(exc.status, exc.message, code=exc.code, param=exc.param)


async def chat_completions(request: Request) -> Response:
    try:
        return await _chat_completions(request)
    except Exception:  # noqa: BLE001 - a bug must still answer in OpenAI's shape, never a bare 500 page
        log.exception("chat completion failed")
        return error_response(APIError(500, "internal server error", code="internal_error"))


async def _chat_completions(request: Request) -> Response:
    arrival = time.perf_counter()
    server = _state(request)
    try:
        server.check_accepting()
        body = await _read_json(request, server.config.max_body_bytes)
        chat = oai.parse_chat_request(body, server.config, server.model_names, server.context_length)
        prepared = await server.prepare(chat)  # 429 past --max-waiting; times the CPU pool
        oai.check_fits_context(chat, prepared.num_prompt_tokens, server.context_length)
    except APIError as exc:
        server.count_failure(exc)
        return error_response(exc)
    except EngineError as exc:
        err = _engine_error(exc)
        server.count_failure(err)
        return error_response(err)

    request_id = new_request_id()
    model = server.model_id
    created = oai.now()
    streams = []
    for i in range(chat.n):
        sampling = chat.sampling
        if chat.n > 1 and sampling.seed is not None:
            sampling = replace(sampling, seed=oai.choice_seed(sampling.seed, i))
        streams.append(server.generate(f"{request_id}-{i}", prepared, sampling, arrival))

    if chat.stream:
        return StreamingResponse(
            _sse(request_id, model, created, chat, streams),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )

    collect = asyncio.create_task(_collect(streams, chat.n, chat.sampling.logprobs))
    disconnect = asyncio.create_task(wait_disconnect(request))
    done, _ = await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if collect not in done:  # the client left: cancelling the task aborts every choice
        collect.cancel()
        await asyncio.gather(collect, return_exceptions=True)
        return Response(status_code=499)
    disconnect.cancel()
    try:
        choices, usage = collect.result()
    except EngineError as exc:
        return error_response(_engine_error(exc))
    except _ChoiceFailed as exc:
        return error_response(APIError(exc.status, exc.message, code=exc.code))
    return JSONResponse(oai.completion_response(request_id, model, created, choices, usage))


class _ChoiceFailed(Exception):
    def __init__(self, message: str, status: int = 500, code: str | None = "generation_failed"):
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


def _failure(event: TokenEvent) -> _ChoiceFailed:
    if event.finish_reason == FinishReason.ABORT:
        return _ChoiceFailed("the request was aborted", 503, "aborted")
    return _ChoiceFailed(event.error or "generation failed")


async def _collect(streams, n: int, want_logprobs: bool):
    texts = [""] * n
    logprobs: list[list] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    prompt = cached = completion = 0
    async for i, event in merge(streams):
        if event.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            raise _failure(event)
        texts[i] += event.text
        logprobs[i].extend(event.logprobs)
        if event.finish_reason is not None:
            finish[i] = oai.finish_reason_str(event.finish_reason)
            prompt, cached = event.prompt_tokens, event.cached_tokens
            completion += event.completion_tokens
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": texts[i], "refusal": None},
            "logprobs": oai.logprobs_dict(logprobs[i]) if want_logprobs else None,
            "finish_reason": finish[i],
        }
        for i in range(n)
    ]
    return choices, oai.usage_dict(prompt, completion, cached)


async def _sse(request_id, model, created, chat, streams):
    lines = sse.ChunkLines(request_id, model, created, chat.include_usage)
    for i in range(chat.n):
        yield lines.choice(i, {"role": "assistant", "content": ""})
    prompt = cached = completion = 0
    try:
        async for i, event in merge(streams):
            if event.finish_reason is None and not event.logprobs:
                if event.text:  # the common chunk: pre-rendered, see sse.py
                    yield lines.content(i, event.text)
                continue
            if event.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                failure = _failure(event)
                yield sse.line(error_body(failure.status, failure.message, failure.code))
                return
            yield lines.choice(
                i,
                {"content": event.text} if event.text else {},
                oai.logprobs_dict(event.logprobs) if event.logprobs else None,
                oai.finish_reason_str(event.finish_reason),
            )
            if event.finish_reason is not None:
                prompt, cached = event.prompt_tokens, event.cached_tokens
                completion += event.completion_tokens
    except EngineError as exc:
        yield sse.line(error_body(exc.status, exc.message, exc.code, exc.param))
        return
    except Exception:  # noqa: BLE001 - the headers are gone: report it as the stream's one error event
        log.exception("stream failed")
        yield sse.line(error_body(500, "internal server error", "internal_error"))
        return
    if chat.include_usage:
        yield lines.chunk([], oai.usage_dict(prompt, completion, cached))
    yield "data: [DONE]\n\n"


async def list_models(request: Request) -> Response:
    server = _state(request)
    data = [{"id": server.model_id, "object": "model", "created": server.created, "owned_by": "vlmserve"}]
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    ok, reason = _state(request).liveness()
    return JSONResponse({"status": "ok" if ok else "unhealthy", "reason": reason}, status_code=200 if ok else 503)


async def ready(request: Request) -> Response:
    ok, reason = _state(request).readiness()
    return JSONResponse({"status": "ready" if ok else "not_ready", "reason": reason}, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    server = _state(request)
    server.refresh_gauges()
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def not_found(request: Request, exc) -> Response:
    return error_response(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))


async def method_not_allowed(request: Request, exc) -> Response:
    headers = dict(getattr(exc, "headers", None) or {})  # Starlette's `Allow`
    return error_response(
        APIError(
            405,
            f"method {request.method} not allowed on {request.url.path}",
            code="method_not_allowed",
            headers=headers,
        )
    )


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/ready", ready, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
