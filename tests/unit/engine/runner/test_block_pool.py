"""The paged KV pool (engine/runner/block_pool.py): block ids, growth, and a row's KV in and
out unchanged (to the host and back, bfloat16 included)."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import on_own_thread
from vlmserve.engine.runner.block_pool import BlockPool


def test_blocks_are_handed_out_grown_and_returned():
    import mlx.core as mx

    from vlmserve.engine.runner.block_pool import BlockPool

    def work():
        pool = BlockPool(2, (2, 4, 4), mx.float32, block_size=8, blocks=4)
        first = pool.allocate(3)
        assert sorted(first) == [1, 2, 3] and pool.used == 3  # block 0 is never handed out
        kv = [(mx.random.normal((20, 2, 4), key=mx.random.key(i)), mx.full((20, 2, 4), float(i))) for i in range(2)]
        pool.write(first, kv, 20)
        more = pool.allocate(2)  # 4 blocks cannot hold 6: the pool doubles, keeping what it holds
        assert pool.num_blocks == 8 and pool.keys[0].shape == (64, 2, 4) and set(more) & set(first) == set()
        for (k, v), (rk, rv) in zip(kv, pool.read(first, 20)):
            assert mx.array_equal(k, rk).item() and mx.array_equal(v, rv).item()
        for (k, _), (rk, _) in zip(kv, pool.read(first, 20, size=32)):  # room past the row: copies of its first
            assert rk.shape == (32, 2, 4) and mx.array_equal(rk[:20], k).item()
            assert mx.array_equal(rk[20:], mx.broadcast_to(k[:1], (12, 2, 4))).item()
        pool.release(first)
        assert pool.used == 2
        again = pool.allocate(3)
        assert sorted(again) == sorted(first)  # released blocks are used again before new ones

    on_own_thread(work)


def test_the_pool_grows_no_further_than_the_budget_says_now():
    """The budget may change while the pool lives (compile_rehearsal lends part of it for a
    while): each growth reads the limit as it is then."""
    import mlx.core as mx

    from vlmserve.engine.runner.block_pool import BlockPool

    def work():
        limit = [6]
        pool = BlockPool(1, (1, 2, 2), mx.float32, block_size=2, blocks=4, most=lambda: limit[0])
        pool.allocate(4)  # doubling would make 8: the limit holds it at 6
        assert pool.num_blocks == 6 and pool.most == 6
        limit[0] = 64  # given back
        pool.allocate(3)
        assert pool.num_blocks == 12 and pool.most == 64  # past 6: doubling again, as the budget now allows

    on_own_thread(work)


def test_a_rows_kv_goes_to_the_host_and_back_bit_for_bit():
    import mlx.core as mx

    from vlmserve.engine.runner.block_pool import BlockPool

    def work():
        results = []
        for dtype in (mx.bfloat16, mx.float16, mx.float32):
            pool = BlockPool(3, (2, 8, 8), dtype, block_size=4, blocks=8)
            blocks = pool.allocate(3)
            kv = [
                (mx.random.normal((10, 2, 8), key=mx.random.key(i)).astype(dtype), mx.full((10, 2, 8), i, dtype))
                for i in range(3)
            ]
            pool.write(blocks, kv, 10)
            host = pool.to_host(blocks, 10)
            assert all(isinstance(copy[0], np.ndarray) for layer in host for copy in layer)  # in host memory
            pool.release(blocks)
            other = pool.allocate(1) + pool.allocate(2)  # somewhere else in the pool
            pool.from_host(other, host, 10)
            back = pool.read(other, 10)
            results.append(
                all(mx.array_equal(a, b).item() for (k, v), (rk, rv) in zip(kv, back) for a, b in ((k, rk), (v, rv)))
            )
        return results

    assert on_own_thread(work) == [True, True, True]


class _PrefillLayer:
    """A batched prefill's per-layer cache: (rows, heads, positions, dim), left-padded; row r holds r + 1."""

    def __init__(self, rows):
        import mlx.core as mx

        self.keys = mx.stack([mx.full((1, 6, 4), float(r + 1)) for r in range(rows)])
        self.values = -self.keys
        self._idx = 6


