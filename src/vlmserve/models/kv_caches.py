"""Which prompt caches the engine's shared paths take: mlx_vlm's plain KVCache, every position
kept and attended causally. Rotating, quantized and recurrent caches keep their model's own
paths (one request at a time, no paged pool, no prefix reuse, no pieces forward), but for the
sliding-window layers of a model that masks their window itself (`plain_for_windows`)."""

from __future__ import annotations

from typing import Any

from mlx_vlm.models.cache import KVCache, RotatingKVCache


def all_plain(caches: list[Any]) -> bool:
    """Whether every layer's cache is a plain KVCache (not a subclass: those change what is kept)."""
    return all(type(c) is KVCache for c in caches)


def plain_for_windows(language_model: Any) -> None:
    """Make `language_model.make_cache` give a plain KVCache for each sliding-window layer's
    RotatingKVCache (one that keeps no leading positions).

    Only for a model whose forward asks its caches for a mask of the window (`make_mask(...,
    window_size=W)`) and hands that mask to exactly those layers: each query then attends to
    the same keys as through the rotating buffer, which only drops keys the mask excludes. Every
    position is kept (memory as for a full-attention layer), and the engine's shared paths serve
    the model."""
    own = language_model.make_cache

    def make_cache() -> list[Any]:
        return [KVCache() if type(c) is RotatingKVCache and c.keep == 0 else c for c in own()]

    language_model.make_cache = make_cache
