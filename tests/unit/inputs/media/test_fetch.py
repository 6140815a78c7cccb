"""SSRF-guarded image fetching against a loopback server (no external network).

The loopback server counts every request, so refusals can be shown to happen before any
connection is made.
"""

from __future__ import annotations

import base64
import io
import socket
import ssl
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from PIL import Image

from support.loopback_http import QuietHandler
from vlmserve.inputs.media import MediaError, MediaPolicy, decode_image, fetch, load_image_bytes

CAP = 100_000
LOOP = MediaPolicy(allowed_hosts=("127.0.0.0/8",), fetch_timeout=5.0, max_image_bytes=CAP)


def _encode(fmt: str) -> bytes:
    img = Image.frombytes("RGB", (32, 24), bytes((i * 31) % 256 for i in range(32 * 24 * 3)))
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


IMAGES = {
    "/img.png": (_encode("PNG"), "image/png"),
    "/img.jpg": (_encode("JPEG"), "image/jpeg"),
    "/img.webp": (_encode("WEBP"), "image/webp"),
    "/img.gif": (_encode("GIF"), "image/gif"),
}


class Handler(QuietHandler):
    default_content_type = "image/png"
    protocol_version = "HTTP/1.1"  # needed for chunked responses

    def _redirect(self, location):
        self._send(302, b"", "text/plain", [("Location", location)])

    def do_GET(self):  # noqa: C901 - a route table
        with self.server.lock:
            self.server.requests.append(self.path)
            self.server.hosts.append(self.headers.get("Host"))
        path = urlsplit(self.path).path
        try:
            if path in IMAGES:
                self._send(200, *IMAGES[path])
            elif path == "/big-declared":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(10**12))
                self.end_headers()
                self.wfile.write(IMAGES["/img.png"][0][:16])
            elif path == "/big-chunked":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunk = b"\0" * 16384
                for _ in range(4 * CAP // len(chunk)):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.write(b"0\r\n\r\n")
            elif path == "/slow":
                time.sleep(2.5)
                self._send(200, *IMAGES["/img.png"])
            elif path == "/drip":
                body = IMAGES["/img.png"][0]
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for i in range(len(body)):  # each byte well inside any read timeout
                    self.wfile.write(body[i : i + 1])
                    self.wfile.flush()
                    time.sleep(0.05)
            elif path == "/missing":
                self._send(404, b"not found", "text/plain")
            elif path == "/boom":
                self._send(500, b"oops", "text/plain")
            elif path == "/html":
                self._send(200, b"<!doctype html><html><body>nope</body></html>", "image/png")
            elif path == "/self":
                self._redirect("/self")
            elif path.startswith("/chain/"):
                n = int(path.rsplit("/", 1)[1])
                if n == 0:
                    self._send(200, *IMAGES["/img.png"])
                else:
                    self._redirect(f"/chain/{n - 1}")
            elif path == "/to":
                self._redirect(parse_qs(urlsplit(self.path).query)["u"][0])
            else:
                self._send(404, b"", "text/plain")
        except (ConnectionError, OSError):
            pass  # the client hung up on purpose (caps, timeouts)


def _serve(server):
    server.lock = threading.Lock()
    server.requests = []
    server.hosts = []
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server


@pytest.fixture(scope="module")
def _server_module():
    server = _serve(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def server(_server_module):
    with _server_module.lock:
        _server_module.requests.clear()
        _server_module.hosts.clear()
    return _server_module


@pytest.fixture
def port(server):
    return server.server_address[1]


def fake_dns(monkeypatch, answers: dict[str, list[list[str]]]):
    """Make listed hostnames resolve to the given IPs (one list per successive lookup)."""
    real = socket.getaddrinfo
    calls: dict[str, int] = {}

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in answers:
            return real(host, port, *args, **kwargs)
        n = calls[host] = calls.get(host, 0) + 1
        ips = answers[host][min(n, len(answers[host])) - 1]
        out = []
        for ip in ips:
            if ":" in ip:
                out.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, port, 0, 0)))
            else:
                out.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)))
        return out

    monkeypatch.setattr(fetch.socket, "getaddrinfo", getaddrinfo)
    return calls


def refused(url, policy=None, code="invalid_image_url"):
    with pytest.raises(MediaError) as info:
        load_image_bytes(url, policy or MediaPolicy())
    assert info.value.code == code
    return info.value.message


