"""Decode attention over the slot cache (engine/ops/decode_attention.py): its launch shapes
(the kernel against attention: e2e/engine/ops/test_decode_attention.py)."""

from __future__ import annotations

from vlmserve.engine.ops import decode_attention


def test_launch_shapes_fit():
    """Every layout it serves gets a shape within a lane's registers and a block's shared memory;
    the Qwen2-VL-2B decode step keeps several query heads per block (fewer key/value reads)."""
    for rep in (1, 2, 3, 4, 6, 7, 8, 16, 64):
        for dim in (32, 64, 96, 128, 256):
            g, hb, nw = decode_attention.launch_shape(rep, dim)
            e = dim // g
            assert rep % hb == 0 and dim % g == 0 and 32 % g == 0
            assert 2 * hb * e + 4 * e + 40 <= min(255, 65536 // (32 * nw))
            assert nw * hb * (dim + 2) * 4 <= 48 * 1024
    assert decode_attention.launch_shape(6, 128)[1] > 1
