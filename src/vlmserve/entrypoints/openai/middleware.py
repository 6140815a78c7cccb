"""Pure ASGI middleware (keeps streaming and disconnect detection intact): API key, body cap."""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from vlmserve.entrypoints.openai.errors import APIError, error_response

OPEN_PATHS = ("/health", "/ready")


def _digest(value: bytes) -> bytes:
    # Hash first so the comparison takes the same time whatever the length of the guess.
    return hashlib.sha256(value).digest()


class APIKeyMiddleware:
    """Every route except /health and /ready (and /metrics unless protect_metrics) needs
    `Authorization: Bearer <key>`; otherwise 401 in OpenAI's error shape."""

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool):
        self.app = app
        self.expected = _digest(api_key.encode())
        self.protect_metrics = protect_metrics

    def _protected(self, path: str) -> bool:
        if path in OPEN_PATHS:
            return False
        if path == "/metrics":
            return self.protect_metrics
        return True

    def _authorized(self, scope: Scope) -> bool:
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.strip().partition(b" ")
        ok_scheme = scheme.lower() == b"bearer"
        ok_token = hmac.compare_digest(_digest(token.strip()), self.expected)  # constant time
        return ok_scheme and ok_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope.get("method") != "OPTIONS"
            and self._protected(scope["path"])
            and not self._authorized(scope)
        ):
            response = error_response(
                APIError(
                    401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
            )
            response.headers["www-authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodySizeMiddleware:
    """413 before reading a body whose declared Content-Length is over the cap.

    Bodies without a length (chunked) are capped while being read (request_body.read_json).
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"content-length":
                    try:
                        too_big = int(value) > self.max_bytes
                    except ValueError:
                        too_big = False
                    if too_big:
                        response = error_response(
                            APIError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large")
                        )
                        response.headers["connection"] = "close"
                        await response(scope, receive, send)
                        return
                    break
        await self.app(scope, receive, send)
