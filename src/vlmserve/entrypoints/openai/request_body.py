"""Request bodies: JSON only, capped in size while read, large ones parsed off the event loop."""

from __future__ import annotations

import asyncio
import json

from starlette.requests import Request

from vlmserve.entrypoints.openai.errors import APIError

# Bodies carrying images (hundreds of KB) are parsed on a thread: a burst of 64 parsed on the
# event loop back to back delayed every stream's writes and /health by their sum (H100, W1).
_PARSE_OFF_LOOP_BYTES = 64 * 1024


def _check_content_type(request: Request) -> None:
    """JSON bodies only, declared as such. A web page can send a body cross-origin without a
    preflight only as text/plain, a form or no type at all: none of those is accepted."""
    media = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(
            400, f"Content-Type must be application/json, got {media or 'nothing'!r}", code="invalid_content_type"
        )


def _parse_json(body: bytes | bytearray):
    try:  # UTF-8 only (RFC 8259); json.loads would guess UTF-16 or -32 from the first bytes
        parsed = json.loads(bytes(body).decode("utf-8").removeprefix("\ufeff"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
    _reject_lone_surrogates(parsed)
    return parsed


def _reject_lone_surrogates(value) -> None:
    """400 for a string holding half of a UTF-16 pair: json.loads lets one through (an escaped
    "\\ud800", or the raw bytes ED A0 80), and it cannot be encoded as UTF-8 later on."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise APIError(
                        400, "request body holds an unpaired UTF-16 surrogate", code="invalid_json"
                    ) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


async def read_json(request: Request, limit: int):
    """The parsed body; 413 past `limit` bytes (a declared Content-Length is refused earlier, middleware.py)."""
    _check_content_type(request)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    if len(body) > _PARSE_OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, _parse_json, body)
    return _parse_json(body)
