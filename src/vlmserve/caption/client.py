"""One HTTP exchange with one server, classified: success, retriable failure, or final error."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from vlmserve.caption.retry import FATAL_STATUSES, is_retriable_status, parse_retry_after


def normalize_server(url: str) -> str:
    """'host:8000', 'http://host:8000/', 'http://host:8000/v1' -> 'http://host:8000'."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/v1"):
        url = url[:-3]
    return url


@dataclass
class Outcome:
    ok: bool
    caption: str | None = None
    model: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    status: int | None = None
    retriable: bool = False
    fatal: bool = False  # the run cannot succeed (auth, unknown model/route): stop everything
    retry_after: float | None = None
    latency_s: float = 0.0


def _error_message(response: httpx.Response) -> str:
    try:
        err = response.json().get("error")
        if isinstance(err, dict) and err.get("message"):
            return f"HTTP {response.status_code}: {err['message']}"
        if isinstance(err, str):
            return f"HTTP {response.status_code}: {err}"
    except (ValueError, AttributeError):
        pass
    text = response.text.strip().replace("\n", " ")
    return f"HTTP {response.status_code}: {text[:300]}" if text else f"HTTP {response.status_code}"


def parse_completion(payload: dict) -> Outcome:
    choices = payload.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return Outcome(False, error="response has no choices", retriable=True)
    message = choices[0].get("message") or {}
    content = message.get("content")
    if isinstance(content, list):  # some servers return content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    usage = payload.get("usage") or {}
    return Outcome(
        True,
        caption=(content or "").strip(),
        model=payload.get("model"),
        finish_reason=choices[0].get("finish_reason"),
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
    )


async def post_chat(client: httpx.AsyncClient, server: str, body: dict, headers: dict) -> Outcome:
    t0 = time.perf_counter()
    try:
        response = await client.post(f"{server}/v1/chat/completions", json=body, headers=headers)
    except (httpx.TimeoutException, httpx.TransportError) as exc:  # connect/read errors, timeouts, resets
        out = Outcome(False, error=f"{type(exc).__name__}: {exc}".rstrip(": "), retriable=True)
    else:
        status = response.status_code
        if status == 200:
            try:
                out = parse_completion(response.json())
            except (ValueError, json.JSONDecodeError):
                out = Outcome(False, error="HTTP 200 with an invalid JSON body", retriable=True)
        else:
            out = Outcome(
                False,
                error=_error_message(response),
                status=status,
                retriable=is_retriable_status(status),
                fatal=status in FATAL_STATUSES,
                retry_after=parse_retry_after(response.headers.get("retry-after")),
            )
    out.latency_s = time.perf_counter() - t0
    return out


async def discover_model(
    client: httpx.AsyncClient,
    server: str,
    headers: dict,
    wait_loading: float = 600.0,
    connect_attempts: int = 5,
    delay: float = 1.0,
) -> str:
    """The first model id from GET {server}/v1/models. Waits (up to `wait_loading` s) while the
    server answers 503/5xx (still loading its model); gives up after `connect_attempts` refused connections."""
    import asyncio

    last, refused, deadline = "", 0, time.monotonic() + wait_loading
    while True:
        try:
            r = await client.get(f"{server}/v1/models", headers=headers, timeout=30)
            if r.status_code == 200:
                data = r.json().get("data") or []
                if data and isinstance(data[0], dict) and data[0].get("id"):
                    return data[0]["id"]
                raise RuntimeError(f"{server}/v1/models lists no model; pass --model")
            last = _error_message(r)
            if not is_retriable_status(r.status_code) or time.monotonic() > deadline:
                break
        except (httpx.TimeoutException, httpx.TransportError) as exc:
            last = f"{type(exc).__name__}: {exc}".rstrip(": ")
            refused += 1
            if refused >= connect_attempts:
                break
        except ValueError:
            last = "invalid JSON"
            break
        await asyncio.sleep(delay)
    raise RuntimeError(f"cannot get the model id from {server}/v1/models ({last}); pass --model")
