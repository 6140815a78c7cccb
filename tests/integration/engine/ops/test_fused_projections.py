"""Fused q/k/v and gate/up projections give bit-identical logits to mlx_vlm's separate ones,
for every fixture family, plain and quantized, in prefill and decode."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import MODELS, greedy_logits, on_own_thread

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "gemma3", "llava"]


def _logits(lm, steps: int = 3) -> list[np.ndarray]:
    """A 7-token prefill, then `steps` greedy one-token steps, through the model's own cache."""
    import mlx.core as mx
    from mlx_vlm.models import cache as vlm_cache

    cache = vlm_cache.make_prompt_cache(lm)
    return greedy_logits(lm, mx.array([[5, 17, 42, 7, 99, 3, 11]], dtype=mx.int32), cache, steps)


def _plain_and_fused(name: str, quantize: bool):
    import mlx.nn as nn
    from mlx_vlm.utils import load_model

    from vlmserve.engine.ops import fused_projections

    models = [load_model(MODELS / name, lazy=False) for _ in range(2)]
    if quantize:
        for m in models:
            nn.quantize(
                m.language_model, group_size=32, bits=4, class_predicate=lambda _, mod: isinstance(mod, nn.Linear)
            )
    plain, fused = (m.language_model for m in models)
    groups = fused_projections.install(fused)
    return plain, fused, groups


@pytest.mark.parametrize("quantize", [False, True], ids=["float", "4bit"])
@pytest.mark.parametrize("name", FAMILIES)
def test_fused_projections_give_identical_logits(name, quantize):
    def work():
        plain, fused, groups = _plain_and_fused(name, quantize)
        layer = fused.model.layers[0]
        attn = getattr(layer, "self_attn", None)
        return (
            groups,
            len(fused.model.layers),
            _logits(plain),
            _logits(fused),
            type(attn.q_proj).__name__,
            tuple(attn.k_proj.weight.shape),
            tuple(plain.model.layers[0].self_attn.k_proj.weight.shape),
        )

    groups, layers, reference, got, part_type, k_shape, k_shape_plain = on_own_thread(work)
    assert groups == 2 * layers  # q/k/v and gate/up in every layer
    assert part_type == "FusedPart"
    assert k_shape == k_shape_plain  # code that reads a projection's weight still sees its own
    for ref, out in zip(reference, got):
        assert np.array_equal(ref, out), np.abs(ref - out).max()
