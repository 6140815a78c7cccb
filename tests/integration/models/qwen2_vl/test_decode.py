"""The Qwen decode step over the paged KV pool (models/qwen2_vl/decode.py) computes what mlx_vlm's
language model computes for that step: bit for bit with the composed ops on every backend,
and on CUDA with its kernels (the q/k/v split and rotation bit for bit, the attention to bf16
rounding)."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import MODELS, on_own_thread
from support.qwen_language import composed_forward
from support.qwen_language import language_model as _language_model


def _paged_rows(layers: int, kv_shape, dtype, lengths: list[int], capacity: int, block_size: int = 16):
    """A random pool holding `len(lengths)` rows of up to `capacity` positions each, their
    blocks in shuffled order; a row of length 0 holds no blocks (an empty row)."""
    import mlx.core as mx

    from vlmserve.engine.runner.block_pool import BlockPool

    per_row = capacity // block_size
    pool = BlockPool(layers, kv_shape, dtype, block_size, blocks=len(lengths) * per_row + 1)
    pool.keys = [mx.random.normal(k.shape, key=mx.random.key(i)).astype(dtype) for i, k in enumerate(pool.keys)]
    pool.values = [
        mx.random.normal(v.shape, key=mx.random.key(100 + i)).astype(dtype) for i, v in enumerate(pool.values)
    ]
    order = np.random.default_rng(0).permutation(len(lengths) * per_row) + 1
    table = order.reshape(len(lengths), per_row).astype(np.int32)
    table[np.asarray(lengths) == 0] = 0
    return pool, table


def _write_index(table, lengths, block_size: int = 16):
    import mlx.core as mx

    n = np.asarray(lengths)
    return mx.array((table[np.arange(len(n)), n // block_size] * block_size + n % block_size).astype(np.int32))


def _steps(lm, step_fn, steps: int = 3, capacity: int = 256):
    """`steps` greedy steps over a random paged pool; returns each step's logits and the final pools."""
    import mlx.core as mx

    from vlmserve.engine.ops.paged_layer_cache import PagedLayerCache

    attn = lm.model.layers[0].self_attn
    layers = len(lm.model.layers)
    embed = lm.model.embed_tokens
    dtype = embed["scales"].dtype if "scales" in embed else embed.weight.dtype  # a quantized one's weight is codes
    mx.random.seed(1)
    batch = 4
    start = [5, 40, 1, 0]  # the last row empty, as a free row is
    pool, table = _paged_rows(layers, (attn.n_kv_heads, attn.head_dim, attn.head_dim), dtype, start, capacity)
    keys, values = pool.keys, pool.values
    lengths = mx.array(start, dtype=mx.int32)
    tokens = mx.array([3, 17, 101, 0], dtype=mx.int32)
    positions = lengths + mx.array([0, 12, -1, 0], dtype=mx.int32)  # with rope deltas
    out = []
    for i in range(steps):
        shared: dict = {}
        write = _write_index(table, [n + i if n else 0 for n in start])
        caches = [PagedLayerCache(k, v, lengths, write, mx.array(table), 16, shared) for k, v in zip(keys, values)]
        pos = mx.broadcast_to(positions.reshape(1, -1, 1), (3, batch, 1))
        logits = step_fn(tokens, caches, pos)
        mx.eval(logits, [c.keys for c in caches], [c.values for c in caches])
        keys, values = [c.keys for c in caches], [c.values for c in caches]
        out.append(np.array(logits.astype(mx.float32)))
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        lengths, positions = lengths + 1, positions + 1
    # Block 0 takes the empty row's writes, which nobody reads: compare the rest.
    return out, [np.array(k[16:].astype(mx.float32)) for k in keys + values]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16+4bit", "bfloat16+8bit"])
