"""Prompt attention off cuDNN: `composed` is MLX's own composed attention (bit for bit where
MLX composes, as on the CPU), and the language model's attention entry point uses it on CUDA
only where MLX without cuDNN would have composed too."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import on_own_thread
from vlmserve.engine.ops import composed_attention, cuda_kernels, decode_attention

# (batch, query heads, KV heads, query length, key length, head dim)
_SHAPES = [(2, 4, 4, 7, 7, 16), (3, 6, 2, 5, 9, 32), (1, 12, 2, 1, 20, 64)]


def _qkv(shape, dtype):
    """Random queries (B, Hq, Lq, D), keys and values (B, Hkv, Lk, D) of `shape`."""
    import mlx.core as mx

    b, hq, hkv, lq, lk, d = shape
    return (
        mx.random.normal(s, key=mx.random.key(i)).astype(dtype)
        for i, s in enumerate([(b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d)])
    )


def _mask(kind, shape, dtype):
    import mlx.core as mx

    b, hq, _, lq, lk, _ = shape
    if kind == "causal":
        return "causal"
    if kind == "bool":
        return mx.random.uniform(shape=(b, 1, lq, lk), key=mx.random.key(7)) > 0.3
    if kind == "additive":
        return mx.random.normal((b, hq, lq, lk), key=mx.random.key(8)).astype(dtype)
    if kind == "additive-row":
        return mx.random.normal((lq, lk), key=mx.random.key(9)).astype(mx.bfloat16)
    return None


@pytest.mark.parametrize("shape", _SHAPES, ids=["mha", "gqa", "one-query"])
@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive", "additive-row"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sinks", [False, True])
def test_composed_is_mlx_composed_attention(shape, mask, dtype, sinks):
    def compare():
        import mlx.core as mx

        dt = getattr(mx, dtype)
        q, k, v = _qkv(shape, dt)
        m = _mask(mask, shape, dt)
        s = mx.random.normal((shape[1],), key=mx.random.key(5)).astype(dt) if sinks else None
        ours = composed_attention.composed(q, k, v, 0.3, m, s)
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=m, sinks=s)
        return np.array(ours.astype(mx.float32)), np.array(ref.astype(mx.float32)), ours.dtype == ref.dtype

    ours, ref, same_dtype = on_own_thread(compare)
    assert same_dtype and ours.shape == ref.shape
    if cuda_kernels.on_cuda():  # MLX sends some calls to cuDNN or its vector kernel
        np.testing.assert_allclose(ours, ref, rtol=0, atol=6e-2 if dtype == "bfloat16" else 1e-4)
    else:
        np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("shape", _SHAPES, ids=["mha", "gqa", "one-query"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_grouped_mask_selects_the_same(shape, dtype):
    """A boolean (B, 1, L, K) mask laid out once by grouped_mask gives what the mask gives."""

    def compare():
        import mlx.core as mx

        dt = getattr(mx, dtype)
        q, k, v = _qkv(shape, dt)
        m = _mask("bool", shape, dt)
        grouped = composed_attention.grouped_mask(m, shape[1], shape[2])
        ours = composed_attention.composed(q, k, v, 0.3, grouped)
        ref = composed_attention.composed(q, k, v, 0.3, m)
        return np.array(ours.astype(mx.float32)), np.array(ref.astype(mx.float32)), grouped.ndim

    ours, ref, ndim = on_own_thread(compare)
    assert ndim == (5 if shape[1] > shape[2] else 4)
    np.testing.assert_array_equal(ours, ref)


def test_avoids_cudnn_where_mlx_composes():
    def check():
        import mlx.core as mx

        one, four = mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 4, 8))
        array_mask = mx.zeros((1, 1, 1, 3))
        return [
            composed_attention.avoids_cudnn(one, None),
            composed_attention.avoids_cudnn(one, "causal"),
            composed_attention.avoids_cudnn(one, array_mask),
            composed_attention.avoids_cudnn(four, None),
            composed_attention.avoids_cudnn(four, "causal"),
        ]

    assert on_own_thread(check) == [False, False, True, True, True]


def test_language_attention_routes_prompts_to_composed_when_cudnn_is_on(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda_kernels, "cudnn_enabled", lambda: True)
    monkeypatch.setattr(composed_attention, "composed", lambda *a, **k: calls.append("composed") or a[0])
    monkeypatch.setattr(decode_attention, "_ORIGINAL", lambda *a, **k: calls.append("mlx") or a[0])

    class Quantized:
        bits = 4

    def run():
        import mlx.core as mx

        prompt, step = mx.zeros((1, 4, 9, 16)), mx.zeros((1, 4, 1, 16))
        kv = mx.zeros((1, 2, 9, 16))
        sdpa = decode_attention.scaled_dot_product_attention
        sdpa(prompt, kv, kv, None, scale=0.25, mask="causal")  # a prompt: composed
        sdpa(step, kv, kv, None, scale=0.25, mask=None)  # one query: MLX's vector kernel
        sdpa(step, kv, kv, None, scale=0.25, mask=mx.zeros((1, 1, 1, 9)))  # array mask: composed
        sdpa(prompt, kv, kv, Quantized(), scale=0.25, mask="causal")  # quantized cache: mlx_vlm's path

    on_own_thread(run)
    assert calls == ["composed", "mlx", "composed", "mlx"]


def test_language_attention_unchanged_with_cudnn_off(monkeypatch):
    monkeypatch.setattr(cuda_kernels, "cudnn_enabled", lambda: False)
    monkeypatch.setattr(composed_attention, "composed", lambda *a, **k: pytest.fail("composed with cuDNN off"))
    calls = []
    monkeypatch.setattr(decode_attention, "_ORIGINAL", lambda *a, **k: calls.append("mlx") or a[0])

    def run():
        import mlx.core as mx

        q, kv = mx.zeros((1, 4, 9, 16)), mx.zeros((1, 2, 9, 16))
        decode_attention.scaled_dot_product_attention(q, kv, kv, None, scale=0.25, mask="causal")

    on_own_thread(run)
    assert calls == ["mlx"]
