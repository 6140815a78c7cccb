"""PrefixCache: an entry whose key extends a cached one (a prompt, then that prompt with the answer
the request gave) replaces it, gives its budget blocks back, and serves its lookups."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread


def test_an_entry_that_extends_a_cached_key_replaces_it():
    def work():
        import mlx.core as mx
        from mlx_vlm.models.cache import KVCache

        from vlmserve.engine.runner.prefix_cache import PrefixCache
        from vlmserve.engine.sched.kv_budget import KVBudget

        def layers(n):
            values = mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1) * mx.ones((1, 1, 1, 4))
            return [(values, values + 1)]

        budget = KVBudget(100, 8)
        pc = PrefixCache(1000, budget, lambda tokens, dtype: budget.blocks_for(tokens))
        prompt = np.arange(20, dtype=np.int64)
        pc.store_layers(prompt, lambda: layers(20))
        used_by_prompt = budget.used
        other = np.arange(50, 60, dtype=np.int64)  # shares nothing: stays
        pc.store_layers(other, lambda: layers(10))
        whole = np.concatenate([prompt, np.arange(200, 212)])
        pc.store_layers(whole, lambda: layers(32))
        fresh = [KVCache()]
        hit = pc.lookup(np.concatenate([whole, [7, 8]]), fresh)
        return used_by_prompt, budget.used, pc.size_tokens, hit, np.array(fresh[0].keys[0, 0, :, 0])

    used_by_prompt, used, size, hit, keys = on_own_thread(work)
    assert used_by_prompt == 3
    assert size == 32 + 10 and used == 4 + 2  # the prompt's entry is gone, its blocks given back
    assert hit == 32 and keys.tolist() == list(range(32))  # the longer entry serves the lookup
