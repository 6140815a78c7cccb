"""PrefixCache(whole_keys=True), for models whose layers keep state beside their KV: an entry
carries the row's state at its end, a lookup takes only a whole cached key (the longest the
prompt starts with, leaving a token to run) and puts that state into the prompt's state layers,
and a state counts in the cache's size as the positions of KV its bytes would hold."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread, pool_holding_positions


def test_only_whole_keys_are_taken_with_their_state():
    def work():
        import mlx.core as mx
        from mlx_vlm.models.cache import ArraysCache, KVCache

        from vlmserve.engine.runner.prefix_cache import PrefixCache

        pool, blocks, _ = pool_holding_positions(40, blocks=16)
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


def test_a_rows_state_copy_once_evaluated_holds_that_row_only():
    """PagedDecodeBatch.state_of's copy, evaluated as the runner does with one it keeps: left
    lazy, its gather would keep every slot's state of that moment (the whole arrays, which the
    next step replaces) alive until it is read, and a cached entry may never be read."""

    def work():
        import gc

        import mlx.core as mx

        from vlmserve.engine.runner.decode_batch import PagedDecodeBatch
        from vlmserve.engine.runner.row_states import RowStates

        gc.collect()
        mx.synchronize()
        before = mx.get_active_memory()  # what earlier tests left
        states = RowStates([None, [((64, 64, 64), mx.float32)]])  # 1 MiB a row
        states.arrays = states.zeros(16)
        mx.eval(states.arrays)
        batch = PagedDecodeBatch(None, None, None, 0, states)
        row = object()
        batch.rows = [None] * 16
        batch.rows[3] = row
        states.put([3], [mx.full((1, 64, 64, 64), 3.0)])
        copy = batch.state_of(row)
        mx.async_eval(copy)
        states.arrays = states.zeros(16)  # the next step's arrays take their place
        mx.eval(states.arrays)
        mx.synchronize()
        held = mx.get_active_memory() - before - states.arrays[0].nbytes  # the copy's, and what it keeps
        return held, copy[0].shape, copy[0].min().item(), copy[0].max().item()

    held, shape, low, high = on_own_thread(work)
    assert shape == (1, 64, 64, 64) and low == high == 3.0
    assert held < 4 << 20, f"{held / 2**20:.1f} MiB held for a 1 MiB row"


def test_states_take_at_most_their_share_of_the_cache_the_oldest_going_first():
    def work():
        import mlx.core as mx

        from vlmserve.engine.runner.block_pool import BlockPool
        from vlmserve.engine.runner.prefix_cache import STATE_SHARE, PrefixCache

        pool = BlockPool(1, (1, 4, 4), mx.float32, block_size=8, blocks=16)
        blocks = pool.allocate(2)
        pc = PrefixCache(max_tokens=64, whole_keys=True, state_position_bytes=32)  # states: 512 bytes
        assert pc.states.limit == int(STATE_SHARE * 64 * 32)
        for first in range(4):  # 192 bytes each: two fit
            pc.store(np.arange(first, first + 10), pool, blocks, [mx.zeros((48,), mx.float32)])
        return pc.state_bytes, [k[0] for k in pc._entries], pc.size_tokens

    state_bytes, kept, size = on_own_thread(work)
    assert state_bytes == 2 * 192 and kept == [2, 3]  # the two latest
    assert size == 2 * (10 + 6)


def test_the_caches_states_share_one_limit_and_a_refused_entry_leaves_nothing_held():
    """The text and image caches take their states from one StateBudget (what the KV budget set
    aside): past it a cache gives up its own oldest states, and the new entry itself where the
    other cache holds the rest, its blocks then held by no entry."""

    def work():
        import mlx.core as mx

        from vlmserve.engine.runner.block_pool import BlockPool
        from vlmserve.engine.runner.prefix_cache import PrefixCache, StateBudget

        pool = BlockPool(1, (1, 4, 4), mx.float32, block_size=8, blocks=16)
        blocks = pool.allocate(2)
        shared = StateBudget(limit=400)
        text, image = (PrefixCache(1000, True, 32, shared) for _ in range(2))
        state = [mx.zeros((48,), mx.float32)]  # 192 bytes
        kept = [text.store(np.arange(10), pool, blocks, state), text.store(np.arange(1, 11), pool, blocks, state)]
        again = text.store(np.arange(10), pool, blocks, state)  # cached already: not added
        kept.append(image.store(np.arange(5, 15), pool, blocks, state))  # over the limit: its own goes
        return kept, again, shared.used, text.state_bytes, image.state_bytes, image.blocks_held(), pool.refs[blocks[0]]

    kept, again, used, text_bytes, image_bytes, image_blocks, refs = on_own_thread(work)
    assert kept == [True, True, False] and again is False
    assert used == text_bytes == 2 * 192 and image_bytes == 0 and image_blocks == 0
    assert refs == 3  # the row's and the text cache's two entries'
