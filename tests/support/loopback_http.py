"""A quiet http.server handler base for the loopback image servers the tests run."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler


class QuietHandler(BaseHTTPRequestHandler):
    default_content_type = "image/png"

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, status: int, body: bytes = b"", ctype: str | None = None, extra=()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype or self.default_content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in extra:
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)
