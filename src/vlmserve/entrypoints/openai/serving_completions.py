"""POST /v1/completions: a text prompt as it is (no chat template), answered whole or streamed
in the legacy Completions shape. The sampling fields are those of chat completions."""

from __future__ import annotations

from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vlmserve.entrypoints.openai import chat_response, sse
from vlmserve.entrypoints.openai.chat_request import parse_chat_request
from vlmserve.entrypoints.openai.errors import APIError, error_body
from vlmserve.entrypoints.openai.serving_chat import answers_in_openai_shape, collect, event_stream, failure, start
from vlmserve.entrypoints.openai.streams import merge
from vlmserve.protocol import ChatRequest

_SAMPLING_FIELDS = (
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos", "repetition_penalty", "min_p",
    "min_tokens",
)  # fmt: skip
MAX_LOGPROBS = 5  # the legacy API's limit


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def parse_completion(body, server) -> ChatRequest:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", "body")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _bad("'prompt' must be a string (one prompt per request; token ids are not taken)", "prompt")
    if body.get("suffix"):
        raise _bad("'suffix' is not supported", "suffix")
    if body.get("best_of") not in (None, 1):
        raise _bad("'best_of' is not supported", "best_of")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise _bad("'echo' must be a boolean", "echo")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 5):
        raise _bad(f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}", "logprobs")
    chat_body = {k: body[k] for k in _SAMPLING_FIELDS if k in body}
    chat_body.setdefault("max_tokens", 16)  # the Completions API's default
    chat_body["messages"] = [{"role": "user", "content": prompt}]
    if logprobs is not None:
        chat_body.update(logprobs=True, top_logprobs=logprobs)
    chat = parse_chat_request(chat_body, server.config, server.model_names, server.context_length, server.max_images)
    return replace(chat, raw_prompt=True, echo=prompt if echo else None)


def _legacy_logprobs(entries: dict | None, offset: int) -> dict | None:
    """Chat's logprobs ({"content": [...]}) in the Completions shape."""
    if entries is None:
        return None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries["content"]:
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append({t["token"]: t["logprob"] for t in e["top_logprobs"]})
        out["text_offset"].append(offset)
        offset += len(e["token"])
    return out


def _body(rid, model, created, choices, usage=None) -> dict:
    body = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": chat_response.SYSTEM_FINGERPRINT,
    }
    if usage is not None:
        body["usage"] = usage
    return body


@answers_in_openai_shape
async def completions(request: Request) -> Response:
    started = await start(request, parse_completion, prefix="cmpl")
    if isinstance(started, Response):
        return started
    model, rid, chat = request.app.state.server.model_id, started.request_id, started.chat
    if chat.stream:
        return event_stream(_stream(rid, model, started.created, chat, started.streams), rid)
    result = await collect(request, started)
    if isinstance(result, Response):
        return result
    choices, usage = result
    echo = chat.echo or ""
    out = [
        {
            "index": c["index"],
            "text": echo + (c["message"]["content"] or ""),
            "logprobs": _legacy_logprobs(c["logprobs"], len(echo)),
            "finish_reason": c["finish_reason"],
        }
        for c in choices
    ]
    return JSONResponse(_body(rid, model, started.created, out, usage), headers={"x-request-id": rid})


async def _stream(rid, model, created, chat, streams):
    prompt = cached = completion = 0
    # Each choice's tokens' text so far (logprobs' text_offset): a token held back before a stop
    # string has its entry before its text is sent, so this runs ahead of the text sent.
    offsets = [len(chat.echo or "")] * chat.n
    if chat.echo:
        for i in range(chat.n):
            choice = {"index": i, "text": chat.echo, "logprobs": None, "finish_reason": None}
            yield sse.line(_body(rid, model, created, [choice]))
    async for i, event in merge(streams):
        if event.finish_reason is not None and event.finish_reason.failed:
            f = failure(event)
            yield sse.line(error_body(f.status, f.message, f.code))
            return
        if not event.text and event.finish_reason is None and not event.logprobs:
            continue  # (a token whose text is held back as a possible stop still has its logprob)
        lp = chat_response.logprobs_dict(event.logprobs) if event.logprobs else None
        choice = {
            "index": i,
            "text": event.text,
            "logprobs": _legacy_logprobs(lp, offsets[i]),
            "finish_reason": chat_response.finish_reason_str(event.finish_reason),
        }
        offsets[i] += sum(len(e["token"]) for e in lp["content"]) if lp else len(event.text)
        yield sse.line(_body(rid, model, created, [choice]))
        if event.finish_reason is not None:
            prompt, cached = event.prompt_tokens, event.cached_tokens
            completion += event.completion_tokens
    if chat.include_usage:
        yield sse.line(_body(rid, model, created, [], chat_response.usage_dict(prompt, completion, cached)))
    yield "data: [DONE]\n\n"
