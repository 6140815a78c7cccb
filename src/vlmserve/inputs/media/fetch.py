"""Get raw image bytes from an image URL: data:, http(s):// (SSRF-guarded) or file:// (opt-in).

HTTP hardening, per hop:
- resolve the host once ourselves, refuse unless every address is permitted (see addresses.py);
- connect to that validated IP (URL host rewritten), keeping the Host header and TLS SNI/cert
  check on the hostname, so a second DNS answer (rebinding) can never choose the peer;
- redirects are followed by hand (no env proxies, no cookies), each hop re-checked;
- one deadline covers DNS, connect, headers and body across all hops: a watchdog shuts the socket
  down when it passes, so a slow-drip server cannot stretch it read by read;
- the byte cap is checked on Content-Length and on the streamed count.
Synchronous and blocking: call it from a worker thread, never from the event loop.
"""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx

from vlmserve.inputs.media.addresses import IPAddress, address_permitted, host_is_allowlisted, parse_ip
from vlmserve.inputs.media.decode import decode_base64_payload, decode_data_uri
from vlmserve.inputs.media.errors import MediaError, url_error
from vlmserve.inputs.media.localfile import read_local_file
from vlmserve.inputs.media.policy import MediaPolicy

_MAX_URL_CHARS = 8192  # for http(s)/file URLs; data: URIs are bounded by max_image_bytes
_REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 64 * 1024
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")


