"""Vision features by image content: an image discussed again (the next turn of a chat, another
question about it) skips the vision tower.

Keyed by the image's content hash (PreparedRequest.image_hashes: the pixels as the processor got
them, after any per-request resize); one server serves one model with one processor setting, so
the hash is the whole key. Qwen-VL keeps its tower's output per image; other families the image
rows of a prompt's embedding per set of images (image_rows.py).
An LRU within a byte budget. Runs on the MLX worker only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import mlx.core as mx


def _nbytes(value: Any) -> int:
    if isinstance(value, mx.array):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class FeatureCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, Any] = OrderedDict()
        self.bytes = 0
        self.queries = 0
        self.hits = 0

    def lookup(self, keys: tuple[str, ...], fits: Callable[[list[Any]], bool] | None = None) -> list[Any] | None:
        """Every image's features, or None unless all of them are cached and `fits` them (one
        query, one hit)."""
        self.queries += 1
        if not keys or any(k not in self._entries for k in keys):
            return None
        if fits is not None and not fits([self._entries[k] for k in keys]):
            return None
        self.hits += 1
        for k in keys:
            self._entries.move_to_end(k)
        return [self._entries[k] for k in keys]

    def shared(self) -> None:
        """A lookup that missed was served by the features computed, at the same time, for another
        request with the same images: it skipped the vision tower, as a hit does."""
        self.hits += 1

    def store(self, key: str, features: Any) -> None:
        """An array, or a nested tuple/list of arrays (None allowed)."""
        size = _nbytes(features)
        if key in self._entries or size > self.max_bytes:
            return
        self._entries[key] = features
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= _nbytes(old)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
