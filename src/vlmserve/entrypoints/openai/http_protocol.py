"""uvicorn's httptools protocol, reading request bodies in bulk.

uvicorn pauses a connection's reads whenever more than 64 KiB of its body waits for the app and
resumes when the app asks for more (read, pause, read, pause: uvicorn issue #99), and asyncio
reads at most 256 KiB per recv(). Each read and each epoll change is a system call on the
event loop that releases the GIL, and a long one (a read) can lose it to the MLX thread and
wait a switch interval to get it back: a wave of 64 uploads paid that per call, in front of
every stream's writes and `/health`. Here a connection pauses only past READ_HIGH_WATER buffered
and reads up to that much at a time. 64 bodies of 800 KB at once, counted from another process:
~4.9 reads and ~9.3 epoll changes per body with uvicorn's protocol, ~3 and ~1 with this one.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Per connection, at most this much body (plus one read) waits for the app before reads pause.
READ_HIGH_WATER = 1 << 20


class BulkBodyProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        if isinstance(getattr(transport, "max_size", None), int):  # asyncio's socket transport
            transport.max_size = max(transport.max_size, READ_HIGH_WATER)

    def on_body(self, body: bytes) -> None:  # uvicorn's on_body, with READ_HIGH_WATER for its 64 KiB
        if (self.parser.should_upgrade() and self._should_upgrade()) or self.cycle.response_complete:
            return
        self.cycle.body += body
        if len(self.cycle.body) > READ_HIGH_WATER:
            self.flow.pause_reading()
        self.cycle.message_event.set()
