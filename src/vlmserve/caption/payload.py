"""Image -> OpenAI chat request body (base64 data URI for local files, URLs passed through)."""

from __future__ import annotations

import base64
import mimetypes

from vlmserve.caption.inputs import Item

# Sniff the bytes first: extensions lie (a .png that is really a JPEG is common in scraped data).
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
    (b"II*\x00", "image/tiff"),
    (b"MM\x00*", "image/tiff"),
)


def sniff_mime(data: bytes, name: str = "") -> str:
    for magic, mime in _MAGIC:
        if data.startswith(magic):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    guessed, _ = mimetypes.guess_type(name)
    return guessed if guessed and guessed.startswith("image/") else "application/octet-stream"


def data_uri(data: bytes, name: str = "") -> str:
    return f"data:{sniff_mime(data, name)};base64,{base64.b64encode(data).decode('ascii')}"


def read_image_url(item: Item) -> str:
    """The image_url.url for an item: URLs unchanged, local files read and inlined (call off the loop)."""
    if item.is_url:
        return item.source
    with open(item.source, "rb") as f:
        data = f.read()
    return data_uri(data, item.source)


def chat_body(
    model: str,
    image_url: str,
    prompt: str,
    max_tokens: int | None,
    temperature: float | None,
    detail: str | None = None,
    system: str | None = None,
    extra: dict | None = None,
) -> dict:
    image: dict = {"url": image_url}
    if detail:
        image["detail"] = detail
    messages = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append(
        {"role": "user", "content": [{"type": "image_url", "image_url": image}, {"type": "text", "text": prompt}]}
    )
    body: dict = {"model": model, "messages": messages}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    if extra:
        body.update(extra)
    return body
