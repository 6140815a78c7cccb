"""Which prompt caches the engine's shared paths take: mlx_vlm's plain KVCache, every position
kept and attended causally. Sliding-window, rotating, quantized and recurrent caches keep their
model's own paths (one request at a time, no paged pool, no prefix reuse, no pieces forward)."""

from __future__ import annotations

from typing import Any

from mlx_vlm.models.cache import KVCache


def all_plain(caches: list[Any]) -> bool:
    """Whether every layer's cache is a plain KVCache (not a subclass: those change what is kept)."""
    return all(type(c) is KVCache for c in caches)
