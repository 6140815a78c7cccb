"""The device block table (decode_batch.BlockTable) always equals the rows' block lists, though
it only uploads what changed: new blocks, a row in a new slot, a resumed row's new blocks."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread


class _Row:
    def __init__(self, blocks):
        self.blocks = blocks


def test_table_follows_every_change():
    from vlmserve.engine.runner.decode_batch import BlockTable

    def work():
        table, seen = BlockTable(), []
        a, b = _Row([3, 4]), _Row([7])
        rows = [a, b, None, None]

        def check(width=6):
            got = np.array(table.update(rows, width))
            assert got.shape == (len(rows), width)
            # Only rows' own blocks are compared: entries past a row's blocks are never read.
            for i, row in enumerate(rows):
                if row is not None:
                    seen.append(got[i, : len(row.blocks)].tolist() == row.blocks)

        check()
        a.blocks += [9]  # grown in place
        check()
        rows[2] = _Row([11, 12, 13])  # joined into a free slot
        check()
        b.blocks = []  # preempted, then resumed into the same slot with other blocks
        b.blocks = [20, 21]
        check()
        rows[0] = None  # left; another row takes its slot
        rows[0] = _Row([30])
        check()
        check(width=8)  # a new width: uploaded whole
        return seen

    assert all(on_own_thread(work))
