"""Decode attention over the slot cache (engine/ops/decode_attention.py): its launch shapes
(the kernel against attention: e2e/engine/ops/test_decode_attention.py)."""

from __future__ import annotations

from support.helpers import on_own_thread
from vlmserve.engine.ops import decode_attention


def test_launch_shapes_fit():
    """Every layout it serves gets a shape within a lane's registers (its queries, accumulators,
    one position as floats and DEPTH positions raw) and a block's shared memory, for 2- and
    4-byte elements; the Qwen2-VL-2B decode step keeps several query heads per block (fewer
    key/value reads) and positions loading ahead."""
    for itemsize in (2, 4):
        for rep in (1, 2, 3, 4, 6, 7, 8, 16, 64):
            for dim in (32, 64, 96, 128, 256):
                g, hb, nw, depth = decode_attention.launch_shape(rep, dim, itemsize)
                e = dim // g
                assert rep % hb == 0 and dim % g == 0 and 32 % g == 0 and depth >= 1
                raw = 2 * depth * -(-e * itemsize // 4)
                assert 2 * hb * e + 2 * e + raw + 40 <= min(255, 65536 // (32 * nw))
                assert nw * hb * (dim + 2) * 4 <= 48 * 1024
                assert decode_attention.serves_heads(rep, 1, dim, itemsize)
    g, hb, nw, depth = decode_attention.launch_shape(6, 128)
    assert hb > 1 and depth > 1


def _paged_cache():
    """A tiny PagedLayerCache of two rows (made on the calling thread)."""
    import mlx.core as mx

    from vlmserve.engine.ops.paged_layer_cache import PagedLayerCache

    pool = mx.zeros((16, 2, 32))
    lengths, write = mx.array([3, 9], dtype=mx.int32), mx.array([4, 10], dtype=mx.int32)
    return PagedLayerCache(pool, pool, lengths, write, mx.array([[1, 2], [3, 0]], dtype=mx.int32), 4)


def test_each_mask_the_step_made_names_its_window():
    """A step with sliding-window layers (Gemma 3) makes a full mask and a windowed one and hands
    each layer one: the attention knows its window by the mask it got; a mask the step did not
    make leaves it unknown there, and is the plain rule in a step without windows."""
    import mlx.core as mx

    def windows():
        plain_step = _paged_cache()
        plain = plain_step.make_mask(1)
        windowed_step = _paged_cache()
        full, sliding = windowed_step.make_mask(1), windowed_step.make_mask(1, window_size=5)
        foreign = mx.ones(full.shape, dtype=mx.bool_)
        return [
            plain_step.kernel_window(plain),
            plain_step.kernel_window(None),
            plain_step.kernel_window(foreign),
            windowed_step.kernel_window(full),
            windowed_step.kernel_window(sliding),
            windowed_step.kernel_window(foreign),
            windowed_step.kernel_window(None),
        ]

    assert on_own_thread(windows) == [0, 0, 0, 0, 5, None, None]


def test_a_sliding_layer_takes_the_kernel_with_its_window(monkeypatch):
    """Where the kernel serves, a decode step's windowed layer launches it with the window of the
    mask it was given, a full layer without one; a mask the step did not make keeps mlx_vlm's path."""
    import mlx.core as mx

    launched = []
    monkeypatch.setattr(decode_attention, "available", lambda q, k: True)
    monkeypatch.setattr(
        decode_attention, "attend", lambda q, cache, lengths, scale, window=0: launched.append(window) or q
    )

    def route():
        cache = _paged_cache()
        full, sliding = cache.make_mask(1), cache.make_mask(1, window_size=5)
        q = mx.zeros((2, 4, 1, 32))
        keys, values = cache.update_and_fetch(mx.zeros((2, 2, 1, 32)), mx.zeros((2, 2, 1, 32)))
        for mask in (sliding, full, mx.array(sliding)):
            decode_attention.scaled_dot_product_attention(q, keys, values, cache, scale=0.2, mask=mask)

    on_own_thread(route)
    assert launched == [5, 0]