class FetchCancel:
    """Lets another thread stop a fetch that is running: its sockets are shut down, and the
    fetch ends with a MediaError (the request it was for has failed, or its client left)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadline: _Deadline | None = None
        self.cancelled = False

    def watch(self, deadline: _Deadline) -> None:
        with self._lock:
            self._deadline = deadline
            if self.cancelled:
                deadline.fire()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            if self._deadline is not None:
                self._deadline.fire()


def load_image_bytes(url: str, policy: MediaPolicy, cancel: FetchCancel | None = None) -> bytes:
    """Return the raw (undecoded) bytes an OpenAI `image_url.url` refers to. Raises MediaError."""
    if not isinstance(url, str) or not url.strip():
        raise url_error("image URL is empty")
    url = url.strip()
    match = _SCHEME.match(url)
    if match is None:
        return decode_base64_payload(url, policy)  # bare base64 (':' is not in its alphabet)
    scheme = match.group(1).lower()
    if scheme == "data":
        return decode_data_uri(url, policy)
    if len(url) > _MAX_URL_CHARS:
        raise url_error("image URL is too long")
    if scheme in ("http", "https"):
        try:
            return fetch_http(url, policy, cancel)
        except MediaError:
            raise
        except Exception as exc:  # noqa: BLE001 - contract: callers only ever see MediaError
            raise url_error("image URL could not be fetched") from exc
    if scheme == "file":
        return read_local_file(url, policy)
    raise url_error("image URL scheme is not supported (use http, https or data)")


class _Deadline:
    """Overall fetch deadline; on expiry, shuts down every socket this fetch opened."""

    def __init__(self, seconds: float) -> None:
        self.expires = time.monotonic() + seconds
        self.fired = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self.fire)
        self._timer.daemon = True
        self._timer.start()

    def remaining(self) -> float:
        left = self.expires - time.monotonic()
        if left <= 0:
            raise url_error("image URL timed out")
        return left

    def trace(self, event: str, info: dict) -> None:
        # httpcore trace hook: gives us each socket as it is made. TLS wrapping detaches the TCP
        # socket object (its fd moves to the SSLSocket), so track the TLS one as well.
        if event not in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            return
        sock = info["return_value"].get_extra_info("socket")
        if sock is None:
            return
        with self._lock:
            self._sockets.append(sock)
            if self.fired:
                _shutdown(sock)

    def fire(self) -> None:
        with self._lock:
            self.fired = True
            for sock in self._sockets:
                _shutdown(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _shutdown(sock: socket.socket) -> None:
    # Plain socket.shutdown on the fd (also under TLS) wakes a recv blocked in another thread.
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def fetch_http(url: str, policy: MediaPolicy, cancel: FetchCancel | None = None) -> bytes:
    deadline = _Deadline(policy.fetch_timeout)
    if cancel is not None:
        cancel.watch(deadline)
    try:
        current = _parse_url(url)
        for _hop in range(policy.max_redirects + 1):
            location = _fetch_hop(current, policy, deadline)
            if isinstance(location, bytes):
                return location
            current = _parse_url(location, base=current)
        raise url_error("image URL redirected too many times")
    except MediaError:
        if cancel is not None and cancel.cancelled:
            raise url_error("image fetch cancelled") from None
        if deadline.fired:
            raise url_error("image URL timed out") from None
        raise
    finally:
        deadline.cancel()


def _parse_url(url: str, base: httpx.URL | None = None) -> httpx.URL:
    try:
        parsed = base.join(url) if base is not None else httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise url_error("image URL is malformed") from exc
    if parsed.scheme not in ("http", "https"):
        # Also catches redirects to file:, data:, ftp: and friends.
        raise url_error("image URL scheme is not supported (use http, https or data)")
    if not parsed.raw_host:  # raw_host: .host IDNA-decodes and can raise on hostile labels
        raise url_error("image URL has no host")
    return parsed


def _resolve(host: str, port: int, deadline: _Deadline) -> list[IPAddress]:
    """getaddrinfo with the fetch deadline (it has no timeout of its own): runs in a daemon thread."""
    try:
        return [parse_ip(host)]  # IP literal: nothing to look up
    except ValueError:
        pass
    result: dict = {}

    def lookup() -> None:
        try:
            result["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except Exception as exc:  # noqa: BLE001 - reported below as "could not be resolved"
            result["error"] = exc

    worker = threading.Thread(target=lookup, name="media-dns", daemon=True)
    worker.start()
    worker.join(deadline.remaining())
    if worker.is_alive():
        raise url_error("image URL timed out")
    if "error" in result or not result.get("infos"):
        raise url_error("image URL host could not be resolved") from result.get("error")
    addrs = []
    for family, _type, _proto, _canon, sockaddr in result["infos"]:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        try:
            addrs.append(parse_ip(sockaddr[0]))
        except ValueError:
            continue
    if not addrs:
        raise url_error("image URL host could not be resolved")
    return addrs


def _fetch_hop(url: httpx.URL, policy: MediaPolicy, deadline: _Deadline) -> bytes | str:
    """One request. Returns the body, or the Location of a redirect to follow."""
    host = url.raw_host.decode("ascii")  # IDNA-encoded; IPv6 literals without brackets
    if not policy.domain_allowed(host):
        raise url_error("image URL host is not in the allowed media domains")
    port = url.port or (443 if url.scheme == "https" else 80)
    addrs = _resolve(host, port, deadline)  # exactly one lookup per hop; never re-resolved
    if not host_is_allowlisted(host, policy.allowed_hosts) and not all(
        address_permitted(a, policy.allowed_hosts) for a in addrs
    ):
        raise url_error("image URL points to a non-public address")
    unique = list(dict.fromkeys(addrs))[:4]
    try:
        for index, addr in enumerate(unique):
            try:
                return _send_pinned(url, host, addr, policy, deadline)
            except httpx.ConnectError:
                # e.g. "localhost" -> ::1 first while the server listens on 127.0.0.1 only.
                # Nothing was sent yet, so trying the next *validated* address is safe.
                if index == len(unique) - 1:
                    raise
        raise AssertionError("unreachable")
    except MediaError:
        raise
    except httpx.TimeoutException as exc:
        raise url_error("image URL timed out") from exc
    except (httpx.HTTPError, httpx.StreamError, OSError, ValueError) as exc:
        if deadline.fired:
            raise url_error("image URL timed out") from exc
        raise url_error("image URL could not be fetched") from exc


def _make_transport() -> httpx.BaseTransport:
    # Separate so tests can trust a self-signed CA; verification stays on (certifi by default).
    return httpx.HTTPTransport(retries=0)


def _send_pinned(url: httpx.URL, host: str, addr: IPAddress, policy: MediaPolicy, deadline: _Deadline) -> bytes | str:
    remaining = deadline.remaining()
    timeout = httpx.Timeout(remaining, connect=min(remaining, policy.fetch_timeout))
    ip_text = str(addr).split("%")[0]  # drop an IPv6 zone id; httpx cannot carry it in a URL
    # Connect to the validated IP; Host header and SNI/cert verification stay on the hostname.
    request = httpx.Request(
        "GET",
        url.copy_with(host=ip_text),
        headers={
            "Host": url.netloc.decode("ascii"),
            "Accept": "image/*",
            "Accept-Encoding": "identity",  # raw bytes: the cap is on what we store, no gzip bombs
            "User-Agent": "vlmserve-image-fetch",
        },
        extensions={"sni_hostname": host, "trace": deadline.trace},
    )
    # A fresh client per request: no pooled connection is reused for another host/SNI.
    with httpx.Client(
        transport=_make_transport(),
        timeout=timeout,
        follow_redirects=False,
        trust_env=False,  # env proxies would route around the IP pinning
    ) as client:
        response = client.send(request, stream=True)
        try:
            return _read_response(response, policy)
        finally:
            response.close()


def _read_response(response: httpx.Response, policy: MediaPolicy) -> bytes | str:
    status = response.status_code
    if status in _REDIRECTS:
        location = response.headers.get("location")
        if not location:
            raise url_error(f"image URL returned HTTP {status} without a Location")
        return location
    if not 200 <= status < 300:
        raise url_error(f"image URL returned HTTP {status}")
    too_large = url_error(f"image exceeds {policy.max_image_bytes} bytes")
    declared = response.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > policy.max_image_bytes:
                raise too_large
        except ValueError as exc:
            raise url_error("image URL returned an invalid Content-Length") from exc
    body = bytearray()
    for chunk in response.iter_raw(_CHUNK):
        body += chunk
        if len(body) > policy.max_image_bytes:
            raise too_large
    return bytes(body)
