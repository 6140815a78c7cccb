"""Issue 4 acceptance, end to end over HTTP: image URLs fetched and decoded by the real server.

A threaded loopback HTTP server serves the fixture images and a set of hostile endpoints and
counts every connection and every request path, so a refusal can be shown to happen before any
connection is made. Three in-process servers (qwen2_vl fixture, thread guard on):

- `loop`:    allow-list 127.0.0.1/32, 1 s fetch timeout, a small max_image_bytes (CAP);
- `default`: the default policy (no allowed hosts): every non-public address is refused;
- `named`:   allow-list the host *name* images.example.com (DNS faked to 127.0.0.1), so a
             redirect from it to 127.0.0.1 must be refused at the hop.
"""

from __future__ import annotations

import base64
import collections
import io
import re
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer
from urllib.parse import urlsplit

import httpx
import pytest
from PIL import Image

import vlmserve.inputs.media.cache as cache_mod
import vlmserve.inputs.preprocess as preprocess_mod
from support.helpers import IMAGES, chat_body
from support.loopback_http import QuietHandler
from support.server import start_server
from vlmserve.inputs.media import fetch

CAP = 256 * 1024  # max_image_bytes of the `loop` server; every fixture image is far below it
TIMEOUT = 1.0  # image_fetch_timeout of the `loop` and `named` servers
SLOW_S = 3.0  # the slow endpoint's delay: well past TIMEOUT
MAX_TOKENS = 8

