"""The `data:` lines of one streamed chat completion.

Every decode step sends one chunk per running stream, all built on the event loop, which
shares the GIL with the MLX worker; most chunks differ only in their text. So the common
chunk (a content delta and nothing else) is pre-rendered once per request around a
placeholder, and each token JSON-encodes only its text. The bytes are those of `line()` on
the full chunk dict (a test compares them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from vlmserve.entrypoints.openai import chat_response
from vlmserve.entrypoints.openai.errors import error_body
from vlmserve.protocol import EngineError

log = logging.getLogger("vlmserve.request")

_PLACEHOLDER = "\x00vlmserve-content\x00"  # rendered as "\u0000vlmserve-content\u0000": no id or name has it


def line(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def ending_in_one_error(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's lines; an error raised once its headers are sent ends it with one error event
    (an engine error as itself, anything else as a logged 500), never with a cut connection."""
    try:
        async for item in lines:
            yield item
    except EngineError as exc:
        yield line(error_body(exc.status, exc.message, exc.code, exc.param))
    except Exception:  # noqa: BLE001 - the headers are gone: the error event is all a client can get
        log.exception("stream failed")
        yield line(error_body(500, "internal server error", "internal_error"))


class ChunkLines:
    def __init__(self, request_id: str, model: str, created: int, include_usage: bool):
        self.request_id, self.model, self.created = request_id, model, created
        self.extra = {"usage": None} if include_usage else {}
        self._around: dict[int, tuple[str, str] | None] = {}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = chat_response.chunk(self.request_id, self.model, self.created, choices, usage)
        return line(body if usage is not None else {**body, **self.extra})

    def choice(self, index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> str:
        return self.chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    def content(self, index: int, text: str) -> str:
        """Same as `choice(index, {"content": text})`."""
        around = self._around.get(index, False)
        if around is False:
            parts = self.choice(index, {"content": _PLACEHOLDER}).split(json.dumps(_PLACEHOLDER, ensure_ascii=False))
            around = self._around[index] = (parts[0], parts[1]) if len(parts) == 2 else None
        if around is None:
            return self.choice(index, {"content": text})
        return around[0] + json.dumps(text, ensure_ascii=False) + around[1]
