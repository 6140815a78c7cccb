"""System calls the event loop makes to read image-sized request bodies, per protocol.

    python scripts/probe_body_reads.py [--bodies 64] [--size 800000]

Serves a body-digesting Starlette app with uvicorn's httptools protocol, then with vlmserve's
(api/http_protocol.py), posts `--bodies` bodies of `--size` bytes at once from another process,
and prints per body: socket reads (recv) and epoll registrations and removals on the loop
(each releases the GIL), and the reads' median size.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import selectors
import statistics
import subprocess
import sys
import threading
import time
from asyncio import selector_events

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from vlmserve.api.http_protocol import BulkBodyProtocol

counts: collections.Counter = collections.Counter()
read_sizes: list[int] = []


def _count_loop_calls() -> None:
    read = selector_events._SelectorSocketTransport._read_ready__data_received

    def counted_read(self):
        counts["recv"] += 1
        return read(self)

    selector_events._SelectorSocketTransport._read_ready__data_received = counted_read
    for name in ("register", "unregister", "modify"):
        call = getattr(selectors.EpollSelector, name)

        def counted(self, *args, _call=call, _name=name, **kwargs):
            counts[f"epoll {_name}"] += 1
            return _call(self, *args, **kwargs)

        setattr(selectors.EpollSelector, name, counted)


async def _digest(request):
    body = bytearray()
    async for part in request.stream():
        read_sizes.append(len(part))
        body += part
    return JSONResponse({"n": len(body), "sha256": hashlib.sha256(body).hexdigest()})


def _client(port: int, bodies: int, size: int) -> None:
    import httpx

    async def main():
        body = bytes(size)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=bodies), timeout=60) as client:
            await client.post(f"http://127.0.0.1:{port}/digest", content=body)  # connect and warm
            print("go", flush=True)
            sys.stdin.readline()
            rs = await asyncio.gather(*(client.post(f"http://127.0.0.1:{port}/digest", content=body)
                                        for _ in range(bodies)))
            assert all(r.json()["n"] == size for r in rs)

    asyncio.run(main())


def measure(protocol, port: int, bodies: int, size: int) -> dict:
    app = Starlette(routes=[Route("/digest", _digest, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           http=protocol, loop="asyncio"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    client = subprocess.Popen([sys.executable, __file__, "--client", str(port), "--bodies", str(bodies),
                               "--size", str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert client.stdout.readline().strip() == "go"
    counts.clear()
    read_sizes.clear()
    client.stdin.write("\n")
    client.stdin.flush()
    assert client.wait(120) == 0
    server.should_exit = True
    thread.join(10)
    out = {k: round(v / bodies, 2) for k, v in sorted(counts.items())}
    out["median read KiB"] = round(statistics.median(read_sizes) / 1024)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bodies", type=int, default=64)
    p.add_argument("--size", type=int, default=800_000)
    p.add_argument("--client", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        return _client(args.client, args.bodies, args.size)
    _count_loop_calls()
    for port, protocol in ((8771, HttpToolsProtocol), (8772, BulkBodyProtocol)):
        print(f"{protocol.__name__}: per body", measure(protocol, port, args.bodies, args.size))


if __name__ == "__main__":
    main()