FIXTURES = {  # one fixture per accepted format, served with its real content type
    "png": (IMAGES / "small_64x48.png", "image/png"),
    "jpg": (IMAGES / "photo_100x80.jpg", "image/jpeg"),
    "webp": (IMAGES / "pattern_72x56.webp", "image/webp"),
    "gif": (IMAGES / "anim_48x48.gif", "image/gif"),
}
IP_LIKE = re.compile(r"\d{1,3}(\.\d{1,3}){3}|\[|::|[0-9a-f]{1,4}:[0-9a-f]{0,4}:", re.IGNORECASE)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def huge_dims_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A well-formed PNG header (valid CRCs) declaring width x height RGB; almost no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def data_uri_of(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


PNG = FIXTURES["png"][0].read_bytes()
ROUTES = {f"/img/{name}": (path.read_bytes(), ctype) for name, (path, ctype) in FIXTURES.items()}
ROUTES.update(
    {
        "/html": (b"<!doctype html><html><body>not an image</body></html>", "image/png"),
        "/truncated": (PNG[: len(PNG) // 2], "image/png"),
        "/huge-dims": (huge_dims_png(), "image/png"),
    }
)


# -- loopback image server -------------------------------------------------------------------------


class Handler(QuietHandler):
    default_content_type = "text/plain"
    protocol_version = "HTTP/1.1"  # chunked responses

    def do_GET(self):  # noqa: C901 - a route table
        path = urlsplit(self.path).path
        with self.server.lock:
            self.server.hits[path] += 1
        try:
            if path in ROUTES:
                self._send(200, *ROUTES[path])
            elif path.startswith("/nine/"):
                self._send(200, PNG, "image/png")
            elif path == "/slow":
                self.server.stopping.wait(SLOW_S)
                self._send(200, PNG, "image/png")
            elif path == "/missing":
                self._send(404, b"not found")
            elif path == "/missing-late":  # fails once the request's other fetches are under way
                self.server.stopping.wait(0.3)
                self._send(404, b"not found")
            elif path == "/big-declared":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(10**12))
                self.end_headers()
                self.wfile.write(PNG[:16])
            elif path == "/big-chunked":  # no Content-Length: only the streamed count can stop it
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunk = PNG + b"\0" * (16384 - len(PNG))
                for _ in range(4 * CAP // len(chunk)):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.write(b"0\r\n\r\n")
            elif path == "/hop":  # redirect to 127.0.0.1 on another path
                port = self.server.server_address[1]
                self._send(302, extra=[("Location", f"http://127.0.0.1:{port}/img/png")])
            else:
                self._send(404)
        except OSError:
            pass  # the fetcher hung up on purpose (caps, timeouts)


class CountingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.hits: collections.Counter = collections.Counter()
        self.connections = 0
        self.stopping = threading.Event()

    def process_request(self, request, client_address):
        with self.lock:
            self.connections += 1
        super().process_request(request, client_address)

    def handle_error(self, request, client_address):
        pass  # fetchers hang up on purpose (caps, timeouts); the counts are what the tests read

    def reset(self) -> None:
        with self.lock:
            self.hits.clear()
            self.connections = 0

    @property
    def port(self) -> int:
        return self.server_address[1]

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@pytest.fixture(scope="module")
def _images_module():
    server = CountingServer()
    thread = threading.Thread(target=server.serve_forever, name="loopback-images", daemon=True)
    thread.start()
    yield server
    server.stopping.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def images(_images_module):
    _images_module.reset()
    return _images_module


# -- vlmserve servers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loop():
    server = start_server(
        "qwen2_vl", allowed_image_hosts=("127.0.0.1/32",), image_fetch_timeout=TIMEOUT, max_image_bytes=CAP
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def default():
    server = start_server("qwen2_vl")  # default policy: no allowed hosts
    yield server
    server.stop()


@pytest.fixture(scope="module")
def named():
    server = start_server("qwen2_vl", allowed_image_hosts=("images.example.com",), image_fetch_timeout=TIMEOUT)
    yield server
    server.stop()


def fake_dns(monkeypatch, answers: dict[str, str]) -> collections.Counter:
    """Resolve the listed names to the given IPv4 address in the fetch module's resolver seam
    (socket.getaddrinfo, as fetch._resolve calls it). The servers run in this process."""
    real = fetch.socket.getaddrinfo
    calls: collections.Counter = collections.Counter()

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in answers:
            return real(host, port, *args, **kwargs)
        calls[host] += 1
        return [(fetch.socket.AF_INET, fetch.socket.SOCK_STREAM, 6, "", (answers[host], port))]

    monkeypatch.setattr(fetch.socket, "getaddrinfo", getaddrinfo)
    return calls


def post(server, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        return client.post("/v1/chat/completions", json=body)


def body_for(server, urls, text: str = "Describe the image.", **kwargs) -> dict:
    return chat_body(server.model_id, text, list(urls), **{"temperature": 0, "max_tokens": MAX_TOKENS, **kwargs})


def completion(server, urls, text: str = "Describe the image.") -> str:
    resp = post(server, body_for(server, urls, text))
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def assert_error(resp: httpx.Response, code: str, param: str = "messages[0].content[0]") -> str:
    """400 in OpenAI's shape with this code and param; returns the message."""
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["code"] == code and err["param"] == param, err
    assert isinstance(err["message"], str) and err["message"]
    assert not IP_LIKE.search(err["message"]) and "/" not in err["message"], err["message"]
    return err["message"]


# -- 1. allow-listed loopback fetch == the same bytes as a data URI ------------------------------


def test_allowlisted_url_equals_data_uri(loop, images):
    outputs = {}
    for name, (path, ctype) in FIXTURES.items():
        via_url = completion(loop, [images.url(f"/img/{name}")])
        via_uri = completion(loop, [data_uri_of(path.read_bytes(), ctype)])
        assert via_url == via_uri, name
        outputs[name] = via_url
    assert images.hits == {f"/img/{name}": 1 for name in FIXTURES}
    assert len(set(outputs.values())) > 1  # the image really reaches the model


def test_allowlisted_redirect_to_another_path_is_followed(loop, images):
    assert completion(loop, [images.url("/hop")]) == completion(loop, [data_uri_of(PNG)])
    assert images.hits == {"/hop": 1, "/img/png": 1}


# -- 2. default policy: nothing non-public is contacted -----------------------------------------------

NON_PUBLIC = [
    "http://127.0.0.1:{port}/img/png",
    "http://localhost:{port}/img/png",
    "http://10.0.0.1:{port}/img/png",
    "http://192.168.1.1/img/png",
    "http://169.254.169.254/latest/meta-data/",
    "http://[::1]:{port}/img/png",
    "http://[::ffff:127.0.0.1]:{port}/img/png",
    "http://images.example.com:{port}/img/png",  # public-looking name; DNS answers 127.0.0.1
]


@pytest.mark.parametrize("template", NON_PUBLIC)
def test_default_policy_refuses_non_public(default, images, monkeypatch, template):
    calls = fake_dns(monkeypatch, {"images.example.com": "127.0.0.1"})
    url = template.format(port=images.port)
    # Image first in the first message, and image second in the second message: param follows it.
    first = post(default, body_for(default, [url]))
    second = post(
        default,
        {
            "model": default.model_id,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                },
            ],
        },
    )
    for resp, param in ((first, "messages[0].content[0]"), (second, "messages[1].content[1]")):
        message = assert_error(resp, "invalid_image_url", param)
        assert message == "image URL points to a non-public address"
        assert str(images.port) not in message and "localhost" not in message and "example" not in message
    if "example.com" in url:
        assert calls["images.example.com"] == 2  # refused on the DNS answer, not for lack of one
    assert images.connections == 0 and not images.hits


def test_dns_seam_reaches_the_server(loop, images, monkeypatch):
    """Control for the test above: the same faked name is fetched where 127.0.0.1 is allowed."""
    calls = fake_dns(monkeypatch, {"images.example.com": "127.0.0.1"})
    assert completion(loop, [images.url("/img/png", host="images.example.com")]) == completion(loop, [data_uri_of(PNG)])
    assert calls["images.example.com"] == 1 and images.hits == {"/img/png": 1}


def test_redirect_from_allowlisted_name_to_loopback_refused_at_the_hop(named, images, monkeypatch):
    fake_dns(monkeypatch, {"images.example.com": "127.0.0.1"})
    # The name itself is allowed (control) ...
    assert completion(named, [images.url("/img/png", host="images.example.com")]) == completion(
        named, [data_uri_of(PNG)]
    )
    images.reset()
    # ... but its redirect to 127.0.0.1 is checked again and refused before connecting.
    message = assert_error(
        post(named, body_for(named, [images.url("/hop", host="images.example.com")])), "invalid_image_url"
    )
    assert message == "image URL points to a non-public address"
    assert images.hits == {"/hop": 1} and images.connections == 1


# -- 3. hostile inputs: the documented 400, alone and next to good requests ------------------------


def bad_cases(images) -> dict[str, tuple[dict, str, str, object]]:
    """name -> (request body args, code, param, expected message or predicate)."""
    exceeds = f"image exceeds {CAP} bytes"
    return {
        "big-declared": ([images.url("/big-declared")], "invalid_image_url", "messages[0].content[0]", exceeds),
        "big-chunked": ([images.url("/big-chunked")], "invalid_image_url", "messages[0].content[0]", exceeds),
        "slow": ([images.url("/slow")], "invalid_image_url", "messages[0].content[0]", "image URL timed out"),
        "404": ([images.url("/missing")], "invalid_image_url", "messages[0].content[0]", "image URL returned HTTP 404"),
        "html": (
            [images.url("/html")],
            "invalid_image",
            "messages[0].content[0]",
            "image format is not supported (use PNG, JPEG, WEBP or GIF)",
        ),
        "truncated": (
            [images.url("/truncated")],
            "invalid_image",
            "messages[0].content[0]",
            "image could not be decoded",
        ),
        "huge-dims": ([images.url("/huge-dims")], "invalid_image", "messages[0].content[0]", lambda m: "pixels" in m),
        "nine-images": (
            [images.url(f"/nine/{i}") for i in range(9)],
            "invalid_image",
            "messages",
            "too many images: 9 > 8 per request",
        ),
        "bad-base64": (
            ["data:image/png;base64,iVBORw0KGgo@@@not*base64"],
            "invalid_image",
            "messages[0].content[0]",
            "image data is not valid base64",
        ),
    }


def check_bad(resp: httpx.Response, case) -> None:
    _, code, param, expected = case
    message = assert_error(resp, code, param)
    assert expected(message) if callable(expected) else message == expected, message


BAD_NAMES = [
    "big-declared",
    "big-chunked",
    "slow",
    "404",
    "html",
    "truncated",
    "huge-dims",
    "nine-images",
    "bad-base64",
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_input_alone(loop, images, name):
    case = bad_cases(images)[name]
    start = time.monotonic()
    resp = post(loop, body_for(loop, case[0]))
    elapsed = time.monotonic() - start
    check_bad(resp, case)
    if name == "slow":
        assert elapsed < TIMEOUT + 1.5, elapsed
    if name == "nine-images":
        assert images.connections == 0  # refused before fetching any of them
    if name.startswith("big-"):
        assert elapsed < TIMEOUT, elapsed  # the cap, not the timeout, stopped it


def test_animated_gif_uses_first_frame(loop, images):
    gif = Image.open(FIXTURES["gif"][0])
    assert gif.n_frames > 1
    frames = []
    for index in (0, 1):
        gif.seek(index)
        frames.append(png_bytes(gif.convert("RGB")))
    assert frames[0] != frames[1]
    via_gif = completion(loop, [images.url("/img/gif")])
    first, second = (completion(loop, [data_uri_of(f)]) for f in frames)
    assert via_gif == first
    if first != second:  # the tiny model tells the two frames apart
        assert via_gif != second


def test_bad_inputs_do_not_disturb_concurrent_good_requests(loop, images):
    good = [
        body_for(loop, [images.url("/img/png")], max_tokens=16),
        body_for(loop, [data_uri_of(FIXTURES["jpg"][0].read_bytes(), "image/jpeg")], max_tokens=16),
        body_for(loop, [images.url("/img/webp"), images.url("/img/gif")], "Compare them.", max_tokens=16),
        body_for(loop, [], "Tell me a story.", max_tokens=16),
    ]
    alone = [post(loop, body) for body in good]
    assert all(r.status_code == 200 for r in alone)
    alone_text = [r.json()["choices"][0]["message"]["content"] for r in alone]

    cases = bad_cases(images)
    bad_jobs = [("bad", name) for name in cases]
    good_jobs = [("good", i) for i in range(len(good))] * 2
    jobs = [job for pair in zip(bad_jobs, good_jobs) for job in pair] + bad_jobs[len(good_jobs) :]

    def send(job):
        kind, key = job
        return job, post(loop, good[key] if kind == "good" else body_for(loop, cases[key][0]))

    assert sorted(cases) == sorted(BAD_NAMES)
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(send, jobs))
    for (kind, key), resp in results:
        if kind == "bad":
            check_bad(resp, cases[key])
        else:
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"] == alone_text[key], key
    assert not any(path.startswith("/nine/") for path in images.hits)


# -- 4. no media work on the event loop or the MLX thread -------------------------------------------


def test_health_is_fast_while_a_slow_fetch_is_in_flight(loop, images):
    result = {}

    def slow_request():
        start = time.monotonic()
        result["resp"] = post(loop, body_for(loop, [images.url("/slow")]))
        result["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=slow_request)
    thread.start()
    deadline = time.monotonic() + 5
    while not images.hits["/slow"]:  # the fetch has connected and is waiting on the server
        assert time.monotonic() < deadline
        time.sleep(0.005)
    samples = []
    with httpx.Client(base_url=loop.base_url, timeout=5) as client:
        for _ in range(8):
            start = time.perf_counter()
            resp = client.get("/health")
            samples.append(time.perf_counter() - start)
            assert resp.status_code == 200
            time.sleep(0.05)
    in_flight = thread.is_alive()
    thread.join(10)
    assert in_flight, "the slow fetch ended before /health was sampled"
    # A loop blocked by the fetch would answer only after it timed out (TIMEOUT s); the margin
    # leaves room for a busy 2-core CI machine.
    assert max(samples) < 0.2 * TIMEOUT, samples
    assert_error(result["resp"], "invalid_image_url")
    assert result["elapsed"] < TIMEOUT + 1.5


def test_media_work_runs_on_pool_threads(loop, images, monkeypatch):
    seen: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    prep = loop.state.preprocessor

    def recording(label, fn):
        def wrapper(*args, **kwargs):
            current = threading.current_thread()
            seen[label].append((current.name, current.ident))
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(preprocess_mod, "load_image_bytes", recording("fetch", preprocess_mod.load_image_bytes))
    monkeypatch.setattr(prep.images, "get_or_decode", recording("decode", prep.images.get_or_decode))
    monkeypatch.setattr(prep, "encode", recording("encode", prep.encode))
    unique = png_bytes(Image.effect_noise((40, 30), 80).convert("RGB"))
    completion(loop, [images.url("/img/jpg"), data_uri_of(unique)])

    worker = loop.engine.worker
    forbidden = {worker.ident, loop.thread.ident, threading.main_thread().ident}
    assert worker.name == "mlx-worker" and loop.thread.name == "uvicorn"
    assert len(seen["fetch"]) == 2 and len(seen["decode"]) == 2 and len(seen["encode"]) == 1
    # The URL is fetched (and decoded) on the fetch pool; the data URI on the CPU pool, never
    # behind remote fetches.
    assert sorted(name.split("_")[0] for name, _ in seen["fetch"]) == ["fetch", "preprocess"]
    assert sorted(name.split("_")[0] for name, _ in seen["decode"]) == ["fetch", "preprocess"]
    assert all(name.startswith("preprocess_") for name, _ in seen["encode"])
    for label in ("fetch", "decode", "encode"):
        for name, ident in seen[label]:
            assert ident not in forbidden, (label, name)


# -- 5. the decoded-image cache ---------------------------------------------------------------------


def test_same_bytes_decoded_once_within_and_across_requests(loop, images, monkeypatch):
    decoded = []
    real = cache_mod.decode_image

    def counting(data, policy):
        decoded.append(data)
        time.sleep(0.2)  # the request's other copies arrive while this decode is in flight
        return real(data, policy)

    monkeypatch.setattr(cache_mod, "decode_image", counting)
    cache = loop.state.preprocessor.images
    # Fresh bytes (never seen by this server), served both by URL and as a data URI.
    img = Image.effect_noise((48, 40), 60).convert("RGB")
    fresh = png_bytes(img)
    ROUTES["/img/fresh"] = (fresh, "image/png")
    try:
        hits, misses = cache.hits, cache.misses
        url, uri = images.url("/img/fresh"), data_uri_of(fresh)
        first = completion(loop, [uri, url, uri], "Same image three times?")  # within one request
        assert (cache.misses - misses, cache.hits - hits) == (1, 2)
        assert completion(loop, [url, uri, uri], "Same image three times?") == first  # across requests
        assert (cache.misses - misses, cache.hits - hits) == (1, 5)
        assert decoded == [fresh]
        assert images.hits == {"/img/fresh": 2}  # bytes are fetched per request; decoding is cached
    finally:
        del ROUTES["/img/fresh"]


def test_slow_image_urls_do_not_block_other_requests_preprocessing(loop, images):
    """Fetches wait on the fetch pool, not on a CPU-pool worker: with more slow URLs in flight
    than there are preprocessing workers, a text request still goes straight through."""
    slow = loop.config.preprocess_workers + 1
    with ThreadPoolExecutor(slow) as pool:
        pending = [pool.submit(post, loop, body_for(loop, [images.url("/slow")])) for _ in range(slow)]
        deadline = time.monotonic() + 5
        while images.hits["/slow"] < min(slow, loop.state.preprocessor.host_slots.per_host):  # the host's share
            assert time.monotonic() < deadline
            time.sleep(0.005)
        start = time.monotonic()
        resp = post(loop, body_for(loop, [], text="Just text, please.", max_tokens=2))
        elapsed = time.monotonic() - start
        still_fetching = not any(f.done() for f in pending)
        for f in pending:
            assert_error(f.result(), "invalid_image_url")
    assert resp.status_code == 200, resp.text
    assert still_fetching, "the slow fetches ended before the text request was measured"
    assert elapsed < TIMEOUT / 2, f"text request waited {elapsed:.2f}s behind slow image fetches"


def test_a_hanging_image_host_delays_neither_data_uris_nor_more_than_its_share_of_fetches(loop, images):
    """More fetches of one hanging host than the whole fetch pool: that host holds at most its
    share of the pool, and a request with an inline image goes straight through meanwhile."""
    prep = loop.state.preprocessor
    hanging = prep.fetch_workers + 2
    with ThreadPoolExecutor(hanging) as pool:
        pending = [pool.submit(post, loop, body_for(loop, [images.url("/slow")])) for _ in range(hanging)]
        deadline = time.monotonic() + 5
        while images.hits["/slow"] < prep.host_slots.per_host:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(0.2)  # any fetch past the host's share would have started by now
        in_flight = images.hits["/slow"]
        start = time.monotonic()
        resp = post(loop, body_for(loop, [data_uri_of(png_bytes(Image.effect_noise((32, 24), 50).convert("RGB")))]))
        elapsed = time.monotonic() - start
        still_fetching = not any(f.done() for f in pending)
        for f in pending:
            assert_error(f.result(), "invalid_image_url")
    assert in_flight == prep.host_slots.per_host < prep.fetch_workers
    assert resp.status_code == 200, resp.text
    assert still_fetching, "the hanging fetches ended before the inline request was measured"
    assert elapsed < TIMEOUT / 2, f"an inline image waited {elapsed:.2f}s behind a hanging host"
    assert prep.host_slots.in_use() == 0  # no table entry left behind


def test_a_failed_request_stops_its_fetches_that_are_still_running(loop, images, monkeypatch):
    """One image fails at once: the request's hanging fetch is stopped then, not left to its timeout."""
    ended: list[tuple[float, str]] = []
    real = preprocess_mod.load_image_bytes

    def timed(url, policy, cancel=None):
        try:
            return real(url, policy, cancel)
        except Exception as exc:
            if "/slow" in url:
                ended.append((time.monotonic(), str(exc)))
            raise

    monkeypatch.setattr(preprocess_mod, "load_image_bytes", timed)
    resp = post(loop, body_for(loop, [images.url("/slow"), images.url("/missing-late")]))
    answered = time.monotonic()
    assert images.hits["/slow"] == 1  # it was running when the other image failed
    assert_error(resp, "invalid_image_url", "messages[0].content[1]")  # the late 404
    deadline = answered + TIMEOUT
    while not ended and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ended, "the hanging fetch was not stopped"
    assert ended[0][0] - answered < TIMEOUT / 2, "the hanging fetch ran on to its timeout"
    assert "cancelled" in ended[0][1]
