"""The server's uvicorn protocol (entrypoints/openai/http_protocol.py); its logging: unit/test_logging.py."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from support.helpers import free_port
from vlmserve.entrypoints.openai.http_protocol import READ_HIGH_WATER, BulkBodyProtocol


async def _digest(request):
    body = bytearray()
    async for part in request.stream():
        body += part
    return JSONResponse({"n": len(body), "sha256": hashlib.sha256(body).hexdigest()})


_app = Starlette(routes=[Route("/digest", _digest, methods=["POST"])])


class _Recording:
    """Mixed into a protocol class: the read size of each connection it made."""

    read_sizes: list[int] = []

    def on_body(self, body: bytes) -> None:
        type(self).read_sizes.append(self.transport.max_size)
        super().on_body(body)


def _serve(protocol):
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning", http=protocol, loop="asyncio")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("protocol", [HttpToolsProtocol, BulkBodyProtocol])
def test_image_sized_bodies_arrive_whole_and_read_in_bulk(protocol, monkeypatch):
    pauses = []
    pause = FlowControl.pause_reading
    monkeypatch.setattr(FlowControl, "pause_reading", lambda self: (pauses.append(1), pause(self)))
    recording = type("Recording", (_Recording, protocol), {"read_sizes": []})
    server, thread, url = _serve(recording)
    bodies = [os.urandom(900_000), os.urandom(3 * READ_HIGH_WATER)]  # one image; more than the mark
    try:
        with httpx.Client(timeout=30) as client:
            for body in bodies:
                r = client.post(f"{url}/digest", content=body)
                assert r.json() == {"n": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    finally:
        server.should_exit = True
        thread.join(10)
    if protocol is HttpToolsProtocol:  # what the subclass is for: uvicorn pauses every 64 KiB
        assert len(pauses) >= 10
    else:
        assert set(recording.read_sizes) == {READ_HIGH_WATER}
        # Only the body over the mark may pause: at most once per READ_HIGH_WATER of it.
        assert len(pauses) <= 3
