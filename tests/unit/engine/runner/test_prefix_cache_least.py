"""PrefixCache.lookup(least=n): a match shorter than n is not taken (nothing filled, None
returned); one at least that long fills the fresh cache with the pool's KV of those positions."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread, pool_holding_positions


def test_a_match_shorter_than_least_is_not_taken():
    def work():
        import mlx.core as mx
        from mlx_vlm.models.cache import KVCache

        from vlmserve.engine.runner.prefix_cache import PrefixCache

        pool, blocks, kv = pool_holding_positions(40, blocks=8)
        pc = PrefixCache(max_tokens=1000)
        stored = np.arange(40, dtype=np.int64)
        pc.store(stored, pool, blocks)
        query = np.concatenate([stored[:20], np.arange(100, 130)])  # shares 20 tokens
        short, fresh = pc.lookup(query, [KVCache()], least=21), [KVCache()]
        taken = pc.lookup(query, fresh, least=20)
        same = mx.array_equal(fresh[0].state[0][0].transpose(1, 0, 2), kv[:20]).item()
        return (
            short,
            taken.length,
            fresh[0].offset,
            same,
            taken.shared.blocks,
            pool.refs[blocks[0]],
            pool.refs[blocks[2]],
        )

    short, length, offset, same, shared, refs_full, refs_partial = on_own_thread(work)
    assert short is None
    assert length == 20 and offset == 20 and same
    # The hit holds the two full blocks among its 20 positions for the row (row + entry + hit).
    assert len(shared) == 2 and refs_full == 3 and refs_partial == 2
