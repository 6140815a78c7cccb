"""Pixtral's vision tower (Mistral 3) run once per image without its block mask
(models/pixtral/tower.py): the same embeddings as mlx_vlm's one masked call, for one image and
for several of different sizes, with every attention call of the tower unmasked (so on CUDA
each takes the plan-free route instead of building a cuDNN plan per sequence length)."""

from __future__ import annotations

import numpy as np
import pytest

from support.families import checkpoint, image_prompt
from support.helpers import on_own_thread


@pytest.mark.parametrize("sizes", [((80, 64),), ((80, 64), (48, 96), (64, 64))])
def test_per_image_runs_give_the_masked_calls_embeddings(sizes, monkeypatch, tmp_path_factory):
    from vlmserve.models.pixtral import tower
    from vlmserve.models.registry import load_model_adapter, model_type_of

    path = checkpoint("mistral3", "float32", tmp_path_factory.mktemp("pixtral"))
    prepared = image_prompt(path, sizes)

    def run():
        import mlx.core as mx

        model = load_model_adapter(path, model_type_of(path))
        vision = model.model.vision_tower
        swapped = type(vision).__name__
        real, masks = mx.fast.scaled_dot_product_attention, []

        def recording(q, k, v, scale, mask=None, **kwargs):
            masks.append(mask is not None)
            return real(q, k, v, scale=scale, mask=mask, **kwargs)

        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recording)
        ours = np.array(model.embed_prompt(prepared).embeds.astype(mx.float32))
        ours_masks, masks[:] = list(masks), []
        tower.uninstall(vision)
        ref = np.array(model.embed_prompt(prepared).embeds.astype(mx.float32))
        return swapped, ours, ref, ours_masks, list(masks)

    swapped, ours, ref, ours_masks, ref_masks = on_own_thread(run)
    assert swapped.startswith("PerImage")
    assert ours_masks and not any(ours_masks)  # every attention call of the tower unmasked
    assert ref_masks and all(ref_masks)  # mlx_vlm's: masked, even for one image
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


def test_a_size_met_before_finds_its_plan_in_a_new_mix_of_sizes(monkeypatch, tmp_path_factory):
    """Each image runs on its own, so an attention shape's plan is keyed by the shape alone: once
    one image's shapes are planned, a call of two such images (and one new size) runs only the
    new size plan-free and queues only it."""
    from vlmserve.engine.ops import prefill_attention, tower_attention
    from vlmserve.models.registry import load_model_adapter, model_type_of

    path = checkpoint("mistral3", "float32", tmp_path_factory.mktemp("pixtral"))
    one, mix = image_prompt(path, ((80, 64),)), image_prompt(path, ((80, 64), (48, 96), (80, 64)))
    monkeypatch.setattr(tower_attention, "available", lambda: True)
    monkeypatch.setattr(prefill_attention, "serves", lambda *args: True)
    plan_free = []

    def run():
        import mlx.core as mx

        real = mx.fast.scaled_dot_product_attention

        def stand_in(q, k, v, scale):
            plan_free.append(q.shape[2])
            return real(q, k, v, scale=scale).transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1)

        monkeypatch.setattr(prefill_attention, "attend_unmasked", stand_in)
        model = load_model_adapter(path, model_type_of(path))
        mx.eval(model.embed_prompt(one).embeds)
        while model.attention_plans.pending():
            model.build_next_attention_plan()
        first = set(plan_free)
        plan_free.clear()
        mx.eval(model.embed_prompt(mix).embeds)
        return first, set(plan_free), model.attention_plans.pending()

    first, then, queued = on_own_thread(run)
    assert len(first) == 1 and len(then) == 1 and then != first  # only the new size ran plan-free
    assert queued == 1
