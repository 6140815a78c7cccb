"""OpenAI Chat Completions responses: the completion object, stream chunks, usage, logprobs."""

from __future__ import annotations

import time
from importlib.metadata import PackageNotFoundError, version

from vlmserve.protocol import FinishReason, TokenLogprob


def _version() -> str:
    try:
        return version("vlmserve").replace(".", "_")
    except PackageNotFoundError:  # run from a source tree without an install
        return "dev"


def usage_dict(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def finish_reason_str(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == FinishReason.LENGTH else "stop"


def logprobs_dict(entries: list[TokenLogprob]) -> dict:
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t.token, t.logprob) for t in e.top]} for e in entries
        ],
        "refusal": None,
    }


# OpenAI's schema has a string here; it names the serving build (clients log it with results).
SYSTEM_FINGERPRINT = "fp_vlmserve_" + _version()


def completion_response(request_id: str, model: str, created: int, choices: list[dict], usage: dict) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def chunk(request_id: str, model: str, created: int, choices: list[dict], usage: dict | None = None) -> dict:
    body = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }
    if usage is not None:
        body["usage"] = usage
    return body


def now() -> int:
    return int(time.time())
