"""Decode attention over the paged KV pool: the CUDA kernel agrees with the composed attention
(whatever blocks a row's positions sit in); elsewhere mlx_vlm's own path runs unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from vlmserve.engine.ops import decode_attention


def test_installed_and_passes_through_off_cuda(qwen_server):
    import mlx_vlm.models.qwen2_vl.language as language

    assert language.scaled_dot_product_attention is decode_attention.scaled_dot_product_attention

    def compare():
        import mlx.core as mx

        q = mx.random.normal((2, 4, 1, 32), key=mx.random.key(0))
        k = mx.random.normal((2, 2, 16, 32), key=mx.random.key(1))
        cache = _paged(k, k, [3, 9], block_size=4)
        mask = cache.make_mask(1)
        keys, values = cache.update_and_fetch(k[:, :, :1], k[:, :, :1])
        ours = decode_attention.scaled_dot_product_attention(q, keys, values, cache, scale=0.2, mask=mask)
        ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.2, mask=mask)
        return np.array(ours), np.array(ref), decode_attention.available(q, cache.keys)

    ours, ref, on_cuda = qwen_server.on_worker(compare)
    if on_cuda:
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)
    else:
        np.testing.assert_array_equal(ours, ref)


def _paged(k, v, lengths, block_size: int, seed: int = 0):
    """A PagedLayerCache holding dense (B, H, L, D) keys and values, each row's blocks scattered
    over a pool in shuffled order; each row's next position is written after its `lengths`."""
    import mlx.core as mx

    from vlmserve.engine.ops.paged_layer_cache import PagedLayerCache

    batch, heads, length, dim = k.shape
    per_row = -(-(length + 1) // block_size)
    order = np.random.default_rng(seed).permutation(batch * per_row) + 1  # block 0 stays free
    table = order.reshape(batch, per_row).astype(np.int32)
    pool_k = mx.zeros(((batch * per_row + 1) * block_size, heads, dim), k.dtype)
    pool_v = mx.zeros(((batch * per_row + 1) * block_size, heads, v.shape[-1]), v.dtype)
    for b in range(batch):
        where = (table[b][:, None] * block_size + np.arange(block_size)).reshape(-1)[:length]
        pool_k[mx.array(where)] = k[b].swapaxes(0, 1)
        pool_v[mx.array(where)] = v[b].swapaxes(0, 1)
    n = np.asarray(lengths, dtype=np.int32)
    write = table[np.arange(batch), n // block_size] * block_size + n % block_size
    return PagedLayerCache(pool_k, pool_v, mx.array(n), mx.array(write), mx.array(table), block_size)


def _float32_attention(q, k, v, lengths, scale, window=0):
    import mlx.core as mx

    rep = q.shape[1] // k.shape[1]
    kk, vv = (mx.repeat(t.astype(mx.float32), rep, axis=1) for t in (k, v))
    s = (q.astype(mx.float32) @ kk.transpose(0, 1, 3, 2)) * scale
    pos, end = mx.arange(k.shape[2])[None, None, None, :], lengths[:, None, None, None]
    seen = (pos < end) & (pos >= end - window) if window else pos < end
    s = mx.where(seen, s, -mx.inf)
    return mx.softmax(s, axis=-1) @ vv


# (batch, query heads, KV heads, head dim, capacity, lengths): Qwen2-VL-2B's GQA, plain multi-head
# attention at a small head dim, and few query heads of a wide head per KV head.
_LAYOUTS = [(5, 12, 2, 128, 300, [1, 7, 300, 150, 64]), (3, 8, 8, 64, 96, [96, 1, 33]), (2, 16, 4, 256, 70, [70, 2])]


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 40], ids=["full", "sliding"])
@pytest.mark.parametrize("dtype,atol", [("float32", 1e-5), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("layout", _LAYOUTS, ids=["gqa6", "mha", "wide"])
def test_kernel_matches_float32_attention(qwen_server, dtype, atol, layout, window):
    """Each launch shape the kernel may take for this layout agrees with float32 attention,
    and gives the same result on a second call; with a sliding window (a Gemma 3 layer's),
    rows longer and shorter than it each see their last `window` positions."""
    batch, q_heads, kv_heads, dim, capacity, lengths = layout

    def compare():
        import mlx.core as mx

        q = mx.random.normal((batch, q_heads, 1, dim), key=mx.random.key(2)).astype(getattr(mx, dtype))
        k = mx.random.normal((batch, kv_heads, capacity, dim), key=mx.random.key(3)).astype(getattr(mx, dtype))
        v = mx.random.normal((batch, kv_heads, capacity, dim), key=mx.random.key(4)).astype(getattr(mx, dtype))
        if not decode_attention.available(q, k):
            return None
        n = mx.array(lengths, dtype=mx.int32)
        ref = np.array(_float32_attention(q, k, v, n, dim**-0.5, window))
        shapes, results = decode_attention.SHAPES, []
        try:
            for shape in shapes:
                decode_attention.SHAPES = (shape,)
                if decode_attention.serves(q, k):
                    cache = _paged(k, v, [x - 1 for x in lengths], block_size=16, seed=len(results))
                    first, second = (decode_attention.attend(q, cache, n, dim**-0.5, window=window) for _ in range(2))
                    results.append((shape, np.array(first.astype(mx.float32)), np.array(second.astype(mx.float32))))
        finally:
            decode_attention.SHAPES = shapes
        return ref, results

    result = qwen_server.on_worker(compare)
    if result is None:
        pytest.skip("the kernel runs on CUDA only")
    ref, results = result
    assert results, "no launch shape serves this layout"
    for shape, first, second in results:
        np.testing.assert_allclose(first, ref, atol=atol, err_msg=f"launch shape {shape}")
        np.testing.assert_array_equal(first, second, err_msg=f"launch shape {shape}")


def test_kernel_only_for_shapes_it_serves(qwen_server):
    """Other shapes keep mlx_vlm's path on every backend."""

    def check():
        import mlx.core as mx

        def serves(q_shape, k_shape, dtype=mx.bfloat16, k_dtype=None):
            return decode_attention.serves(mx.zeros(q_shape, dtype), mx.zeros(k_shape, k_dtype or dtype))

        return [
            serves((2, 12, 1, 128), (2, 2, 64, 128)),  # the Qwen2-VL-2B decode step
            serves((2, 64, 1, 256), (2, 1, 64, 256)),  # 64 wide query heads per KV head: one per block
            serves((2, 12, 4, 128), (2, 2, 64, 128)),  # a prefill chunk, not one token
            serves((2, 12, 1, 80), (2, 2, 64, 80)),  # head dim not a multiple of 32
            serves((2, 12, 1, 128), (2, 5, 64, 128)),  # query heads not a multiple of KV heads
            serves((2, 12, 1, 128), (2, 2, 64, 128), k_dtype=mx.float16),
        ]  # query and cache dtypes differ

    assert qwen_server.on_worker(check) == [True, True, False, False, False, False]
