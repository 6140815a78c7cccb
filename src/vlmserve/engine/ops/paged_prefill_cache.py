"""The per-layer KV view a prompt forward hands the language model when several rows' prompts
live in the paged KV pool while they prefill (engine/ops/paged_layer_cache.py is the decode
step's).

Each row's next piece is right-padded to the forward's longest; a layer writes every row's real
positions into the row's blocks with one scatter, and reads every row's positions back with
one gather, (rows, kv_heads, width, dim), under a mask that keeps each query to its own row's
past. Keeping each row in its own cache instead costs a few operations per row and layer
(a write, views, a pad to the common width, a concatenation): the forward is bound by the host's
time per operation, and at the join the rows' KV had to be copied into the pool too.

Padded query positions write to the pool's block 0, which no row holds.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

# Key widths are rounded up to this (mlx_vlm's KVCache grows its buffers in the same steps), so
# forwards of similar rows share kernel shapes.
WIDTH_STEP = 256


def pieces_width(starts: list[int], lengths: list[int]) -> int:
    """The key width of a forward of pieces starting at `starts` (each row's positions so far),
    `lengths` long: past the furthest end, rounded up to WIDTH_STEP."""
    if any(n < 1 for n in lengths):
        raise ValueError("every row takes at least one position")
    ends = max(s + n for s, n in zip(starts, lengths))
    return -(-ends // WIDTH_STEP) * WIDTH_STEP


def pieces_mask(offset: mx.array, n: int, width: int, window_size: int | None = None) -> mx.array:
    """(rows, 1, n, width) for right-padded pieces starting at `offset` (rows,): query i of row r
    sees keys up to offset[r] + i (and, with a sliding window, the `window_size` last of them)."""
    keys = mx.arange(width)[None, None, None, :]
    last = offset[:, None, None, None] + mx.arange(n)[None, None, :, None]
    mask = keys <= last
    if window_size:
        mask = mask & (keys > last - window_size)
    return mask


class PiecesLayout:
    """What every layer of one forward shares: each row's blocks, where its piece starts and
    how long it is, and the pool indices made of them (once, at the first layer)."""

    def __init__(self, pool: Any, tables: list[list[int]], starts: list[int], lengths: list[int]):
        self.width = pieces_width(starts, lengths)
        bs = pool.block_size
        if any(len(t) * bs < s + n for t, s, n in zip(tables, starts, lengths)):
            raise ValueError("a row's blocks do not hold its piece")
        self.pool = pool  # keys and values: lists of (blocks * block_size, kv_heads, dim) per layer
        self.starts, self.lengths = starts, lengths
        self.offset = mx.array(starts, dtype=mx.int32)
        # Each row's pool index of positions [0, width): its blocks, then block 0 (masked out).
        slots = np.zeros((len(tables), self.width), np.int32)
        for r, table in enumerate(tables):
            held = (np.asarray(table, np.int32)[:, None] * bs + np.arange(bs, dtype=np.int32)).reshape(-1)
            slots[r, : min(len(held), self.width)] = held[: self.width]
        self._slots = slots
        self.gather = mx.array(slots)
        self._writes: dict[int, mx.array] = {}

    def write_index(self, padded: int) -> mx.array:
        """(rows * padded,) pool indices a piece's positions go to, row-major; padding to 0."""
        index = self._writes.get(padded)
        if index is None:
            out = np.zeros((len(self.starts), padded), np.int32)
            for r, (s, n) in enumerate(zip(self.starts, self.lengths)):
                out[r, :n] = self._slots[r, s : s + n]
            index = self._writes[padded] = mx.array(out.reshape(-1))
        return index


class PagedPiecesCache:
    """What a prompt forward's attention needs of one layer's cache (`offset`, `make_mask`,
    `update_and_fetch`), over the rows' blocks in the pool."""

    _offset = 0  # mlx_vlm's cache_position_offset reads this instead of syncing on `offset`

    def __init__(self, layout: PiecesLayout, layer: int):
        self.layout = layout
        self.layer = layer
        self.offset = layout.offset  # each row's RoPE start

    @property
    def lengths(self) -> list[int]:
        return self.layout.lengths

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None, **_: Any) -> mx.array:
        return pieces_mask(self.offset, n, self.layout.width, window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys, values (rows, kv_heads, n, dim), right-padded: into the rows' blocks; returns
        every row's keys and values, (rows, kv_heads, width, dim) (positions past a row's end
        hold what its blocks or block 0 hold: the mask keeps them out)."""
        pool, layout = self.layout.pool, self.layout
        rows, heads, n, _ = keys.shape
        where = layout.write_index(n)
        pool_keys, pool_values = pool.keys[self.layer], pool.values[self.layer]
        pool_keys[where] = keys.transpose(0, 2, 1, 3).reshape(rows * n, heads, -1).astype(pool_keys.dtype)
        pool_values[where] = values.transpose(0, 2, 1, 3).reshape(rows * n, heads, -1).astype(pool_values.dtype)
        return (
            pool_keys[layout.gather].transpose(0, 2, 1, 3),
            pool_values[layout.gather].transpose(0, 2, 1, 3),
        )

    def rollback(self) -> None:
        """Nothing to undo: a failed forward wrote only past each row's prefilled positions (in
        its own blocks, which it keeps or gives back) and into block 0."""
