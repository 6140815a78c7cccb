"""PrefixCache.lookup(least=n): a match shorter than n is not taken (nothing filled, 0 returned);
one at least that long fills the fresh cache as any hit does."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread


def test_a_match_shorter_than_least_is_not_taken():
    def work():
        import mlx.core as mx
        from mlx_vlm.models.cache import KVCache

        from vlmserve.engine.runner.prefix_cache import PrefixCache

        def filled(n):
            cache = KVCache()
            cache.update_and_fetch(mx.ones((1, 1, n, 4)), mx.ones((1, 1, n, 4)))
            return [cache]

        pc = PrefixCache(max_tokens=1000)
        stored = np.arange(40, dtype=np.int64)
        pc.store(stored, filled(40))
        query = np.concatenate([stored[:20], np.arange(100, 130)])  # shares 20 tokens
        short, fresh = pc.lookup(query, [KVCache()], least=21), [KVCache()]
        taken = pc.lookup(query, fresh, least=20)
        return short, taken, fresh[0].offset

    short, taken, offset = on_own_thread(work)
    assert short == 0
    assert taken == 20 and offset == 20
