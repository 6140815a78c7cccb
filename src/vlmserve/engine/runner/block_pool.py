"""The paged KV pool of one dtype: every layer's keys and values in fixed-size blocks.

Each layer holds one key and one value array of shape (blocks * block_size, kv_heads, dim);
a running row owns a list of block ids (its block table), so a decode step's shapes do not
depend on how long any row's context is (engine/ops/paged_layer_cache.py). Block 0 is never
handed out: empty rows of a step write there.

The pool starts with room for every row at a moderate length and doubles when rows need more
blocks than it has (a copy, a few times over a server's life); the scheduler's KVBudget
bounds how many blocks are in use, so the pool never outgrows the budget by more than that
doubling. Dropping the pool (idle) hands its memory back; the next request starts anew.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

_HOST_VIEW = {mx.bfloat16: mx.uint16}  # dtypes NumPy lacks travel to the host as same-size ints


class BlockPool:
    def __init__(
        self, num_layers: int, kv_shape: tuple[int, int, int], dtype, block_size: int, blocks: int, most: int = 1 << 40
    ):
        self.most = max(2, most)  # blocks the pool never grows past (the budget's, block 0 included)
        self.num_layers = num_layers
        self.kv_shape = kv_shape
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = max(2, blocks)
        heads, dim_k, dim_v = kv_shape
        rows = self.num_blocks * block_size
        self.keys = [mx.zeros((rows, heads, dim_k), dtype) for _ in range(num_layers)]
        self.values = [mx.zeros((rows, heads, dim_v), dtype) for _ in range(num_layers)]
        self.free = list(range(self.num_blocks - 1, 0, -1))  # popped from the end: low ids first

    @property
    def used(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values

    def set_arrays(self, arrays: list[mx.array]) -> None:
        """The pools a step returned (the step writes its tokens into new arrays)."""
        n = self.num_layers
        self.keys, self.values = list(arrays[:n]), list(arrays[n:])

    def allocate(self, n: int) -> list[int]:
        """n free block ids, growing the pool (doubling) when it has too few."""
        if n > len(self.free):
            self._grow(self.used + n + 1)
        return [self.free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))

    def _grow(self, blocks: int) -> None:
        size = self.num_blocks
        while size < blocks:
            size *= 2
        size = max(blocks, min(size, self.most))
        extra = (size - self.num_blocks) * self.block_size
        self.keys = [mx.concatenate([k, mx.zeros((extra, *k.shape[1:]), k.dtype)]) for k in self.keys]
        self.values = [mx.concatenate([v, mx.zeros((extra, *v.shape[1:]), v.dtype)]) for v in self.values]
        self.free = list(range(size - 1, self.num_blocks - 1, -1)) + self.free
        self.num_blocks = size
        gb = sum(a.nbytes for a in self.arrays()) / 1e9
        log.info("KV pool (%s) grew to %d blocks (%.2f GB)", str(self.dtype).removeprefix("mlx.core."), size, gb)

    # ---- moving one row's KV in and out -----------------------------------------------
    def positions(self, blocks: list[int], length: int) -> mx.array:
        """Pool indices of a row's first `length` positions."""
        ids = np.asarray(blocks, dtype=np.int32)[:, None] * self.block_size + np.arange(self.block_size, dtype=np.int32)
        return mx.array(ids.reshape(-1)[:length])

    def write(self, blocks: list[int], layer_kv: list[tuple[mx.array, mx.array]], length: int) -> None:
        """Put a row's KV, (length, kv_heads, dim) per layer, at its blocks' first positions."""
        if not length:
            return
        where = self.positions(blocks, length)
        for i, (k, v) in enumerate(layer_kv):
            self.keys[i][where] = k.astype(self.dtype)
            self.values[i][where] = v.astype(self.dtype)

    def read(self, blocks: list[int], length: int) -> list[tuple[mx.array, mx.array]]:
        where = self.positions(blocks, length)
        return [(k[where], v[where]) for k, v in zip(self.keys, self.values)]

    def to_host(self, blocks: list[int], length: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """A row's KV copied out to host memory (a preempted row's, until it resumes)."""
        view = _HOST_VIEW.get(self.dtype, self.dtype)
        layers = [(k.view(view), v.view(view)) for k, v in self.read(blocks, length)]
        mx.eval(layers)
        return [(np.array(k), np.array(v)) for k, v in layers]

    def from_host(self, blocks: list[int], layers: list[tuple[np.ndarray, np.ndarray]], length: int) -> None:
        view = _HOST_VIEW.get(self.dtype)
        back = [(mx.array(k), mx.array(v)) for k, v in layers]
        if view is not None:
            back = [(k.view(self.dtype), v.view(self.dtype)) for k, v in back]
        self.write(blocks, back, length)
