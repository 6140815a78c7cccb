"""The gather-based rotate_half gives bit-identical rotary embeddings to mlx_vlm's, eager and
compiled (an M-RoPE language model's logits with it: integration/engine/ops/test_rope_rotation.py)."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import on_own_thread
from support.rope_rotation import with_and_without_gather


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
