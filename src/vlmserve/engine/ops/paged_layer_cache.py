"""The per-layer KV view a decode step hands the language model over the paged KV pool.

Lives with the kernels because they recognise it: the decode-attention kernel and the fused
decode steps read the pool through the block table, with each row's length as data
(runner/block_pool.py owns the arrays, runner/decode_batch.py the table).

Every layer's keys live in one pool array of shape (blocks * block_size, kv_heads, dim);
row r's position p is at pool index table[r, p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


class PagedLayerCache:
    """The per-layer cache object the language model sees during one decode step.

    Implements the part of the mlx_vlm cache protocol a one-token decode uses: `offset` (per-row
    RoPE offset), `make_mask` and `update_and_fetch`. `update_and_fetch` writes the new token
    into the pool and returns the rows' keys and values gathered densely (rows, heads, width *
    block_size, dim): lazy, so a step whose attention reads the pool directly (the kernels)
    never computes the gather."""

    _offset = 0  # mlx_vlm's cache_position_offset reads this instead of syncing on `offset`

    def __init__(
        self,
        keys: mx.array,
        values: mx.array,
        lengths: mx.array,
        write: mx.array,
        table: mx.array,
        block_size: int,
        step: dict | None = None,
    ):
        self.keys = keys  # the pools: (blocks * block_size, kv_heads, dim)
        self.values = values
        self.offset = lengths  # (S,) tokens already in each row
        self.write = write  # (S,) the pool index each row's new token goes to
        self.table = table  # (S, W) block ids per row
        self.block_size = block_size
        self.step = {} if step is None else step  # shared by one step's layers: masks made, gather index

    @property
    def plain_mask(self) -> bool:
        """The step's masks (each made once, from one layer's cache) are `position < length`: no
        layer of this step attends through a sliding window."""
        return not any(window for _, window in self.step.get("masks", ()))

    @property
    def width(self) -> int:
        """Positions the dense gather spans per row."""
        return self.table.shape[1] * self.block_size

    def kernel_window(self, mask: Any) -> int | None:
        """The sliding window (0: none) through which an attention call given `mask` sees each
        row's last positions, for a kernel that reads the pool itself; None where that is not
        known: a mask this step did not make, in a step with windowed layers."""
        for made, window in self.step.get("masks", ()):
            if made is mask:
                return window
        return 0 if self.plain_mask else None

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None, **_: Any):
        # A model with sliding-window layers makes a full mask too, in either order, and hands
        # each layer one of them: each mask is kept with its window, so the attention of a layer
        # knows which it was given (kernel_window).
        pos = mx.arange(self.width)[None, None, None, :]
        end = (self.offset + n)[:, None, None, None]
        mask = pos < end
        if window_size:
            mask = mask & (pos >= end - window_size)
        self.step.setdefault("masks", []).append((mask, window_size or 0))
        return mask

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys, values (S, kv_heads, 1, dim): the step's new token per row."""
        if keys.shape[2] != 1:
            raise ValueError("PagedLayerCache takes one token per row (decode only)")
        self.write_token(keys[:, :, 0, :], values[:, :, 0, :])
        index = self._gather_index()
        return (
            self.keys[index].transpose(0, 2, 1, 3),
            self.values[index].transpose(0, 2, 1, 3),
        )

    def write_token(self, keys: mx.array, values: mx.array) -> None:
        """keys, values (S, kv_heads, dim): the step's new token per row, into the pools. A step
        whose attention reads the pools (the kernels) writes through this alone, with no view
        of the new token to make first: a decode step pays the host's time per primitive."""
        self.keys[self.write] = keys
        self.values[self.write] = values

    def used_kernel(self) -> None:
        """Counted by an attention that read the pool itself (DecodeSteps learns from it)."""
        self.step["kernel_layers"] = self.step.get("kernel_layers", 0) + 1

    def _gather_index(self) -> mx.array:
        """(S, W * block_size) pool indices of each row's positions: made once per step."""
        if "gather" not in self.step:
            offsets = mx.arange(self.block_size, dtype=mx.int32)
            index = self.table[:, :, None] * self.block_size + offsets
            self.step["gather"] = index.reshape(self.table.shape[0], -1)
        return self.step["gather"]
