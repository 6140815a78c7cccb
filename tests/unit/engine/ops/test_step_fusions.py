"""A Qwen layer's fused residual add + RMS norm (engine/ops/residual_norm.py) and SwiGLU of a
fused gate/up output (engine/ops/gated_activation.py): on CUDA, in bf16 / fp16, each agrees
with MLX's composed ops to the activation dtype's rounding (the add bit for bit); in float32
and on other backends the add and norm are MLX's own ops."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import on_own_thread


def test_add_rms_norm_in_float32_or_off_cuda_is_mlx_ops():
    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import residual_norm

        norm = nn.RMSNorm(64, eps=1e-6)
        norm.weight = mx.random.uniform(0.5, 1.5, (64,), key=mx.random.key(0))
        h = mx.random.normal((3, 1, 64), key=mx.random.key(1))
        d = mx.random.normal((3, 1, 64), key=mx.random.key(2))
        got = residual_norm.add_rms_norm(h, d, norm)
        return residual_norm.serves(h, norm), [np.array(a) for a in got], [np.array(h + d), np.array(norm(h + d))]

    served, got, ref = on_own_thread(work)
    assert not served  # float32: MLX's own ops on every backend
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("rows,dim", [(1, 1536), (33, 1536), (5, 100), (2, 3584)])
def test_add_rms_norm_kernel_matches_mlx(dtype, rows, dim):
    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import cuda_kernels, residual_norm

        if not cuda_kernels.enabled():
            return None
        t = getattr(mx, dtype)
        norm = nn.RMSNorm(dim, eps=1e-6)
        norm.weight = mx.random.uniform(0.5, 1.5, (dim,), key=mx.random.key(0)).astype(t)
        h = (mx.random.normal((rows, 1, dim), key=mx.random.key(1)) * 4).astype(t)
        d = mx.random.normal((rows, 1, dim), key=mx.random.key(2)).astype(t)
        assert residual_norm.serves(h, norm)
        assert not residual_norm.serves(h.astype(mx.float32), norm)  # float32 keeps MLX's exact ops
        got = residual_norm.add_rms_norm(h, d, norm)
        again = residual_norm.add_rms_norm(h, d, norm)
        ref = (h + d, norm(h + d))
        return [np.array(a.astype(mx.float32)) for a in (*got, *again, *ref)]

    result = on_own_thread(work)
    if result is None:
        pytest.skip("the kernel runs on CUDA only")
    h, y, h2, y2, ref_h, ref_y = result
    np.testing.assert_array_equal(h, ref_h)
    np.testing.assert_array_equal(h2, h)
    np.testing.assert_array_equal(y2, y)
    tol = 1e-2
    np.testing.assert_allclose(y, ref_y, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(32, 1, 2 * 8960), (3, 2 * 100), (1, 1, 2 * 64), (2, 37, 2 * 96)])
def test_swiglu_halves_kernel_matches_mlx(dtype, shape):
    def work():
        import mlx.core as mx
        from mlx_vlm.models.mlp import swiglu

        from vlmserve.engine.ops import cuda_kernels, gated_activation

        if not cuda_kernels.enabled():
            return None
        t = getattr(mx, dtype)
        split = shape[-1] // 2
        gate_up = (mx.random.normal(shape, key=mx.random.key(3)) * 3).astype(t)
        assert gated_activation.serves(gate_up, split)
        assert not gated_activation.serves(gate_up, split + 1)
        assert not gated_activation.serves(gate_up.astype(mx.float32), split)  # float32 keeps MLX's exact ops
        got = gated_activation.swiglu_halves(gate_up, split)
        gate, up = mx.split(gate_up, [split], axis=-1)
        return np.array(got.astype(mx.float32)), np.array(swiglu(gate, up).astype(mx.float32))

    result = on_own_thread(work)
    if result is None:
        pytest.skip("the kernel runs on CUDA only")
    got, ref = result
    assert got.shape == ref.shape
    tol = 2e-2
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
