"""Which prompt caches the engine's shared paths take: mlx_vlm's plain KVCache, every position
kept and attended causally. Rotating and quantized caches keep their model's own paths (one
padded batch, no paged pool, no prefix reuse, no pieces forward), but for the sliding-window
layers of a model that masks their window itself (`plain_for_windows`). Recurrent and
convolution state (ArraysCache) beside plain KV layers takes the paged pool (the state kept
per row beside it) and the pieces forward (`pageable`), and prefix reuse of whole cached
prompts only (their entries keep the state at their end: engine/runner/prefix_cache.py)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_vlm.models.cache import ArraysCache, KVCache, RotatingKVCache


def all_plain(caches: list[Any]) -> bool:
    """Whether every layer's cache is a plain KVCache (not a subclass: those change what is kept)."""
    return all(type(c) is KVCache for c in caches)


def is_state(cache: Any) -> bool:
    """Whether a layer's cache is fixed-size state (mlx_vlm's ArraysCache: a convolution window,
    a recurrent state) rather than KV that grows with the context."""
    return type(cache) is ArraysCache


def kv_layers(caches: list[Any]) -> list[Any]:
    """The caches of the layers that keep KV (those the paged pool holds)."""
    return [c for c in caches if not is_state(c)]


def state_layers(caches: list[Any]) -> list[Any]:
    """The caches of the layers that keep fixed-size state."""
    return [c for c in caches if is_state(c)]


def put_states(caches: list[Any], arrays: list[mx.array | None]) -> None:
    """A row's state layers' caches take `arrays` (per state array in layer order, as
    `state_layers` lists them and their `state` gives them)."""
    rest = list(arrays)
    for cache in state_layers(caches):
        cache.cache, rest = rest[: len(cache.cache)], rest[len(cache.cache) :]
    if rest:
        raise ValueError(f"{len(rest)} state arrays left over: not this model's layout")


def states_side_by_side(rows: list[Any]) -> list[mx.array | None]:
    """One state layer's caches of several rows (a row each): per state array, the rows' states
    one after another (a row with none set yet: zeros, as mlx_vlm's layers start from; None
    where no row has one)."""
    out = []
    for parts in zip(*(row.cache for row in rows)):
        known = next((p for p in parts if p is not None), None)
        out.append(None if known is None else mx.concatenate([mx.zeros_like(known) if p is None else p for p in parts]))
    return out


def pageable(caches: list[Any]) -> bool:
    """Whether a model's decode step can run on the paged KV pool: plain KV layers (one at least),
    and any others fixed-size state, which a decode step takes per row beside the pool."""
    return any(type(c) is KVCache for c in caches) and all(type(c) is KVCache or is_state(c) for c in caches)


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
