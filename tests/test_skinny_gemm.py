"""The few-row matmul kernel (engine/skinny_gemm.py) agrees with MLX's matmul on CUDA, with
and without bias, for row counts inside and at the edge of its tiles; elsewhere it steps aside."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import on_own_thread


@pytest.mark.parametrize("rows,n,k,bias", [(1, 8, 32, False), (5, 1536, 1536, True), (16, 264, 96, False),
                                           (32, 2048, 1536, True), (33, 40, 8960, False), (64, 512, 256, True)])
def test_kernel_matches_matmul(rows, n, k, bias):
    def work():
        import mlx.core as mx

        from vlmserve.engine import skinny_gemm

        x = mx.random.normal((rows, 1, k), key=mx.random.key(0)).astype(mx.bfloat16)
        w = (mx.random.normal((n, k), key=mx.random.key(1)) * k ** -0.5).astype(mx.bfloat16)
        b = mx.random.normal((n,), key=mx.random.key(2)).astype(mx.bfloat16) if bias else None
        if not skinny_gemm.serves(x, w):
            return None
        ours = skinny_gemm.matmul_t(x, w, b)
        ref = x.astype(mx.float32) @ w.astype(mx.float32).T + (b.astype(mx.float32) if bias else 0)
        return ours.shape, np.array(ours.astype(mx.float32)), np.array(ref)

    result = on_own_thread(work)
    if result is None:
        pytest.skip("the kernel runs on CUDA only")
    shape, ours, ref = result
    assert shape == (rows, 1, n)
    np.testing.assert_allclose(ours, ref, rtol=1e-2, atol=2e-2)  # bf16 output rounding


def test_steps_aside_where_it_does_not_serve():
    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine import cuda_kernels, skinny_gemm

        layer = nn.Linear(64, 24)
        x = mx.random.normal((3, 64), key=mx.random.key(0))
        on_cuda = cuda_kernels.enabled()
        bf = mx.zeros((2, 64), mx.bfloat16)
        return (on_cuda, np.array(skinny_gemm.linear(layer, x)), np.array(layer(x)),
                [skinny_gemm.serves(bf, mx.zeros(s, mx.bfloat16)) for s in [(24, 64), (20, 64), (24, 48)]],
                skinny_gemm.serves(mx.zeros((65, 64), mx.bfloat16), mx.zeros((24, 64), mx.bfloat16)),
                skinny_gemm.serves(x, layer.weight))  # float32

    on_cuda, ours, ref, shapes, too_many_rows, float32 = on_own_thread(work)
    np.testing.assert_array_equal(ours, ref)
    assert shapes == ([True, False, False] if on_cuda else [False] * 3)
    assert not too_many_rows and not float32
