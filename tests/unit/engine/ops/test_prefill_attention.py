"""The prompt attention kernel (engine/ops/prefill_attention.py) against float32 attention with
the same visibility rule: ragged offsets, left padding, views of a cache buffer, GQA layouts."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import on_own_thread
from vlmserve.engine.ops import cuda_kernels, prefill_attention


def _float32_attention(q, k, v, offsets, firsts, scale):
    """Row b's query i sees keys firsts[b] <= j <= offsets[b] + i; a query that sees none gets zeros."""
    import mlx.core as mx

    rep = q.shape[1] // k.shape[1]
    kk, vv = (mx.repeat(t.astype(mx.float32), rep, axis=1) for t in (k, v))
    s = (q.astype(mx.float32) @ kk.transpose(0, 1, 3, 2)) * scale
    j = mx.arange(k.shape[2])[None, None, None, :]
    i = mx.arange(q.shape[2])[None, None, :, None]
    seen = (j >= firsts[:, None, None, None]) & (j <= offsets[:, None, None, None] + i)
    p = mx.softmax(mx.where(seen, s, -mx.inf), axis=-1)
    out = mx.where(seen.any(axis=-1, keepdims=True), p, 0.0) @ vv
    return out.transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1)


# (batch, query heads, KV heads, head dim, queries, keys' width, offsets, firsts, view)
_CASES = {
    # a follow-up turn's piece after a cached prefix, Qwen2-VL-2B's heads, in a bigger buffer
    "prefix": (1, 12, 2, 128, 150, 512, [300], [0], "buffer"),
    # pieces of three prompts side by side, each after its own cached positions
    "ragged": (3, 12, 2, 128, 70, 256, [0, 100, 185], [0, 0, 0], "contiguous"),
    # a left-padded group: padded queries see nothing and give zeros
    "left_padded": (2, 8, 8, 64, 96, 96, [0, 0], [0, 40], "contiguous"),
    # keys and values as a transposed view (a cache filled from the block pool)
    "transposed": (2, 16, 4, 64, 33, 128, [90, 10], [0, 0], "transposed"),
    "odd_head_dim": (1, 4, 2, 96, 20, 64, [40], [0], "contiguous"),
    # a head dim the tensor cores run padded to 80 (SigLIP's, Qwen3-VL's towers), from a buffer
    "padded_head_dim": (2, 16, 16, 72, 70, 256, [0, 120], [0, 0], "buffer"),
    # a head's elements not adjacent (its last axis strided): read element by element
    "strided_elements": (1, 12, 2, 64, 40, 96, [50], [0], "dim_major"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [("bfloat16", 3e-2), ("float16", 4e-3)])
@pytest.mark.parametrize("case", list(_CASES))
def test_kernel_matches_float32_attention(dtype, atol, case):
    batch, q_heads, kv_heads, dim, length, width, offsets, firsts, view = _CASES[case]

    def compare():
        import mlx.core as mx

        t = getattr(mx, dtype)
        q = mx.random.normal((batch, q_heads, length, dim), key=mx.random.key(1)).astype(t)
        if view == "buffer":  # the first `width` positions of a longer buffer
            k = mx.random.normal((batch, kv_heads, width + 256, dim), key=mx.random.key(2)).astype(t)[:, :, :width]
            v = mx.random.normal((batch, kv_heads, width + 256, dim), key=mx.random.key(3)).astype(t)[:, :, :width]
        elif view == "transposed":
            k = mx.random.normal((width, kv_heads, dim), key=mx.random.key(2)).astype(t).transpose(1, 0, 2)[None]
            v = mx.random.normal((width, kv_heads, dim), key=mx.random.key(3)).astype(t).transpose(1, 0, 2)[None]
            k, v = mx.broadcast_to(k, (batch, *k.shape[1:])), mx.broadcast_to(v, (batch, *v.shape[1:]))
        elif view == "dim_major":
            k = mx.random.normal((batch, kv_heads, dim, width), key=mx.random.key(2)).astype(t).swapaxes(2, 3)
            v = mx.random.normal((batch, kv_heads, dim, width), key=mx.random.key(3)).astype(t).swapaxes(2, 3)
        else:
            k = mx.random.normal((batch, kv_heads, width, dim), key=mx.random.key(2)).astype(t)
            v = mx.random.normal((batch, kv_heads, width, dim), key=mx.random.key(3)).astype(t)
        off, first = mx.array(offsets, dtype=mx.int32), mx.array(firsts, dtype=mx.int32)
        ref = _float32_attention(q, k, v, off, first, dim**-0.5)
        a, b = (prefill_attention.attend(q, k, v, dim**-0.5, off, first) for _ in range(2))
        return np.array(ref), np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))

    ref, first, second = on_own_thread(compare)
    assert first.shape == (batch, length, q_heads * dim)
    np.testing.assert_allclose(first, ref, atol=atol)
    np.testing.assert_array_equal(first, second)  # the same from call to call


