"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}
    }


def error_response(exc: APIError) -> JSONResponse:
    headers = dict(exc.headers)
    # Clients (the openai package) retry 408/409/429/5xx unless told not to. A 4xx other than
    # 408/429 will not change on retry, nor will a 500 (a generation failure or a bug). A 503 is
    # the server's state (loading, draining, its engine down or lost), not the request's: retry,
    # on another replica if there is one.
    if (400 <= exc.status < 500 and exc.status not in (408, 429)) or exc.status == 500:
        headers.setdefault("x-should-retry", "false")
    elif exc.status == 503:
        headers.setdefault("x-should-retry", "true")
    return JSONResponse(
        error_body(exc.status, exc.message, exc.code, exc.param), status_code=exc.status, headers=headers
    )