class _Row:
    def __init__(self, n):
        self.cache_len, self.blocks = n, []


@pytest.mark.parametrize("rows", [[0, 2], [2, 0]])
def test_a_batch_joins_each_owner_with_its_own_row_of_the_prefill(rows):
    """Rows of a batched prefill join by their place in its cache, also when some of them did not
    join (the budget could not pay for them) and in another order: nobody gets a neighbour's KV."""
    import mlx.core as mx

    from vlmserve.engine.runner.decode_batch import PagedDecodeBatch

    def work():
        pool = BlockPool(2, (1, 4, 4), mx.float32, block_size=4, blocks=16)
        batch = PagedDecodeBatch(None, None, pool, context_length=64)
        owners = [_Row(5), _Row(3)]
        batch.join(owners, [_PrefillLayer(3), _PrefillLayer(3)], rows=rows)  # row 1 of the prefill did not join
        return [[float(k[0, 0, 0].item()) for k, _ in pool.read(o.blocks, o.cache_len)] for o in owners], [
            o.cache_len for o in owners
        ]

    values, lengths = on_own_thread(work)
    expected = {0: 1.0, 2: 3.0}  # row r of the prefill holds r + 1
    assert values == [[expected[r]] * 2 for r in rows] and lengths == [5, 3]


@pytest.mark.parametrize("failing", ["allocate", "write_at"])
def test_a_join_that_fails_leaves_no_row_and_no_block_behind(failing):
    """The caller fails every row of a join that raised: none may stay in the batch (it would
    decode forever) or hold blocks; whether the second row's blocks or the copy of all rows'
    KV fails."""
    import mlx.core as mx

    from vlmserve.engine.runner.decode_batch import DtypeGroupedBatch, PagedDecodeBatch

    def work():
        pool = BlockPool(2, (1, 4, 4), mx.float32, block_size=4, blocks=16)
        batch = DtypeGroupedBatch(lambda dtype: PagedDecodeBatch(None, None, pool, context_length=64), mx.float32)
        calls = []
        original = getattr(pool, failing)

        def fails(*args, **kwargs):
            calls.append(1)
            if len(calls) == (2 if failing == "allocate" else 1):
                raise RuntimeError("out of memory")
            return original(*args, **kwargs)

        setattr(pool, failing, fails)
        owners = [_Row(5), _Row(3), _Row(4)]
        with pytest.raises(RuntimeError):
            batch.join(owners, [_PrefillLayer(3), _PrefillLayer(3)])
        return batch.layout(), batch.groups, pool.used, [o.blocks for o in owners]

    layout, groups, used, blocks = on_own_thread(work)
    assert layout == [] and groups == {} and used == 0 and blocks == [[], [], []]


def test_shared_blocks_free_with_their_last_holder_and_an_idle_pool_keeps_only_held_ones():
    import mlx.core as mx

    def work():
        pool = BlockPool(1, (1, 1, 1), mx.float32, block_size=2, blocks=4)
        row = pool.allocate(3)
        pool.write(row, [(mx.arange(6, dtype=mx.float32).reshape(6, 1, 1), mx.zeros((6, 1, 1)))], 6)
        pool.retain(row[:2])  # a cached prefix holds the first two blocks too
        pool.release(row)  # the row ends
        after_release = pool.used
        more = pool.allocate(6)  # grows: 4 -> 8 -> 16 blocks
        pool.release(more)
        grown = pool.num_blocks
        mapping = pool.compact()  # idle: back to the first size, the held blocks renumbered from 1
        kept = pool.read([mapping[b] for b in row[:2]], 4)[0][0]
        return after_release, grown, pool.num_blocks, sorted(mapping.values()), kept.reshape(-1).tolist(), pool.used

    after_release, grown, compacted, ids, kept, used = on_own_thread(work)
    assert after_release == 2 and grown == 16
    assert compacted == 4 and ids == [1, 2] and used == 2
    assert kept == [0.0, 1.0, 2.0, 3.0]


