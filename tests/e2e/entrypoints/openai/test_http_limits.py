"""Slow or idle connections cannot lock the server out: a header deadline closes them, and past
the connection cap only the probes are served (a server under a 256 open-file limit)."""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
import sys
import time

import httpx
import pytest

from support.helpers import MODELS, free_port, wait_ready

pytestmark = pytest.mark.slow

NOFILE = 256


def _low_nofile():
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@pytest.fixture(scope="module")
def server():
    port = free_port()
    args = ["--port", str(port), "--http-header-timeout", "1", "--max-connections", "40"]
    args += ["--http-keep-alive-timeout", "30"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlmserve.cli", "serve", str(MODELS / "qwen2_vl"), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=_low_nofile,
    )
    base = f"http://127.0.0.1:{port}"
    assert wait_ready(base)
    yield port, base, proc
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    proc.stderr_text = err.decode(errors="replace")


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def test_hundreds_of_idle_sockets_past_the_file_limit_do_not_lock_out_health(server):
    port, base, proc = server
    idle = []
    try:
        for _ in range(NOFILE + 100):  # more than the server can hold open
            with contextlib.suppress(OSError):
                s = _connect(port)
                s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finished
                idle.append(s)
        deadline = time.monotonic() + 15
        ok = False
        while time.monotonic() < deadline and not ok:  # the header deadline frees their descriptors
            with contextlib.suppress(httpx.HTTPError):
                ok = httpx.get(f"{base}/health", timeout=2).status_code == 200
            time.sleep(0.2)
        assert ok, "/health stayed locked out"
        closed = 0
        for s in idle:
            s.settimeout(0.5)
            with contextlib.suppress(OSError):
                if s.recv(1) == b"":
                    closed += 1
        assert closed >= len(idle) // 2  # the server hung up on the slow ones
    finally:
        for s in idle:
            s.close()


def test_past_the_connection_cap_requests_get_503_but_probes_are_served(server):
    port, base, proc = server
    held = []
    try:
        for _ in range(45):  # kept-alive connections, past --max-connections 40
            s = _connect(port)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            held.append(s)
        with httpx.Client(base_url=base, timeout=10) as c:
            assert c.get("/health").status_code == 200
            assert c.get("/ready").status_code == 200
            assert c.get("/v1/models").status_code == 503
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if httpx.get(f"{base}/v1/models", timeout=5).status_code == 200:
            break
        time.sleep(0.2)
    assert httpx.get(f"{base}/v1/models", timeout=5).status_code == 200  # below the cap again
