"""The paged KV pool of one dtype: every layer's keys and values in fixed-size blocks.

Each layer holds one key and one value array of shape (blocks * block_size, kv_heads, dim);
a running row owns a list of block ids (its block table), so a decode step's shapes do not
depend on how long any row's context is (engine/ops/paged_layer_cache.py). Block 0 is never
handed out: empty rows of a step write there.

Blocks are reference-counted: a cached prefix (runner/prefix_cache.py) holds the blocks of the
row it came from, and a row that reuses it holds the same full blocks, so neither copies KV.
Blocks only cached prefixes hold are the pool's slack: when rows need blocks, `reclaim` evicts
cached prefixes before the pool grows.

The pool starts with room for every row at a moderate length and doubles when rows need more
blocks than it has (a copy, a few times over a server's life), up to the size of the
scheduler's KVBudget, which bounds how many blocks rows hold; where pools of two KV dtypes share
that budget (runner/decode_batch.py), the other one shrinks first (`trim`, `compact` while rows
run). Idle, the pool shrinks to the smallest size it has had that holds the blocks cached
prefixes hold (`compact`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from vlmserve.engine.runner import host_arrays

log = logging.getLogger(__name__)


def kv_block_bytes(model, block_size: int) -> int:
    """Bytes of one KV block: `block_size` positions of every layer's keys and values."""
    layers, (heads, dim_k, dim_v), dtype = model.kv_layout()
    return layers * block_size * heads * (dim_k + dim_v) * dtype.size


