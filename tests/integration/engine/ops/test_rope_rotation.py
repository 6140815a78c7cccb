"""An M-RoPE language model gives bit-identical logits with the gather-based rotate_half
(engine/ops/rope_rotation.py; the rotary embedding alone: unit/engine/ops/test_rope_rotation.py)."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import MODELS, on_own_thread
from support.rope_rotation import with_and_without_gather


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
