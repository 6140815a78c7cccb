"""A web page cannot drive a server it was not allowed to: Origin and Host checks (no API key)."""

from __future__ import annotations

import pytest

from support.server import start_server

BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def guarded():
    server = start_server("qwen2_vl", cors_origins=("https://app.example",), allowed_hosts=("proxy.internal",))
    yield server
    server.stop()


def _chat(server, headers):
    with server.client() as c:
        return c.post("/v1/chat/completions", json={**BODY, "model": server.model_id}, headers=headers)


@pytest.mark.parametrize("origin", ["https://evil.example", "http://localhost.evil.example", "null"])
def test_a_page_elsewhere_gets_403(qwen_server, origin):
    r = _chat(qwen_server, {"origin": origin})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1", "http://[::1]:8080"])
def test_a_page_on_loopback_is_served(qwen_server, origin):
    assert _chat(qwen_server, {"origin": origin}).status_code == 200


def test_an_origin_in_cors_origins_is_served_with_cors_headers(guarded):
    r = _chat(guarded, {"origin": "https://app.example"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert _chat(guarded, {"origin": "https://other.example"}).status_code == 403


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example"])
def test_bound_to_loopback_a_foreign_host_header_gets_403(qwen_server, host):
    """A DNS-rebinding page reaches 127.0.0.1 under its own name."""
    r = _chat(qwen_server, {"host": host})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    with qwen_server.client() as c:
        assert c.get("/health", headers={"host": host}).status_code == 403


def test_allowed_hosts_admit_a_reverse_proxys_name(guarded):
    assert _chat(guarded, {"host": "proxy.internal:443"}).status_code == 200
    assert _chat(guarded, {"host": "localhost:1234"}).status_code == 200
    assert _chat(guarded, {"host": "elsewhere.internal"}).status_code == 403


def test_bound_to_every_interface_any_host_header_is_served():
    server = start_server("qwen2_vl", host="0.0.0.0")
    try:
        assert _chat(server, {"host": "vlm.example.org"}).status_code == 200
    finally:
        server.stop()


@pytest.mark.parametrize(
    "host,loopback",
    [
        ("localhost:8000", True),
        ("LOCALHOST.", True),
        ("127.0.0.2", True),
        ("[::1]:8080", True),
        ("::ffff:127.0.0.1", True),
        ("[::1]evil.example", False),
        ("127.0.0.1.evil.example", False),
        ("evil.example:80", False),
    ],
)
def test_loopback_names(host, loopback):
    from vlmserve.entrypoints.openai.middleware import _host_name, is_loopback

    assert is_loopback(_host_name(host)) is loopback


def test_an_allowed_host_may_be_listed_with_its_port():
    server = start_server("qwen2_vl", allowed_hosts=("proxy.internal:8443",))
    try:
        assert _chat(server, {"host": "proxy.internal:8443"}).status_code == 200
    finally:
        server.stop()