def test_serves_only_layouts_it_takes():
    """float32, odd head dims and ragged head groups keep the composed attention (on every backend)."""
    on = cuda_kernels.enabled()

    def serves(*args):
        import mlx.core as mx

        return prefill_attention.serves(getattr(mx, args[0]), *args[1:])

    got = on_own_thread(
        lambda: [
            serves("bfloat16", 12, 2, 128),
            serves("float16", 8, 8, 64),
            serves("float32", 12, 2, 128),
            serves("bfloat16", 12, 5, 128),
            serves("bfloat16", 12, 2, 72),
            serves("bfloat16", 12, 2, 100),
            serves("bfloat16", 12, 2, 256),
        ]
    )
    assert got == [on, on, False, False, on, False, False]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [prefill_attention.UNMASKED_LAYOUT, prefill_attention.LAYOUT])
@pytest.mark.parametrize("count,length", [(1, 1024), (3, 300), (8, 64)])
def test_unmasked_matches_cudnn_on_a_vision_towers_segments(count, length, layout):
    """Every query sees its whole segment (a vision tower's image): the kernel, in either block
    layout, against MLX's SDPA (cuDNN on CUDA) on Qwen2-VL's tower heads (16 x 80), laid out as
    the tower lays them out."""

    def compare():
        import mlx.core as mx

        qkv = mx.random.normal((count * length, 3, 16, 80), key=mx.random.key(4)).astype(mx.bfloat16)
        q, k, v = (qkv[:, i].reshape(count, length, 16, 80).transpose(0, 2, 1, 3) for i in range(3))
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=80**-0.5, mask=None).transpose(0, 2, 1, 3)
        got = prefill_attention.attend_unmasked(q, k, v, 80**-0.5, layout)
        return np.array(ref.reshape(count, length, -1).astype(mx.float32)), np.array(got.astype(mx.float32))

    ref, got = on_own_thread(compare)
    assert got.shape == ref.shape == (count, length, 16 * 80)
    np.testing.assert_allclose(got, ref, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [80, 72])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("lengths", [[1024], [256, 300, 64, 300], [64, 64, 64, 5, 1500], [64, 0, 300]])
