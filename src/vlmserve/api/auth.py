"""Bearer-token auth as pure ASGI middleware (keeps streaming and disconnect detection intact)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError, error_response

OPEN_PATHS = ("/health", "/ready")


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.protect_metrics = protect_metrics

    def _protected(self, path: str) -> bool:
        if path in OPEN_PATHS:
            return False
        if path == "/metrics":
            return self.protect_metrics
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and self._protected(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # constant time
                response = error_response(APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'",
                                                   code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
