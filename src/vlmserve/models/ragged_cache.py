"""One layer's KV for a forward that prefills the next piece of several prompts at once.

Each row keeps its own mlx_vlm KVCache (the request's prompt cache); the rows may already
hold different numbers of positions (earlier chunks, a prefix-cache hit) and take pieces of
different lengths. The forward's inputs are right-padded to the longest piece; this view writes
each row's real positions into that row's own cache and hands attention every row's keys
side by side, padded to one width, with a mask that keeps each query to its own row's past.
Padded query positions compute values nobody reads; nothing of them reaches a cache.

A layer of fixed-size state (a convolution window, a recurrent state) takes the rows' states
side by side with each row's piece length (`RaggedStateCache`): mlx_vlm's state layers then
keep each row's state at its own last real position, and mask the padding out of it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_vlm.models.cache import ArraysCache

from vlmserve.engine.ops.paged_prefill_cache import pieces_mask, pieces_width
from vlmserve.models import kv_caches


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


class RaggedStateCache(ArraysCache):
    """A state layer's cache over several rows' own (ArraysCache) for a pieces forward: their
    states side by side (a row with none yet starts from zeros, as mlx_vlm's layers do), and
    `lengths`, the real positions of each row's right-padded piece. Each row's own cache is left
    as it was until `write_back` hands it its new state, so a forward that fails changes none."""

    def __init__(self, rows: list[Any], lengths: list[int]):
        super().__init__(len(rows[0].cache))
        self.rows = rows
        self.cache = kv_caches.states_side_by_side(rows)
        self.lengths = mx.array(lengths, dtype=mx.int32)

    def write_back(self) -> None:
        for r, row in enumerate(self.rows):
            row.cache = [None if a is None else a[r : r + 1] for a in self.cache]

    def rollback(self) -> None:
        """Nothing to undo: the rows' own caches change at `write_back` only."""