def test_a_row_reusing_a_cached_prefix_shares_its_full_blocks_and_writes_the_rest():
    """The join takes a prefix hit's full blocks as the row's first ones (held twice, written
    once) and writes only the positions after them; the row reads back its whole prompt."""
    import mlx.core as mx

    from vlmserve.engine.runner.decode_batch import PagedDecodeBatch
    from vlmserve.engine.runner.prefix_cache import PrefixCache

    def work():
        pool = BlockPool(1, (1, 4, 4), mx.float32, block_size=2, blocks=16)
        first = pool.allocate(3)  # a finished row's 6 positions
        kv = mx.arange(6 * 4, dtype=mx.float32).reshape(6, 1, 4)
        pool.write(first, [(kv, -kv)], 6)
        cache = PrefixCache(1000)
        cache.store(np.arange(6), pool, first)
        pool.release(first)  # the row ends; the entry holds its blocks
        row = _Row(6)
        from mlx_vlm.models.cache import KVCache

        fresh = [KVCache()]
        # 5 positions match (the sixth differs): 2 full blocks shared, positions 4 and 5 written
        row.prefix_hit = cache.lookup(np.array([0, 1, 2, 3, 4, 99, 98]), fresh)
        writes = []
        original = pool.write_at

        def counting(where, layer_kv):
            writes.append(np.array(where).tolist())
            return original(where, layer_kv)

        pool.write_at = counting
        prefill = _PrefillLayer(1)
        prefill.keys = mx.concatenate([mx.zeros((1, 1, 0, 4)), kv.transpose(1, 0, 2)[None]], axis=2)
        prefill.values, prefill._idx = -prefill.keys, 6
        PagedDecodeBatch(None, None, pool, context_length=64).join([row], [prefill])
        back = pool.read(row.blocks, 6)[0][0]
        written = pool.slots(row.blocks, 6)[4:].tolist()  # positions 4 and 5: the third block
        return (
            row.blocks[:2] == first[:2],
            [pool.refs[b] for b in row.blocks],
            writes,
            written,
            mx.array_equal(back, kv).item(),
        )

    shared, refs, writes, written, same = on_own_thread(work)
    assert shared and refs[:2] == [2, 2] and refs[2:] == [1] * (len(refs) - 2)
    assert writes == [written]
    assert same


def test_the_batches_remember_each_kv_dtype_a_pool_was_made_for_and_size_its_warm_shapes():
    """A pool of another KV dtype (float32 rows of a bfloat16 model) is remembered after its pool
    is released, so warm-up can queue its decode shapes; their widths follow that dtype."""
    from types import SimpleNamespace

    import mlx.core as mx

    from vlmserve.engine.runner.decode_batch import DecodeBatches

    def work():
        model = SimpleNamespace(
            language_model=SimpleNamespace(layers=[None, None]),
            kv_layout=lambda: (2, (1, 4, 4), mx.bfloat16),
            decode=lambda tokens, caches, positions: None,
        )
        batches = DecodeBatches(model, True, block_size=4, context_length=1024, initial_blocks=8)
        seen = [batches.other_kv_dtypes()]
        batches.pool(mx.bfloat16)
        batches.pool(mx.float32)
        batches.release()  # idle: both pools go, nothing holds their blocks
        seen.append((list(batches.pools), batches.other_kv_dtypes()))
        batches.step.reads_pool[mx.float32] = True  # its steps read the whole pool: one width
        wide = batches.shapes_to_warm(2, 512, mx.float32)
        narrow = batches.shapes_to_warm(2, 512)
        return seen, wide, narrow

    seen, wide, narrow = on_own_thread(work)
    assert seen == [[], ([], [mx.float32])]
    assert wide == [(1, 256), (2, 256)]  # its rows read the whole context: 1,024 positions, 256 blocks
    assert narrow == [(1, 64), (1, 128), (2, 64), (2, 128)]  # the model dtype's gather up to 512 positions


