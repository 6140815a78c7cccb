"""FeatureCache: vision features by image content, an LRU within a byte budget; one query and one
hit per lookup of a request's images; entries may be arrays or nested tuples/lists of arrays."""

from __future__ import annotations

from support.helpers import on_own_thread


def test_lookup_counts_and_eviction_by_bytes():
    def work():
        import mlx.core as mx

        from vlmserve.models.feature_cache import FeatureCache

        cache = FeatureCache(max_bytes=3 * 400)  # three 100-float32 arrays
        a, b, c = (mx.full((100,), v, dtype=mx.float32) for v in (1, 2, 3))
        cache.store("a", a)
        cache.store("b", (b, None))  # rows without deepstack rows
        seen = [cache.lookup(("a", "b")) is not None, cache.lookup(("a", "x")) is None]
        cache.store("c", (c, [mx.zeros((50,), dtype=mx.float32)]))  # 600 bytes: "a" (least recent) leaves
        after = [cache.lookup(("a",)) is None, cache.lookup(("c",))[0][1][0].shape, cache.bytes]
        cache.store("big", mx.zeros((400,), dtype=mx.float32))  # over the whole budget: not kept
        return seen, after, (cache.queries, cache.hits), cache.lookup(("big",)) is None

    seen, after, counts, big_dropped = on_own_thread(work)
    assert seen == [True, True]
    assert after == [True, (50,), 400 + 600]
    assert counts == (4, 2)
    assert big_dropped
