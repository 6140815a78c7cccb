"""uvicorn's httptools protocol, reading request bodies in bulk, with a header deadline and a
connection cap.

A connection must finish each request's headers within `header_timeout` seconds, or it is
closed: slow-header clients (slowloris) cannot hold sockets, and with them the process's file
descriptors, forever (uvicorn has no such limit; its keep-alive timeout covers idle time between
requests only). Past `max_connections` open connections, requests get uvicorn's own 503 except
`/health`, `/ready` and `/metrics`, so probes still get through while the cap holds.

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

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Per connection, at most this much body (plus one read) waits for the app before reads pause.
READ_HIGH_WATER = 1 << 20


PROBE_PATHS = (b"/health", b"/ready", b"/metrics")


class BulkBodyProtocol(HttpToolsProtocol):
    header_timeout: float = 10.0  # seconds; 0: none
    max_connections: int = 0  # 0: no cap
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        if isinstance(getattr(transport, "max_size", None), int):  # asyncio's socket transport
            transport.max_size = max(transport.max_size, READ_HIGH_WATER)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()  # the next request on a kept-alive connection gets its own deadline

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        over_cap = self.max_connections and len(self.connections) > self.max_connections
        if not over_cap or httptools.parse_url(self.url).path in PROBE_PATHS:
            super().on_headers_complete()
            return
        saved, self.limit_concurrency = self.limit_concurrency, 0  # uvicorn's limit answers 503
        try:
            super().on_headers_complete()
        finally:
            self.limit_concurrency = saved

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        if self.header_timeout > 0:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def on_body(self, body: bytes) -> None:  # uvicorn's on_body, with READ_HIGH_WATER for its 64 KiB
        if (self.parser.should_upgrade() and self._should_upgrade()) or self.cycle.response_complete:
            return
        self.cycle.body += body
        if len(self.cycle.body) > READ_HIGH_WATER:
            self.flow.pause_reading()
        self.cycle.message_event.set()


def http_protocol(header_timeout: float, max_connections: int) -> type[BulkBodyProtocol]:
    """The protocol class with these limits (uvicorn takes a class)."""
    return type(
        "LimitedBulkBodyProtocol",
        (BulkBodyProtocol,),
        {"header_timeout": header_timeout, "max_connections": max_connections},
    )


def default_max_connections(reserve: int = 128) -> int:
    """What the process's open-file limit leaves after `reserve` descriptors for everything else
    (model files, pipes, worker processes): a cap below it keeps accept() and /health working."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 0
    return max(32, soft - reserve)