def test_trim_gives_up_the_free_tail_and_compact_renumbers_to_a_size():
    """`trim` keeps every held block where it is; `compact(size)` moves the held ones to the
    front of a pool of `size` blocks (at least what they need), their KV with them."""
    import mlx.core as mx

    def work():
        pool = BlockPool(1, (1, 2, 2), mx.float32, block_size=2, blocks=4)
        pool.allocate(7)  # grows to 8: blocks 1-7
        pool.release([3, 4, 5, 6])
        kv = [(mx.arange(12, dtype=mx.float32).reshape(6, 1, 2), mx.ones((6, 1, 2)))]
        pool.write([1, 2, 7], kv, 6)
        untouched = pool.trim()  # block 7 is held: the tail cannot go
        pool.release([7])
        trimmed = pool.trim()  # now the smallest size it has had that keeps blocks 1-2: 4
        after_trim = (untouched, trimmed, pool.num_blocks, pool.keys[0].shape[0], sorted(pool.free))
        kept = mx.array_equal(pool.read([1, 2], 4)[0][0], kv[0][0][:4]).item()
        more = pool.allocate(4)  # grows to 8 again
        pool.write(more, kv, 6)
        pool.release([1, 2])
        mapping = pool.compact(3)  # the 4 held blocks need 5
        moved = mx.array_equal(pool.read([mapping[b] for b in more], 6)[0][0], kv[0][0]).item()
        return after_trim, kept, sorted(mapping.values()), pool.num_blocks, moved

    after_trim, kept, new_ids, blocks, moved = on_own_thread(work)
    assert after_trim == (0, 4, 4, 8, [3]) and kept
    assert new_ids == [1, 2, 3, 4] and blocks == 5 and moved


@pytest.mark.parametrize("foreign", [False, True])
def test_pools_of_two_kv_dtypes_share_one_budget(foreign):
    """A float32 pool (2 budget blocks a block) in a bfloat16 model grows only into what the
    bfloat16 pool does not take; past that, the bfloat16 pool gives back the blocks its cached
    prefixes held, then the free blocks between its rows' (renumbered). With a holder it cannot
    renumber (`foreign`: a prompt prefilling into it), its blocks stay and the float32 pool
    grows past its share."""
    from types import SimpleNamespace

    import mlx.core as mx

    from vlmserve.engine.runner.decode_batch import DecodeBatches
    from vlmserve.engine.runner.prefix_cache import PrefixCache

    def work():
        model = SimpleNamespace(
            language_model=SimpleNamespace(layers=[None]),
            kv_layout=lambda: (1, (1, 2, 2), mx.bfloat16),
            decode=lambda tokens, caches, positions: None,
        )
        cache = PrefixCache(1000)
        running: list = []
        batches = DecodeBatches(
            model,
            False,
            block_size=2,
            context_length=64,
            initial_blocks=4,
            budget_blocks=lambda: 20,
            weight=lambda dtype: 2 if dtype == mx.float32 else 1,
            reclaim=cache.reclaim,
            cached=cache.holds,
            renumber=cache.renumber,
            holders=lambda pool: [(row, "blocks") for row in running] if pool.dtype == mx.bfloat16 else [],
        )
        text = batches.pool(mx.bfloat16)
        rows = [SimpleNamespace(blocks=text.allocate(4)) for _ in range(4)]  # 16 blocks: grows to 21 (the budget)
        cache.store(np.arange(8), text, rows[0].blocks)  # a finished row's prompt stays cached
        for row in rows[:3]:
            text.release(row.blocks)
        running.append(rows[3])  # the last row runs on, in the highest blocks
        if foreign:
            text.retain(rows[3].blocks[:1])
        shares = [text.num_blocks, batches.most_blocks(mx.float32)]
        wide = batches.pool(mx.float32)
        held = wide.allocate(6)  # 7 blocks of 2 budget blocks each
        return shares, text.num_blocks, rows[3].blocks, len(held), wide.num_blocks, cache.blocks_held()

    shares, text_blocks, row_blocks, held, wide_blocks, cached = on_own_thread(work)
    assert shares == [21, 1]  # the bfloat16 pool took the whole budget: none left beside it
    assert held == 6 and cached == 0  # the cached prefix gave its blocks back
    if foreign:  # nothing moved: the float32 pool went past its share
        assert row_blocks == [13, 14, 15, 16] and text_blocks == 21 and wide_blocks == 7
    else:  # the row moved to the front, to a size the pool has had; both within the one budget
        assert row_blocks == [1, 2, 3, 4] and text_blocks == 8
        assert (text_blocks - 1) + 2 * (wide_blocks - 1) <= 20


