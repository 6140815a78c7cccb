"""Fused q/k/v and gate/up projections give bit-identical logits to mlx_vlm's separate ones,
for every fixture family, plain and quantized, in prefill and decode."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MODELS, on_own_thread

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "gemma3", "llava"]


def _logits(lm, steps: int = 3) -> list[np.ndarray]:
    """A 7-token prefill, then `steps` greedy one-token steps, through the model's own cache."""
    import mlx.core as mx
    from mlx_vlm.models import cache as vlm_cache

    cache = vlm_cache.make_prompt_cache(lm)
    ids = mx.array([[5, 17, 42, 7, 99, 3, 11]], dtype=mx.int32)
    out = []
    for _ in range(steps + 1):
        logits = lm(ids, cache=cache).logits[:, -1, :].astype(mx.float32)
        out.append(np.array(logits))
        ids = mx.argmax(logits, axis=-1).astype(mx.int32)[:, None]
    return out


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


def test_a_part_called_on_another_input_uses_its_own_rows():
    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import fused_projections

        mx.random.seed(3)
        block = nn.Module()
        block.q_proj, block.k_proj, block.v_proj = nn.Linear(16, 8), nn.Linear(16, 4), nn.Linear(16, 4)
        x, other = mx.random.normal((2, 3, 16)), mx.random.normal((2, 3, 16))
        expected = [np.array(block.q_proj(x)), np.array(block.k_proj(other)), np.array(block.v_proj(x))]
        assert fused_projections.install(block) == 1
        # k on a different input than q: its own rows; v on q's input again: q's fused output
        got = [np.array(block.q_proj(x)), np.array(block.k_proj(other)), np.array(block.v_proj(x))]
        return expected, got

    expected, got = on_own_thread(work)
    for e, g in zip(expected, got):
        assert np.array_equal(e, g)


def test_mismatched_projections_are_left_alone():
    def work():
        import mlx.nn as nn

        from vlmserve.engine.ops import fused_projections

        mlp = nn.Module()
        mlp.gate_proj, mlp.up_proj = nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=True)
        attn = nn.Module()
        attn.q_proj, attn.k_proj = nn.Linear(16, 8), nn.Linear(16, 8)  # no v_proj
        return fused_projections.install(mlp) + fused_projections.install(attn), type(mlp.gate_proj).__name__

    assert on_own_thread(work) == (0, "Linear")
