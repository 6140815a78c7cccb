"""The per-layer KV view a decode step hands the language model over the slot cache.

Lives with the kernels because they recognise it: the decode-attention kernel and the fused
decode steps take the slot cache's per-row lengths instead of a mask (runner/slot_cache.py
owns the buffers).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


class SlotLayerCache:
    """The per-layer cache object the language model sees during one decode step.

    Implements the part of the mlx_vlm cache protocol a one-token decode uses:
    `offset` (per-row RoPE offset), `make_mask` and `update_and_fetch`."""

    _offset = 0  # mlx_vlm's cache_position_offset reads this instead of syncing on `offset`

    def __init__(self, keys: mx.array, values: mx.array, lengths: mx.array, step: dict | None = None):
        self.keys = keys
        self.values = values
        self.offset = lengths  # (S,) tokens already in each slot
        self.step = {} if step is None else step  # shared by one step's layers: its mask kind, write index

    @property
    def plain_mask(self) -> bool:
        """The step's mask (made once, from one layer's cache) is `position < length`, no window."""
        return self.step.get("window", 0) == 0

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None, **_: Any):
        self.step["window"] = window_size or 0
        cap = self.keys.shape[2]
        pos = mx.arange(cap)[None, None, None, :]
        end = (self.offset + n)[:, None, None, None]
        mask = pos < end
        if window_size:
            mask = mask & (pos >= end - window_size)
        return mask

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] != 1:
            raise ValueError("SlotLayerCache takes one token per row (decode only)")
        self.keys = mx.put_along_axis(self.keys, self._index(keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, self._index(values.shape), values, axis=2)
        return self.keys, self.values

    def _index(self, shape: tuple[int, ...]) -> mx.array:
        """Each row's write position broadcast to `shape`: made once per step, not per layer."""
        key = ("index", shape)
        if key not in self.step:
            self.step[key] = mx.broadcast_to(self.offset[:, None, None, None], shape)
        return self.step[key]