def test_a_pool_alone_grows_to_the_whole_budget():
    """With one KV dtype the pool's share is the budget: it grows to exactly that, never past."""
    from types import SimpleNamespace

    import mlx.core as mx

    from vlmserve.engine.runner.decode_batch import DecodeBatches

    def work():
        model = SimpleNamespace(
            language_model=SimpleNamespace(layers=[None]),
            kv_layout=lambda: (1, (1, 2, 2), mx.bfloat16),
            decode=lambda tokens, caches, positions: None,
        )
        budget = {"budget_blocks": lambda: 100}
        batches = DecodeBatches(model, False, block_size=2, context_length=64, initial_blocks=4, **budget)
        pool = batches.pool(mx.bfloat16)
        sizes = []
        for _ in range(25):
            pool.allocate(4)
            sizes.append(pool.num_blocks)
        return sizes

    sizes = on_own_thread(work)
    assert sizes[-1] == 101 and max(sizes) == 101  # 100 blocks and block 0
    assert sorted(set(sizes)) == [8, 16, 32, 64, 101]


def test_a_trim_that_gives_too_little_is_followed_by_a_compaction():
    """The other pool's free tail goes first; where that is not enough, its rows' blocks move to
    the front as well, so that both pools stay within the budget."""
    from collections import Counter
    from types import SimpleNamespace

    import mlx.core as mx

    from vlmserve.engine.runner.decode_batch import DecodeBatches

    def work():
        model = SimpleNamespace(
            language_model=SimpleNamespace(layers=[None]),
            kv_layout=lambda: (1, (1, 2, 2), mx.bfloat16),
            decode=lambda tokens, caches, positions: None,
        )
        cached = {}  # a cached prefix's blocks

        def reclaim(pool, n):
            for key in [k for k, (p, _) in cached.items() if p is pool]:
                pool.release(cached.pop(key)[1])

        rows = []
        batches = DecodeBatches(
            model,
            False,
            block_size=2,
            context_length=64,
            initial_blocks=30,
            budget_blocks=lambda: 40,
            weight=lambda dtype: 1,
            reclaim=reclaim,
            cached=lambda pool: Counter(b for p, blocks in cached.values() if p is pool for b in blocks),
            holders=lambda pool: [(r, "blocks") for r in rows if r.pool is pool],
        )
        text = batches.pool(mx.bfloat16)
        got = text.allocate(32)  # grows from 30 to 41 (the budget), ids 1-32
        row = SimpleNamespace(pool=text, blocks=[got[0], got[1], got[24]])  # blocks 1, 2 and 25
        rows.append(row)
        text.release([b for b in got if b not in row.blocks and b != 31])
        cached["prefix"] = (text, [31])  # the cached prefix holds block 31: the tail past 25 goes once it is evicted
        wide = batches.pool(mx.float16)  # a second pool, of the same width here
        wide.allocate(18)
        return text.num_blocks, wide.num_blocks, sorted(row.blocks)

    text_blocks, wide_blocks, row_blocks = on_own_thread(work)
    assert (text_blocks - 1) + (wide_blocks - 1) <= 40 and wide_blocks >= 19
    assert row_blocks == [1, 2, 3]  # compacted after the trim to 30 fell short