@pytest.mark.parametrize("fused,tied", [(True, False), (False, True)], ids=["fused", "separate-tied"])
@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_step_equals_mlx_vlm(name, fused, tied, dtype):
    def work():
        from vlmserve.engine.ops import cuda_kernels, few_row_quantized, fused_projections
        from vlmserve.models.qwen2_vl import decode as qwen_decode

        lm = _language_model(name, tied, dtype)
        if fused:
            assert fused_projections.install(lm) == 2 * len(lm.model.layers)
        few_row_quantized.verify(lm)  # the server checks these while idle; on CUDA the kernel then serves

        def reference(tokens, caches, pos):
            return lm(tokens[:, None], cache=caches, position_ids=pos).logits[:, -1, :]

        def composed(tokens, caches, pos):
            return qwen_decode.forward(lm, tokens, caches, pos, kernels=False)

        def kernels(tokens, caches, pos):
            return qwen_decode.forward(lm, tokens, caches, pos, kernels=True)

        on_cuda = cuda_kernels.enabled()
        return (
            qwen_decode.supports(lm),
            _steps(lm, reference),
            _steps(lm, composed),
            _steps(lm, kernels) if on_cuda else None,
        )

    supported, reference, composed, kernels = on_own_thread(work)
    assert supported
    for ref, got in zip(reference[0] + reference[1], composed[0] + composed[1]):
        np.testing.assert_array_equal(got, ref)
    if kernels is not None:  # CUDA: the attention's softmax is online, in float32: close, not equal
        tol = 1e-2 if dtype == "float32" else 5e-2  # CUDA float32 matmuls run in TF32
        for ref, got in zip(reference[0] + reference[1], kernels[0] + kernels[1]):
            np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


def test_which_models_take_the_step():
    def work():
        from mlx_vlm.utils import load_model

        from vlmserve.models.qwen2_vl import decode as qwen_decode

        lms = {n: load_model(MODELS / n, lazy=False).language_model for n in ("qwen2_vl", "llava", "gemma3")}
        return (
            [qwen_decode.same_layers(lm) for lm in lms.values()],
            qwen_decode.supports(lms["qwen2_vl"]),  # 16-wide heads: not for the attention kernel
            qwen_decode.supports(_language_model("qwen2_vl", False, "float32")),
        )

    assert on_own_thread(work) == ([True, False, False], False, True)


def test_server_step_routes_through_forward(monkeypatch):
    """QwenVLModel.decode (the runner's step) hands a Qwen paged step to qwen_decode.forward with
    the positions mlx_vlm would get, and the logits match mlx_vlm's step. The kernels are
    swapped for the composed ops so this runs on any backend."""
    from vlmserve.models.qwen2_vl import decode as qwen_decode

    calls = composed_forward(monkeypatch, qwen_decode, lambda *args: tuple(args[3].shape), lambda caches: True)

    def work():
        import mlx.core as mx

        from vlmserve.engine.runner.decode_batch import make_decode_step
        from vlmserve.models.qwen2_vl.adapter import QwenVLModel

        vlm = QwenVLModel(MODELS / "qwen2_vl")
        start = [5, 40, 1, 0]
        pool, table = _paged_rows(*vlm.kv_layout(), start, capacity=64)
        tokens = mx.array([3, 17, 101, 0], dtype=mx.int32)
        lengths = mx.array(start, dtype=mx.int32)
        positions = lengths + mx.array([0, 12, -1, 0], dtype=mx.int32)
        step = make_decode_step(vlm.decode, 16, compiled=False)
        out = {}
        for fast in (False, True):
            vlm.fast_decode = fast
            logits, *new_kv = step(
                tokens, positions, lengths, _write_index(table, start), mx.array(table), *pool.arrays()
            )
            out[fast] = [np.array(logits)] + [np.array(a) for a in new_kv]
        return out

    out = on_own_thread(work)
    assert calls == [(3, 4, 1)]  # one call, for the fast step only
    for ref, got in zip(out[False], out[True]):
        np.testing.assert_array_equal(got, ref)
