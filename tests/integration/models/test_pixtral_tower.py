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