class BlockPool:
    def __init__(
        self,
        num_layers: int,
        kv_shape: tuple[int, int, int],
        dtype,
        block_size: int,
        blocks: int,
        most: Callable[[], int] = lambda: 1 << 40,
    ):
        self._most = most  # the budget's blocks (block 0 included), read at each growth: a budget may change
        self.num_layers = num_layers
        self.kv_shape = kv_shape
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = max(2, blocks)
        self.sizes = {self.num_blocks}  # every size it has had: the decode step's traced shapes
        heads, dim_k, dim_v = kv_shape
        rows = self.num_blocks * block_size
        self.keys = [mx.zeros((rows, heads, dim_k), dtype) for _ in range(num_layers)]
        self.values = [mx.zeros((rows, heads, dim_v), dtype) for _ in range(num_layers)]
        self.free = list(range(self.num_blocks - 1, 0, -1))  # popped from the end: low ids first
        self.refs = [0] * self.num_blocks  # holders of each block: rows and cached prefixes
        # Frees at least n blocks if it can (evicting cached prefixes): asked before the pool grows.
        self.reclaim: Callable[[BlockPool, int], None] = lambda pool, n: None
        # Makes the budget hold a pool of n blocks if it can (other pools shrink): asked before
        # this one grows past `most`.
        self.make_room: Callable[[BlockPool, int], None] = lambda pool, n: None
        # Blocks between two sizes where the budget caps a growth (few sizes: few decode shapes).
        self.size_step: Callable[[], int] = lambda: 1

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
        """n free block ids (held once), evicting cached prefixes and then growing the pool
        (doubling) when it has too few."""
        if n > len(self.free):
            self.reclaim(self, n)
        if n > len(self.free):
            self._grow(self.used + n + 1)
        blocks = [self.free.pop() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def cover(self, blocks: list[int], positions: int) -> list[int]:
        """A row's `blocks` and as many new ones (held once) as its first `positions` need beyond them."""
        return blocks + self.allocate(max(0, -(-positions // self.block_size) - len(blocks)))

    def retain(self, blocks: list[int]) -> None:
        """One more holder of each of these (held) blocks."""
        for b in blocks:
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """One holder fewer; blocks nobody holds any more are free again."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)

    def compact(self, size: int | None = None) -> dict[int, int]:
        """Shrink to `size` blocks, by default to the smallest size the pool has had (so the
        decode step meets shapes it has run), at least what holds the blocks still held,
        renumbered from 1: what an idle pool keeps for its cached prefixes. Returns old id -> new id."""
        held = [b for b in range(1, self.num_blocks) if self.refs[b]]
        if size is None:
            size = min(s for s in self.sizes if s >= len(held) + 1)
        size = min(self.num_blocks, max(size, len(held) + 1))
        self.sizes.add(size)
        if size == self.num_blocks and held == list(range(1, len(held) + 1)):
            return {b: b for b in held}
        bs = self.block_size
        where = mx.array((np.array([0, *held], np.int32)[:, None] * bs + np.arange(bs, dtype=np.int32)).reshape(-1))
        pad = (size - len(held) - 1) * bs

        def shrunk(a: mx.array) -> mx.array:
            a = a[where]
            return mx.concatenate([a, mx.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a

        self._replace_arrays(shrunk)
        self.refs = [0] + [self.refs[b] for b in held] + [0] * (size - len(held) - 1)
        self.free = list(range(size - 1, len(held), -1))
        self.num_blocks = size
        return {old: new for new, old in enumerate(held, start=1)}

    def trim(self) -> int:
        """Shrink to the smallest size the pool has had that keeps every held block where it is
        (the free blocks past the last held one go): room for another pool while rows run here,
        with no block renumbered. Returns the blocks given up."""
        last = max((b for b in range(1, self.num_blocks) if self.refs[b]), default=0)
        size = min(s for s in self.sizes if s > last)
        if size >= self.num_blocks:
            return 0
        keep = mx.arange(size * self.block_size)  # a gather, not a slice: the old buffers go
        self._replace_arrays(lambda a: a[keep])
        given = self.num_blocks - size
        self.free = [b for b in self.free if b < size]
        self.refs = self.refs[:size]
        self.num_blocks = size
        return given

    def _replace_arrays(self, shrink: Callable[[mx.array], mx.array]) -> None:
        """Every layer's keys and values made anew by `shrink`, evaluated before the pool takes
        them: a failure (out of memory) leaves the pool as it was."""
        keys, values = [shrink(k) for k in self.keys], [shrink(v) for v in self.values]
        mx.eval(keys, values)
        self.keys, self.values = keys, values

    @property
    def most(self) -> int:
        """The blocks the pool never grows past."""
        return max(2, self._most())

    def _grow(self, blocks: int) -> None:
        if blocks > self.most:
            self.make_room(self, blocks)
        size = self.num_blocks
        while size < blocks:
            size *= 2
        most = self.most
        if size > most:  # capped by the budget
            step = self.size_step()
            had = [s for s in self.sizes if blocks <= s <= most and s > self.num_blocks]
            if most // step * step >= blocks:  # the largest size it has had or step that fits (few sizes)
                size = max([most // step * step, *had])
            elif had:
                size = max(had)
            elif blocks <= most:
                size = most
            else:  # past its share (another pool could not give way): the least step that holds them
                size = blocks if blocks in self.sizes else -(-blocks // step) * step
        extra = (size - self.num_blocks) * self.block_size
        self.keys = [mx.concatenate([k, mx.zeros((extra, *k.shape[1:]), k.dtype)]) for k in self.keys]
        self.values = [mx.concatenate([v, mx.zeros((extra, *v.shape[1:]), v.dtype)]) for v in self.values]
        self.free = list(range(size - 1, self.num_blocks - 1, -1)) + self.free
        self.refs += [0] * (size - self.num_blocks)
        self.num_blocks = size
        self.sizes.add(size)
        gb = sum(a.nbytes for a in self.arrays()) / 1e9
        log.info("KV pool (%s) grew to %d blocks (%.2f GB)", str(self.dtype).removeprefix("mlx.core."), size, gb)

    # ---- moving one row's KV in and out -----------------------------------------------
    def slots(self, blocks: list[int], length: int) -> np.ndarray:
        """Pool indices of a row's first `length` positions, on the host."""
        ids = np.asarray(blocks, dtype=np.int32)[:, None] * self.block_size + np.arange(self.block_size, dtype=np.int32)
        return ids.reshape(-1)[:length]

    def positions(self, blocks: list[int], length: int) -> mx.array:
        """Pool indices of a row's first `length` positions."""
        return mx.array(self.slots(blocks, length))

    def write(self, blocks: list[int], layer_kv: list[tuple[mx.array, mx.array]], length: int, start: int = 0) -> None:
        """Put a row's KV of positions [start, length), (length - start, kv_heads, dim) per layer,
        at those positions of its blocks."""
        if length > start:
            self.write_at(self.positions(blocks, length)[start:], layer_kv)

    def write_at(self, where: mx.array, layer_kv: list[tuple[mx.array, mx.array]]) -> None:
        """Put keys and values (N, kv_heads, key / value dim) per layer at pool indices `where`
        (N,): one scatter a layer, whatever rows the positions belong to."""
        for i, (k, v) in enumerate(layer_kv):
            self.keys[i][where] = k.astype(self.dtype)
            self.values[i][where] = v.astype(self.dtype)

    def read(self, blocks: list[int], length: int, size: int | None = None) -> list[tuple[mx.array, mx.array]]:
        """A row's KV of its first `length` positions, (length, kv_heads, dim) per layer; with `size`,
        `size` rows, those past `length` holding copies of the first (room to write into)."""
        where = self.positions(blocks, length)
        if size is not None and size > length:
            where = mx.concatenate([where, mx.broadcast_to(where[:1], (size - length,))])
        return self.read_at(where)

    def read_at(self, where: mx.array) -> list[tuple[mx.array, mx.array]]:
        """Keys and values at pool indices `where` (N,), per layer (write_at's counterpart)."""
        return [(k[where], v[where]) for k, v in zip(self.keys, self.values)]

    def fill(self, cache: list, blocks: list[int], length: int, room: int) -> None:
        """Make a row's own (empty) mlx_vlm KVCache per layer hold its first `length` positions
        here, with room for `room` in the cache's own steps: its pieces then write in place,
        where a buffer of these positions alone grew (zeros and a concatenation per layer) at
        the first one. Lazy: evaluate the caches soon (they hold the pool's arrays of now)."""
        step = getattr(cache[0], "step", 1)
        for layer, (k, v) in zip(cache, self.read(blocks, length, -(-room // step) * step)):
            layer.keys, layer.values = k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]
            layer.offset = length

    def to_host(self, blocks: list[int], length: int) -> list:
        """A row's KV copied out to host memory (a preempted row's, until it resumes)."""
        return host_arrays.to_host([list(kv) for kv in self.read(blocks, length)])

    def from_host(self, blocks: list[int], layers: list, length: int) -> None:
        self.write(blocks, [tuple(host_arrays.from_host(kv)) for kv in layers], length)
