"""Pure ASGI middleware (keeps streaming and disconnect detection intact): API key, body cap,
browser guard."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

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

    @staticmethod
    def _preflight(scope: Scope) -> bool:
        """A browser's CORS preflight (it carries no credentials): left to the CORS layer."""
        if scope.get("method") != "OPTIONS":
            return False
        names = {name for name, _ in scope["headers"]}
        return b"origin" in names and b"access-control-request-method" in names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and not self._preflight(scope)
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


def _host_name(host: str) -> str:
    """A Host header's (or an origin's) name without its port, lower-cased; IPv6 without brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        inner, _, rest = host[1:].partition("]")
        return inner if rest == "" or (rest[:1] == ":" and rest[1:].isdigit()) else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback(name: str) -> bool:
    """localhost, or any loopback address (127.0.0.0/8, ::1, IPv4-mapped ones); a trailing dot allowed."""
    name = name.rstrip(".")
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


class BrowserGuardMiddleware:
    """What a web page may not do to a server without an API key, as Ollama guards its own:

    - a request that carries an `Origin` (only browsers send one) gets 403 unless the origin is
      on loopback or in --cors-origins (`*`: any), so a page elsewhere cannot drive the server;
    - bound to loopback, a request whose Host is not a loopback name (or in --allowed-hosts) gets
      403: a DNS-rebinding page reaches 127.0.0.1 under its own host name."""

    def __init__(
        self, app: ASGIApp, allowed_origins: tuple[str, ...], loopback_only: bool, allowed_hosts: tuple[str, ...] = ()
    ):
        self.app = app
        self.any_origin = "*" in allowed_origins
        self.allowed = {o.rstrip("/").lower() for o in allowed_origins}
        self.loopback_only = loopback_only and "*" not in allowed_hosts
        self.hosts = {_host_name(h) for h in allowed_hosts}

    def _refusal(self, scope: Scope) -> APIError | None:
        headers = dict(scope["headers"])
        if self.loopback_only:
            host = headers.get(b"host")  # none: HTTP/1.0, which no browser sends
            host = None if host is None else host.decode("latin-1")
            if host is not None and not is_loopback(_host_name(host)) and _host_name(host) not in self.hosts:
                return APIError(403, f"host {host!r} is not this server's loopback name", code="host_not_allowed")
        origin = headers.get(b"origin")
        if origin is not None and not self.any_origin:
            text = origin.decode("latin-1").strip().rstrip("/").lower()
            if text not in self.allowed and not is_loopback(_host_name(text.split("://", 1)[-1])):
                return APIError(403, f"origin {text!r} is not allowed (see --cors-origins)", code="origin_not_allowed")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)