# -- default policy: nothing non-public is ever contacted ----------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:{port}/img.png",
        "http://localhost:{port}/img.png",
        "http://127.1.2.3:{port}/img.png",
        "http://0.0.0.0:{port}/img.png",
        "http://[::1]:{port}/img.png",
        "http://[::ffff:127.0.0.1]:{port}/img.png",
        "http://[::ffff:7f00:1]:{port}/img.png",
        "http://10.0.0.1/img.png",
        "http://192.168.1.1/img.png",
        "http://172.16.0.1/img.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://100.64.0.1/img.png",
        "http://[fd00::1]/img.png",
        "http://[fe80::1]/img.png",
        "http://[64:ff9b::7f00:1]/img.png",
        "http://[2002:7f00:1::1]/img.png",
        "http://224.0.0.1/img.png",
        "http://255.255.255.255/img.png",
        "http://192.0.2.10/img.png",
        "http://2130706433:{port}/img.png",  # decimal 127.0.0.1
    ],
)
def test_default_policy_refuses_non_public(server, port, url):
    message = refused(url.format(port=port))
    assert message == "image URL points to a non-public address"
    assert server.requests == []


def test_public_name_resolving_to_loopback_refused(server, port, monkeypatch):
    fake_dns(monkeypatch, {"images.example.com": [["127.0.0.1"]]})
    message = refused(f"http://images.example.com:{port}/img.png")
    assert "127.0.0.1" not in message
    assert server.requests == []


def test_every_resolved_address_is_checked(server, port, monkeypatch):
    fake_dns(monkeypatch, {"images.example.com": [["93.184.216.34", "127.0.0.1"]]})
    refused(f"http://images.example.com:{port}/img.png")
    assert server.requests == []


def test_unresolvable_host(monkeypatch):
    fake_dns(monkeypatch, {})
    monkeypatch.setattr(fetch.socket, "getaddrinfo", lambda *a, **k: (_ for _ in ()).throw(socket.gaierror("x")))
    assert refused("http://no-such-host.invalid/x.png") == "image URL host could not be resolved"


@pytest.mark.parametrize(
    "url", ["ftp://example.com/a.png", "gopher://x/", "javascript:alert(1)", "file:///etc/passwd", "ws://example.com/"]
)
def test_bad_schemes_refused(url):
    assert "/etc" not in refused(url)


def test_scheme_relative_url_is_not_fetched():
    # No scheme -> treated as bare base64, which "//" is not.
    refused("//example.com/a.png", code="invalid_image")


# -- allowed loopback: real fetches --------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_allowlisted_fetch_matches_data_uri(server, port, path):
    data = load_image_bytes(f"http://127.0.0.1:{port}{path}", LOOP)
    assert data == IMAGES[path][0]
    uri = f"data:{IMAGES[path][1]};base64," + base64.b64encode(IMAGES[path][0]).decode()
    via_url = decode_image(data, LOOP)
    via_uri = decode_image(load_image_bytes(uri, LOOP), LOOP)
    assert via_url.tobytes() == via_uri.tobytes() and via_url.mode == "RGB"


def test_allowlisted_hostname_keeps_host_header(server, port):
    # "localhost" may resolve to ::1 first while the server listens on 127.0.0.1 only.
    policy = MediaPolicy(allowed_hosts=("LOCALHOST",))
    assert load_image_bytes(f"http://localhost:{port}/img.png", policy) == IMAGES["/img.png"][0]
    assert server.hosts == [f"localhost:{port}"]


def test_dns_rebinding_uses_the_validated_address(server, port, monkeypatch):
    # First answer is allowed; any later lookup would give an address that is refused (and
    # unroutable). The fetch must resolve once and connect to the address it validated.
    calls = fake_dns(monkeypatch, {"images.example.com": [["127.0.0.1"], ["10.255.255.1"]]})
    data = load_image_bytes(f"http://images.example.com:{port}/img.png", LOOP)
    assert data == IMAGES["/img.png"][0]
    assert calls == {"images.example.com": 1}
    assert server.hosts == [f"images.example.com:{port}"]


def test_redirect_to_non_allowed_address_refused_at_the_hop(server, port, monkeypatch):
    fake_dns(monkeypatch, {"images.example.com": [["127.0.0.1"]]})
    policy = MediaPolicy(allowed_hosts=("images.example.com",), fetch_timeout=5.0)
    target = f"http://127.0.0.1:{port}/img.png"
    message = refused(f"http://images.example.com:{port}/to?u={target}", policy)
    assert message == "image URL points to a non-public address"
    assert len(server.requests) == 1 and server.requests[0].startswith("/to")


