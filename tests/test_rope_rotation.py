"""The gather-based rotate_half gives bit-identical rotary embeddings to mlx_vlm's, eager and
compiled, and an M-RoPE language model gives bit-identical logits with it."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MODELS, on_own_thread


def with_and_without_gather(run) -> dict:
    """run() with mlx_vlm's rotate_half, then with ours; leaves the binding as it found it
    (a server of this session may have installed ours)."""
    from mlx_vlm.models import rope_utils

    from vlmserve.engine.ops import rope_rotation

    installed = rope_utils.rotate_half is rope_rotation.rotate_half
    rope_rotation.uninstall()
    try:
        original = run()
        assert rope_rotation.install() >= 1
        assert rope_utils.rotate_half is rope_rotation.rotate_half
        return {"original": original, "gather": run()}
    finally:
        if not installed:
            rope_rotation.uninstall()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_rotary_embedding_is_unchanged(dtype):
    def work():
        import mlx.core as mx
        from mlx_vlm.models import rope_utils

        dt = getattr(mx, dtype)
        key = mx.random.key(1)
        q, k = (mx.random.normal((2, 4, 5, 64), key=kk).astype(dt) for kk in mx.random.split(key))
        positions = mx.broadcast_to(mx.arange(5)[None, None], (3, 2, 5))
        rope = rope_utils.MRoPERotaryEmbedding(64, mrope_section=[8, 12, 12], style="chunked")
        cos, sin = rope(q, positions)

        def apply(q, k, cos, sin):
            return rope_utils.apply_multimodal_rotary_pos_emb(q, k, cos, sin, style="chunked")

        def run():
            eager = apply(q, k, cos, sin)
            traced = mx.compile(lambda *a: apply(*a))(q, k, cos, sin)  # a new function: traced anew
            return [np.array(a.astype(mx.float32)) for a in (*eager, *traced)]

        return with_and_without_gather(run)

    outs = on_own_thread(work)
    for a, b in zip(outs["original"], outs["gather"]):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_mrope_language_model_logits_are_unchanged(name):
    def work():
        import mlx.core as mx
        from mlx_vlm.models import cache as vlm_cache
        from mlx_vlm.utils import load_model

        lm = load_model(MODELS / name, lazy=False).language_model
        ids = mx.array([[5, 17, 42, 7, 99, 3, 11]], dtype=mx.int32)
        pos = mx.array([[[0, 1, 2, 2, 2, 5, 6]], [[0, 1, 2, 3, 3, 5, 6]], [[0, 1, 2, 3, 4, 5, 6]]], dtype=mx.int32)

        def run():
            cache = vlm_cache.make_prompt_cache(lm)
            logits = [lm(ids, cache=cache, position_ids=pos).logits]
            step = mx.full((3, 1, 1), 7, dtype=mx.int32)
            logits.append(lm(ids[:, :1], cache=cache, position_ids=step).logits)
            return [np.array(x.astype(mx.float32)) for x in logits]

        return with_and_without_gather(run)

    outs = on_own_thread(work)
    for a, b in zip(outs["original"], outs["gather"]):
        assert np.array_equal(a, b)
