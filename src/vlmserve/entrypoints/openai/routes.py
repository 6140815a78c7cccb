"""HTTP routes: the route table, and the small endpoints (models, health, readiness, metrics, 404/405).
Chat completions are serving_chat.py's."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vlmserve.entrypoints.openai.errors import APIError, error_response
from vlmserve.entrypoints.openai.serving_chat import chat_completions
from vlmserve.entrypoints.openai.serving_completions import completions
from vlmserve.entrypoints.openai.serving_responses import responses


def _state(request: Request):
    return request.app.state.server


def _model_object(server) -> dict:
    return {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "vlmserve"}


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{id}: the served model by any of its names, else 404 model_not_found."""
    server = _state(request)
    try:
        server.check_accepting()
    except APIError as exc:
        return error_response(exc)
    model_id = request.path_params["model_id"]
    if model_id not in server.model_names:
        return error_response(
            APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        )
    return JSONResponse(_model_object(server))


async def list_models(request: Request) -> Response:
    """The served model, once it can answer: clients that poll this before chatting (the openai
    client, vLLM's users) would otherwise send requests that get 503s while it loads."""
    server = _state(request)
    try:
        server.check_accepting()
    except APIError as exc:
        return error_response(exc)
    data = [_model_object(server)]
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
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/responses", responses, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/ready", ready, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