def test_redirect_each_hop_resolved_once(server, port, monkeypatch):
    calls = fake_dns(monkeypatch, {"images.example.com": [["127.0.0.1"], ["127.0.0.1"], ["10.255.255.1"]]})
    url = f"http://images.example.com:{port}/chain/1"
    assert load_image_bytes(url, LOOP) == IMAGES["/img.png"][0]
    assert calls == {"images.example.com": 2}


def test_redirect_to_other_scheme_refused(server, port):
    message = refused(f"http://127.0.0.1:{port}/to?u=file:///etc/passwd", LOOP)
    assert "/etc" not in message and "scheme" in message


def test_redirects_within_limit_followed(server, port):
    assert load_image_bytes(f"http://127.0.0.1:{port}/chain/5", LOOP) == IMAGES["/img.png"][0]
    assert len(server.requests) == 6


def test_too_many_redirects(server, port):
    assert refused(f"http://127.0.0.1:{port}/chain/6", LOOP) == "image URL redirected too many times"
    assert len(server.requests) == 6  # the 7th hop is never requested
    refused(f"http://127.0.0.1:{port}/self", LOOP)


# -- caps, timeouts, upstream errors ---------------------------------------------------------------


def test_oversized_by_content_length(server, port):
    start = time.monotonic()
    assert refused(f"http://127.0.0.1:{port}/big-declared", LOOP) == f"image exceeds {CAP} bytes"
    assert time.monotonic() - start < 2


def test_oversized_by_stream_without_content_length(server, port):
    assert refused(f"http://127.0.0.1:{port}/big-chunked", LOOP) == f"image exceeds {CAP} bytes"


def test_oversized_real_image(server, port):
    small = MediaPolicy(allowed_hosts=("127.0.0.0/8",), max_image_bytes=100)
    assert refused(f"http://127.0.0.1:{port}/img.png", small) == "image exceeds 100 bytes"


@pytest.mark.parametrize("path", ["/slow", "/drip"])
def test_total_timeout(server, port, path):
    policy = MediaPolicy(allowed_hosts=("127.0.0.0/8",), fetch_timeout=0.5)
    start = time.monotonic()
    assert refused(f"http://127.0.0.1:{port}{path}", policy) == "image URL timed out"
    assert time.monotonic() - start < 1.5


@pytest.mark.parametrize("path,status", [("/missing", 404), ("/boom", 500)])
def test_upstream_errors(server, port, path, status):
    assert refused(f"http://127.0.0.1:{port}{path}", LOOP) == f"image URL returned HTTP {status}"


def test_connection_refused():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    closed_port = sock.getsockname()[1]
    sock.close()
    assert refused(f"http://127.0.0.1:{closed_port}/x.png", LOOP) == "image URL could not be fetched"


def test_html_served_as_image_fails_at_decode(server, port):
    data = load_image_bytes(f"http://127.0.0.1:{port}/html", LOOP)
    with pytest.raises(MediaError) as info:
        decode_image(data, LOOP)
    assert info.value.code == "invalid_image"


# -- file:// ----------------------------------------------------------------------------------------


@pytest.fixture
def file_tree(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "ok.png").write_bytes(IMAGES["/img.png"][0])
    outside = tmp_path / "secret.png"
    outside.write_bytes(IMAGES["/img.png"][0])
    (root / "escape.png").symlink_to(outside)
    (root / "inner-link.png").symlink_to(root / "sub" / "ok.png")
    return root, outside


def test_file_refused_by_default(file_tree):
    root, _ = file_tree
    message = refused(f"file://{root}/sub/ok.png")
    assert str(root) not in message


def test_file_allowed_under_root(file_tree):
    root, _ = file_tree
    policy = MediaPolicy(local_files_root=str(root))
    assert load_image_bytes(f"file://{root}/sub/ok.png", policy) == IMAGES["/img.png"][0]
    assert load_image_bytes(f"file://{root}/inner-link.png", policy) == IMAGES["/img.png"][0]


@pytest.mark.parametrize(
    "rel",
    ["/sub/../sub/ok.png", "/../secret.png", "/sub/%2e%2e/%2e%2e/secret.png", "/escape.png", "/sub", "/nope.png", ""],
)
def test_file_escapes_refused(file_tree, rel):
    root, outside = file_tree
    policy = MediaPolicy(local_files_root=str(root))
    message = refused(f"file://{root}{rel}", policy)
    assert str(root) not in message and str(outside) not in message


