"""The Qwen decode step's q/k/v split and rotation kernel (models/qwen2_vl/decode.py) is bit
for bit the composed ops (the step against mlx_vlm's: integration/models/qwen2_vl/test_decode.py)."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import on_own_thread

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_split_kernel_is_bit_identical(dtype):
    def work():
        import mlx.core as mx

        from vlmserve.engine.ops import cuda_kernels
        from vlmserve.models.qwen2_vl import decode as qwen_decode

        if not cuda_kernels.enabled():
            return None
        t = getattr(mx, dtype)
        batch, hq, hkv, dim = 5, 12, 2, 128
        qkv = mx.random.normal((batch, 1, (hq + 2 * hkv) * dim), key=mx.random.key(0)).astype(t) * 3
        angles = mx.random.uniform(0, 100, (batch, 1, dim // 2), key=mx.random.key(1))
        angles = mx.concatenate([angles, angles], axis=-1)
        cos, sin = mx.cos(angles).astype(t), mx.sin(angles).astype(t)
        ours = qwen_decode.rope_split(qkv, cos, sin, hq, hkv, kernel=True)
        rows = qwen_decode.rope_split(qkv, cos, sin, hq, hkv, kernel=True, kv_rows=True)
        ref = qwen_decode.rope_split(qkv, cos, sin, hq, hkv, kernel=False)
        # kv_rows: k and v as the (B, Hkv, D) rows the paged cache writes, the same values
        rows = [rows[0], *(r[:, :, None, :] for r in rows[1:])]
        pairs = [*zip(ours, ref), *zip(rows, ref)]
        return [(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))) for a, b in pairs]

    result = on_own_thread(work)
    if result is None:
        pytest.skip("the kernel runs on CUDA only")
    for ours, ref in result:
        np.testing.assert_array_equal(ours, ref)
