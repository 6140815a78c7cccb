"""One layer's KV for a forward that prefills the next piece of several prompts at once.

Each row keeps its own mlx_vlm KVCache (the request's prompt cache); the rows may already
hold different numbers of positions (earlier chunks, a prefix-cache hit) and take pieces of
different lengths. The forward's inputs are right-padded to the longest piece; this view writes
each row's real positions into that row's own cache and hands attention every row's keys
side by side, padded to one width, with a mask that keeps each query to its own row's past.
Padded query positions compute values nobody reads; nothing of them reaches a cache.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from vlmserve.engine.ops.paged_prefill_cache import pieces_mask, pieces_width


class RaggedLayerCache:
    """What a prompt forward's attention needs of a cache: `offset` (each row's RoPE start, an
    array), `make_mask` and `update_and_fetch`, over several rows' own caches."""

    def __init__(self, rows: list[Any], lengths: list[int]):
        self.rows = rows  # each row's KVCache, written in place
        self.lengths = lengths  # real positions of each row's piece
        self.starts = [int(c.offset) for c in rows]
        self.offset = mx.array(self.starts, dtype=mx.int32)
        self._offset = 0  # mlx_vlm's cache_position_offset reads this instead of syncing on `offset`
        self.width = pieces_width(self.starts, lengths)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None, **_: Any) -> mx.array:
        return pieces_mask(self.offset, n, self.width, window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys, values (rows, kv_heads, n, dim), right-padded: each row's real positions go into its
        cache; returns every row's keys and values, (rows, kv_heads, width, dim).

        Few operations a row, as each is a kernel launch: one split per layer, the cache's two
        writes, and a view of (or, if shorter, a pad to) its whole buffer, whose positions past
        the row's end the mask keeps out (zeros, or what a rolled-back forward wrote)."""
        rows = len(self.rows)
        row_keys = mx.split(keys, rows) if rows > 1 else [keys]
        row_values = mx.split(values, rows) if rows > 1 else [values]
        all_keys, all_values = [], []
        for cache, n, k, v in zip(self.rows, self.lengths, row_keys, row_values):
            if n < k.shape[2]:
                k, v = k[:, :, :n], v[:, :, :n]
            cache.update_and_fetch(k, v)
            all_keys.append(_to_width(cache.keys, self.width))
            all_values.append(_to_width(cache.values, self.width))
        return mx.concatenate(all_keys), mx.concatenate(all_values)

    def rollback(self) -> None:
        """Forget what a failed forward wrote: each row's cache ends where it started."""
        for cache, start in zip(self.rows, self.starts):
            if int(cache.offset) > start:
                cache.offset = start


def _to_width(x: mx.array, width: int) -> mx.array:
    """(1, heads, L, dim) -> (1, heads, width, dim): its first `width` positions, zeros past L."""
    if x.shape[2] >= width:
        return x[:, :, :width] if x.shape[2] > width else x
    return mx.pad(x, [(0, 0), (0, 0), (0, width - x.shape[2]), (0, 0)])