def test_file_outside_root_absolute(file_tree):
    root, outside = file_tree
    refused(f"file://{outside}", MediaPolicy(local_files_root=str(root)))
    refused("file:///etc/hostname", MediaPolicy(local_files_root=str(root)))


def test_file_size_cap(file_tree):
    root, _ = file_tree
    policy = MediaPolicy(local_files_root=str(root), max_image_bytes=10)
    assert refused(f"file://{root}/sub/ok.png", policy) == "image exceeds 10 bytes"


# -- https: connect to the pinned IP, verify the certificate for the hostname ---------------------


def _self_signed(hostname: str, tmp_path):
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)])
    now = datetime.now(timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(hostname)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert_pem)
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_pem.decode(), str(cert_file), str(key_file)


@pytest.fixture
def tls_server(tmp_path):
    ca_pem, cert_file, key_file = _self_signed("images.example.com", tmp_path)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert_file, key_file)
    server.sni = []
    ctx.sni_callback = lambda sslobj, name, _ctx: server.sni.append(name)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    _serve(server)
    yield server, ca_pem
    server.shutdown()
    server.server_close()


def test_https_pins_ip_but_verifies_hostname(tls_server, monkeypatch):
    server, ca_pem = tls_server
    port = server.server_address[1]
    trust = ssl.create_default_context(cadata=ca_pem)
    monkeypatch.setattr(fetch, "_make_transport", lambda: httpx.HTTPTransport(retries=0, verify=trust))
    calls = fake_dns(monkeypatch, {"images.example.com": [["127.0.0.1"]], "other.example.com": [["127.0.0.1"]]})
    assert load_image_bytes(f"https://images.example.com:{port}/img.png", LOOP) == IMAGES["/img.png"][0]
    assert server.sni == ["images.example.com"] and server.hosts == [f"images.example.com:{port}"]
    # Same IP, but the certificate does not match this hostname: verification must fail.
    assert refused(f"https://other.example.com:{port}/img.png", LOOP) == "image URL could not be fetched"
    assert calls == {"images.example.com": 1, "other.example.com": 1}
    # The total deadline also holds under TLS (the watchdog must reach the TLS socket).
    policy = MediaPolicy(allowed_hosts=("127.0.0.0/8",), fetch_timeout=0.5)
    start = time.monotonic()
    assert refused(f"https://images.example.com:{port}/drip", policy) == "image URL timed out"
    assert time.monotonic() - start < 1.5


@pytest.mark.parametrize(
    "url", ["http://", "http:///path", "http://[::1", "https://xn--/", "http://a..b/", "http://%00/", "http://h:99999/"]
)
def test_malformed_urls_raise_media_error_only(monkeypatch, url):
    monkeypatch.setattr(fetch.socket, "getaddrinfo", lambda *a, **k: (_ for _ in ()).throw(socket.gaierror("x")))
    refused(url)


def test_allowed_media_domains_bound_every_hop(server, port, monkeypatch):
    """--allowed-media-domains: only those domains and their subdomains, checked before any
    lookup, on the first hop and on every redirect."""
    fake_dns(monkeypatch, {"img.example.com": [["127.0.0.1"]] * 4, "other.org": [["127.0.0.1"]] * 4})
    policy = MediaPolicy(
        allowed_hosts=("127.0.0.0/8", "img.example.com", "other.org"),
        allowed_domains=("example.com",),
        fetch_timeout=5.0,
    )
    assert load_image_bytes(f"http://img.example.com:{port}/img.png", policy) == IMAGES["/img.png"][0]
    before = len(server.requests)
    assert refused(f"http://other.org:{port}/img.png", policy) == "image URL host is not in the allowed media domains"
    assert refused(f"http://127.0.0.1:{port}/img.png", policy) == "image URL host is not in the allowed media domains"
    assert len(server.requests) == before  # refused before any request
    target = f"http://other.org:{port}/img.png"
    assert "allowed media domains" in refused(f"http://img.example.com:{port}/to?u={target}", policy)
    assert MediaPolicy(allowed_domains=("example.com",)).domain_allowed("EXAMPLE.com.")
    assert not MediaPolicy(allowed_domains=("example.com",)).domain_allowed("badexample.com")
