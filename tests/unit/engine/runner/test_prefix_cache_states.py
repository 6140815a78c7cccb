"""PrefixCache(whole_keys=True), for models whose layers keep state beside their KV: an entry
carries the row's state at its end, a lookup takes only a whole cached key (the longest the
prompt starts with, leaving a token to run) and puts that state into the prompt's state layers,
and a state counts in the cache's size as the positions of KV its bytes would hold."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread


def test_only_whole_keys_are_taken_with_their_state():
    def work():
        import mlx.core as mx
        from mlx_vlm.models.cache import ArraysCache, KVCache

        from vlmserve.engine.runner.block_pool import BlockPool
        from vlmserve.engine.runner.prefix_cache import PrefixCache

        pool = BlockPool(1, (1, 4, 4), mx.float32, block_size=8, blocks=16)
        blocks = pool.allocate(5)
        kv = mx.arange(40 * 4, dtype=mx.float32).reshape(40, 1, 4)
        pool.write(blocks, [(kv, -kv)], 40)
        pc = PrefixCache(max_tokens=1000, whole_keys=True, state_position_bytes=32)
        ids = np.arange(40, dtype=np.int64)
        state_at = {n: [mx.full((1, 2, 4), float(n))] for n in (20, 40)}  # 32 bytes: one position
        pc.store(ids[:20], pool, blocks, state_at[20])
        pc.store(ids[:40], pool, blocks, state_at[40])
        pc.store(ids[:30], pool, blocks)  # no state: not kept

        def lookup(query):
            fresh = [KVCache(), ArraysCache(1)]
            hit = pc.lookup(query, fresh)
            return (hit.length, fresh[0].offset, fresh[1].cache[0][0, 0, 0].item()) if hit else None

        return (
            lookup(np.concatenate([ids, [99]])),  # starts with the 40 tokens: that entry
            lookup(np.concatenate([ids[:35], [99]])),  # inside the 40, past the 20: the 20
            lookup(ids[:20]),  # the 20 whole, but no token left to run: nothing
            lookup(np.concatenate([ids[:10], [99]])),  # part of a key only: nothing
            pc.size_tokens,
        )

    whole, shorter, no_token_left, part, size = on_own_thread(work)
    assert whole == (40, 40, 40.0)
    assert shorter == (20, 20, 20.0)
    assert no_token_left is None and part is None
    assert size == 20 + 1 + 40 + 1  # positions, and each state's 32 bytes as one position