def test_segments_match_each_segments_own_attention(lengths, strided, dim):
    """All segments of a tower call in one launch (attend_segments: q and k from the rotated
    (S, 2, H, D) array, v from the (S, 3, H, D) projection, as the tower lays them out) against
    MLX's SDPA over each segment alone, Qwen2-VL's tower heads (16 x 80) and Qwen3-VL 8B's
    (16 x 72, padded inside the kernel); lengths not multiples
    of a block's 64 queries, a segment shorter than the key tile, an empty one; q and k also as a
    view of the projection's rows (the strides of a (S, 3, H, D) array)."""

    def compare():
        import mlx.core as mx

        total = sum(lengths)
        qkv = mx.random.normal((total, 3, 16, dim), key=mx.random.key(4)).astype(mx.bfloat16)
        qk = mx.random.normal((total, 2, 16, dim), key=mx.random.key(5)).astype(mx.bfloat16)
        if strided:
            qk = qkv[:, :2]
        bounds = [0, *np.cumsum(lengths).tolist()]
        refs = []
        for lo, hi in zip(bounds, bounds[1:]):
            if hi == lo:
                continue
            q, k = (qk[lo:hi, i].transpose(1, 0, 2)[None] for i in range(2))
            v = qkv[lo:hi, 2].transpose(1, 0, 2)[None]
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=None)
            refs.append(out[0].transpose(1, 0, 2).reshape(hi - lo, -1))
        got = prefill_attention.attend_segments(qk, qkv, mx.array(bounds, dtype=mx.int32), max(lengths), dim**-0.5)
        return np.array(mx.concatenate(refs).astype(mx.float32)), np.array(got.astype(mx.float32))

    ref, got = on_own_thread(compare)
    assert got.shape == ref.shape == (sum(lengths), 16 * dim)
    np.testing.assert_allclose(got, ref, atol=2e-2)


def test_a_noted_build_is_the_very_build_the_launch_takes(monkeypatch):
    """note_build (queued at load) names the kernel, shared memory, input dtypes and ranks, and
    template the launch takes: for the prompt forward (GQA heads, the default layout) and for a
    vision tower's segments (attend_unmasked's layout). The kernel is stood in for: any backend."""
    from vlmserve.engine.ops import kernel_disk_cache

    noted, launched = [], []

    def work():
        import mlx.core as mx

        def build(inputs, template):
            return tuple((x.dtype, x.ndim) for x in inputs), tuple(template)

        class Recorder(kernel_disk_cache.CachedKernel):  # a kernel that files its builds
            def __init__(self, name, shared_memory):
                self.id = (name, shared_memory)

            def note(self, *, inputs, output_dtypes, template, later=False):
                noted.append((self.id, build(inputs, template), tuple(output_dtypes)))

            def __call__(self, *, inputs, output_dtypes, template, **launch):
                launched.append((self.id, build(inputs, template), tuple(output_dtypes)))
                return [mx.zeros(launch["output_shapes"][0], dtype=output_dtypes[0])]

        monkeypatch.setattr(
            cuda_kernels, "kernel", lambda name, *args, shared_memory=0, **kwargs: Recorder(name, shared_memory)
        )
        bf16 = mx.bfloat16
        prefill_attention.note_build(bf16, 12, 2, 128, 128**-0.5)
        q, kv = mx.zeros((2, 12, 40, 128), dtype=bf16), mx.zeros((2, 2, 300, 128), dtype=bf16)[:, :, :200]
        rows = mx.array([0, 160], dtype=mx.int32), mx.zeros((2,), dtype=mx.int32)
        prefill_attention.attend(q, kv, kv, 128**-0.5, *rows)
        prefill_attention.note_build(bf16, 16, 16, 80, 80**-0.5, prefill_attention.UNMASKED_LAYOUT)
        seg = mx.zeros((3, 16, 64, 80), dtype=bf16)
        prefill_attention.attend_unmasked(seg, seg, seg, 80**-0.5)
        prefill_attention.note_build(bf16, 16, 16, 80, 80**-0.5, prefill_attention.UNMASKED_LAYOUT, segments=True)
        qkv = mx.zeros((200, 3, 16, 80), dtype=bf16)
        bounds = mx.array([0, 64, 200], dtype=mx.int32)
        prefill_attention.attend_segments(mx.zeros((200, 2, 16, 80), dtype=bf16), qkv, bounds, 136, 80**-0.5)

    on_own_thread(work)
    assert len(noted) == len(launched) == 3 and noted == launched
    assert noted[0][0] != noted[1][0]  # the two layouts ask different shared memory
    assert noted[1][1] != noted[2][1]  # segments: another build of the same kernel
