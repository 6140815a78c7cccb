"""Decode attention over the slot cache: the CUDA kernel agrees with the composed attention;
elsewhere mlx_vlm's own path runs unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from vlmserve.engine import decode_attention


def test_installed_and_passes_through_off_cuda(qwen_server):
    import mlx_vlm.models.qwen2_vl.language as language

    assert language.scaled_dot_product_attention is decode_attention.scaled_dot_product_attention

    def compare():
        import mlx.core as mx

        from vlmserve.engine.slot_cache import SlotLayerCache

        q = mx.random.normal((2, 4, 1, 32), key=mx.random.key(0))
        k = mx.random.normal((2, 2, 16, 32), key=mx.random.key(1))
        cache = SlotLayerCache(k, k, mx.array([3, 9], dtype=mx.int32))
        mask = cache.make_mask(1)
        ours = decode_attention.scaled_dot_product_attention(q, k, k, cache, scale=0.2, mask=mask)
        ref = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.2, mask=mask)
        return np.array(ours), np.array(ref), decode_attention.available(q, k)

    ours, ref, on_cuda = qwen_server.on_worker(compare)
    if on_cuda:
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)
    else:
        np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_kernel_matches_float32_attention(qwen_server, dtype, atol):
    def compare():
        import mlx.core as mx

        q = mx.random.normal((5, 12, 1, 128), key=mx.random.key(2)).astype(getattr(mx, dtype))
        k = mx.random.normal((5, 2, 300, 128), key=mx.random.key(3)).astype(getattr(mx, dtype))
        v = mx.random.normal((5, 2, 300, 128), key=mx.random.key(4)).astype(getattr(mx, dtype))
        if not decode_attention.available(q, k):
            return None
        lengths = mx.array([1, 7, 300, 150, 64], dtype=mx.int32)
        out = decode_attention.attend(q, k, v, lengths, 128 ** -0.5)
        kk, vv = (mx.repeat(t.astype(mx.float32), 6, axis=1) for t in (k, v))
        s = (q.astype(mx.float32) @ kk.transpose(0, 1, 3, 2)) * 128 ** -0.5
        s = mx.where(mx.arange(300)[None, None, None, :] < lengths[:, None, None, None], s, -mx.inf)
        return np.array(out.astype(mx.float32)), np.array(mx.softmax(s, axis=-1) @ vv)

    result = qwen_server.on_worker(compare)
    if result is None:
        pytest.skip("the kernel runs on CUDA only")
    np.testing.assert_allclose(result[0], result[1], atol=atol)


def test_kernel_only_for_shapes_it_serves(qwen_server):
    """Other shapes keep mlx_vlm's path on every backend."""
    def check():
        import mlx.core as mx

        def serves(q_shape, k_shape, dtype=mx.bfloat16):
            return decode_attention.serves(mx.zeros(q_shape, dtype), mx.zeros(k_shape, dtype))

        return [serves((2, 12, 1, 128), (2, 2, 64, 128)),  # the Qwen2-VL-2B decode step
                serves((2, 12, 4, 128), (2, 2, 64, 128)),  # a prefill chunk, not one token
                serves((2, 12, 1, 80), (2, 2, 64, 80)),  # head dim not a multiple of 32
                serves((2, 64, 1, 256), (2, 1, 64, 256))]  # 64 query heads per KV head: too much shared memory

    assert qwen_server.on_worker(check) == [True, False, False, False]
