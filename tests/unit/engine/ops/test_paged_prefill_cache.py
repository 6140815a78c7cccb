"""A pieces forward's layer cache over the block pool (engine/ops/paged_prefill_cache.py): each
row's real positions land in its own blocks, padding in block 0, and every row reads back its
positions in order, under the same mask as a row's own cache."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import on_own_thread
from vlmserve.engine.ops.paged_prefill_cache import PagedPiecesCache, PiecesLayout

BS, HEADS, DIM = 4, 2, 8


class _Pool:
    """The part of a BlockPool the cache reads: per-layer key and value arrays, the block size."""

    def __init__(self, blocks: int, layers: int = 1):
        import mlx.core as mx

        self.block_size = BS
        self.keys = [mx.zeros((blocks * BS, HEADS, DIM)) for _ in range(layers)]
        self.values = [mx.zeros((blocks * BS, HEADS, DIM)) for _ in range(layers)]


def test_pieces_go_into_each_rows_blocks_and_read_back_in_order():
    """Two rows: one with 5 positions already in its blocks (scattered, out of order), one new;
    a piece of 3 and one of 6 (the first right-padded to 6)."""
    tables, starts, lengths = [[5, 2, 7], [3, 6]], [5, 0], [3, 6]

    def run():
        import mlx.core as mx

        pool = _Pool(8)
        old = mx.arange(5 * HEADS * DIM, dtype=mx.float32).reshape(5, HEADS, DIM) + 1000
        slots = mx.array([5 * BS + p for p in range(4)] + [2 * BS])
        pool.keys[0][slots] = old
        pool.values[0][slots] = -old
        layout = PiecesLayout(pool, tables, starts, lengths)
        cache = PagedPiecesCache(layout, 0)
        new = mx.arange(2 * HEADS * 6 * DIM, dtype=mx.float32).reshape(2, HEADS, 6, DIM)
        keys, values = cache.update_and_fetch(new, -new)
        mask = cache.make_mask(6)
        window = cache.make_mask(6, window_size=3)
        return (
            np.array(keys),
            np.array(values),
            np.array(mask),
            np.array(window),
            np.array(pool.keys[0]),
            np.array(old),
            np.array(new),
            np.array(cache.offset),
        )

    keys, values, mask, window, pool_keys, old, new, offset = on_own_thread(run)
    assert keys.shape == values.shape == (2, HEADS, 256, DIM)
    # Row 0: its 5 cached positions, then its 3 new ones; row 1: its 6 new ones.
    np.testing.assert_array_equal(keys[0, :, :5], old.transpose(1, 0, 2))
    np.testing.assert_array_equal(keys[0, :, 5:8], new[0, :, :3])
    np.testing.assert_array_equal(keys[1, :, :6], new[1])
    np.testing.assert_array_equal(values, -keys)
    # Where they landed: row 0's positions 5..7 in its second block (id 2), slots 1..3; row 1's in 3 and 6.
    np.testing.assert_array_equal(pool_keys[2 * BS + 1 : 2 * BS + 4], new[0, :, :3].transpose(1, 0, 2))
    np.testing.assert_array_equal(pool_keys[3 * BS : 4 * BS], new[1, :, :4].transpose(1, 0, 2))
    np.testing.assert_array_equal(pool_keys[6 * BS : 6 * BS + 2], new[1, :, 4:6].transpose(1, 0, 2))
    # Row 0's padding (its piece's positions 3..5) went to block 0 only; blocks nobody holds are untouched.
    assert (
        not pool_keys[BS : 2 * BS].any() and not pool_keys[4 * BS : 5 * BS].any() and not pool_keys[7 * BS + 1 :].any()
    )
    assert offset.tolist() == starts
    # Query i of a row sees its keys up to start + i; with a window, its last 3 of them.
    assert mask.shape == (2, 1, 6, 256)
    assert mask[0, 0, 0, :6].tolist() == [True] * 6 and not mask[0, 0, 0, 6:].any()
    assert mask[1, 0, 2, :3].all() and not mask[1, 0, 2, 3:].any()
    assert window[0, 0, 0].nonzero()[0].tolist() == [3, 4, 5]


def test_a_row_whose_blocks_do_not_hold_its_piece_is_refused():
    def build():
        return PiecesLayout(_Pool(4), [[1]], [2], [3])  # 4 positions held, 5 needed

    with pytest.raises(ValueError, match="blocks"):
        on_own_thread(build)
