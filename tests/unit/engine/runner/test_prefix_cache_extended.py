"""PrefixCache: an entry whose key extends a cached one (a prompt, then that prompt with the answer
the request gave) replaces it, lets its blocks go, and serves its lookups; entries give way (oldest
first) to rows that need blocks, but only those whose eviction frees some."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread

KV_STEP = 256  # mlx_vlm's KVCache grows its buffers in these steps


def _pool_with_rows(mx, lengths):
    from vlmserve.engine.runner.block_pool import BlockPool

    pool = BlockPool(1, (1, 1, 1), mx.float32, block_size=8, blocks=16)
    rows = []
    for n in lengths:
        blocks = pool.allocate(-(-n // 8))
        values = mx.arange(n, dtype=mx.float32).reshape(n, 1, 1)
        pool.write(blocks, [(values, values + 1)], n)
        rows.append(blocks)
    return pool, rows


def test_an_entry_that_extends_a_cached_key_replaces_it():
    def work():
        import mlx.core as mx
        from mlx_vlm.models.cache import KVCache

        from vlmserve.engine.runner.prefix_cache import PrefixCache

        pool, (row, other_row) = _pool_with_rows(mx, [32, 10])
        pc = PrefixCache(1000)
        prompt = np.arange(20, dtype=np.int64)
        pc.store(prompt, pool, row)  # the prompt's entry: 3 of the row's 4 blocks
        other = np.arange(50, 60, dtype=np.int64)  # shares nothing: stays
        pc.store(other, pool, other_row)
        whole = np.concatenate([prompt, np.arange(200, 212)])
        pc.store(whole, pool, row)
        pool.release(row)  # the row ends: the entry holds its blocks alone
        pool.release(other_row)
        fresh = [KVCache()]
        hit = pc.lookup(np.concatenate([whole, [7, 8]]), fresh)
        room = fresh[0].keys.shape[2]  # the whole prompt fits: its pieces write in place
        fresh[0].update_and_fetch(mx.zeros((1, 1, 2, 1)), mx.zeros((1, 1, 2, 1)))
        keys = np.array(fresh[0].state[0][0, 0, :, 0])
        return pc.size_tokens, pc.blocks_held(), pool.used, hit.length, keys, room, fresh[0].keys.shape[2]

    size, held, used, hit, keys, room, after = on_own_thread(work)
    assert room == after == KV_STEP
    assert size == 32 + 10 and held == 4 + 2 and used == 6  # the prompt's entry is gone, no block twice
    assert hit == 32 and keys.tolist() == list(range(32)) + [0, 0]  # the longer entry serves the lookup


def test_rows_needing_blocks_evict_only_entries_that_free_some():
    def work():
        import mlx.core as mx

        from vlmserve.engine.runner.prefix_cache import PrefixCache

        pool, (running, done_a, done_b) = _pool_with_rows(mx, [16, 16, 16])  # 6 of 15 blocks
        pc = PrefixCache(1000)
        pool.reclaim = pc.reclaim
        pc.store(np.arange(16), pool, running)  # oldest, but its row still holds its blocks
        pc.store(np.arange(100, 116), pool, done_a)
        pc.store(np.arange(200, 216), pool, done_b)
        pool.release(done_a)
        pool.release(done_b)
        before = pool.num_blocks
        new = pool.allocate(11)  # 9 free: done_a's entry (the oldest that frees blocks) goes
        return before, pool.num_blocks, sorted(new), done_a, pc.size_tokens

    before, after, new, done_a, size = on_own_thread(work)
    assert before == after == 16  # no growth: evicting made room
    assert set(done_a) <= set(new) and size == 32  # the running row's entry and done_b's stay


def test_a_key_a_cached_one_extends_is_not_added_and_eviction_passes_until_none_frees_blocks():
    def work():
        import mlx.core as mx

        from vlmserve.engine.runner.prefix_cache import PrefixCache

        pool, (row,) = _pool_with_rows(mx, [24])  # 3 blocks of 8
        pc = PrefixCache(1000)
        whole = np.arange(24)
        pc.store(whole, pool, row)
        pc.store(whole[:16], pool, row)  # the entry above serves it: nothing added, nothing held
        added = pc.size_tokens, [pool.refs[b] for b in row]
        pool.release(row)
        # An older entry whose only block a newer one holds too: evicting the newer one makes it
        # the last holder, and a second pass takes it.
        older = pool.allocate(1)
        newer = older + pool.allocate(1)
        pc.store(np.arange(100, 108), pool, older)
        pc.store(np.arange(200, 216), pool, newer)
        pool.release(newer)
        pool.release(older)
        pool.reclaim = pc.reclaim
        free_before, size_before = len(pool.free), pool.num_blocks
        pool.allocate(free_before + 5)  # every cached block is needed: all go, no growth
        return added, pc.size_tokens, size_before, pool.num_blocks

    added, left, size_before, size_after = on_own_thread(work)
    assert added == (24, [2, 2, 2])
    assert left == 0 and size_before == size_after == 16
