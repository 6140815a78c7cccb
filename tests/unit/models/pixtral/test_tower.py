"""models/pixtral/tower.py on a tiny Pixtral vision tower built in place: the per-image,
unmasked runs give mlx_vlm's masked call's last and every layer's hidden states, the mask
function is mlx_vlm's own again after the call, and only Pixtral's tower is swapped."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread


def test_per_image_runs_equal_the_masked_call_and_leave_the_mask_function_as_it_was():
    def run():
        import mlx.core as mx
        from mlx_vlm.models.pixtral import vision
        from mlx_vlm.models.pixtral.config import VisionConfig

        from vlmserve.models.pixtral import tower

        config = VisionConfig(
            num_hidden_layers=2,
            hidden_size=32,
            head_dim=16,
            intermediate_size=64,
            num_attention_heads=2,
            image_size=64,
            patch_size=8,
        )
        model = vision.VisionModel(config)
        mx.eval(model.parameters())
        x = mx.random.normal((3, 64, 64, 3), key=mx.random.key(0))
        sizes = [(64, 48), (32, 64), (16, 16)]  # each image's pixels (height, width) within the padding
        ref_last, ref_states = model(x, output_hidden_states=True, image_sizes=sizes)
        mask_function = vision.generate_block_attention_mask
        installed = tower.install(model), tower.install(model), tower.install(vision.Encoder(config))
        last, states = model(x, output_hidden_states=True, image_sizes=sizes)
        one, _ = model(x[:1], output_hidden_states=False, image_sizes=sizes[:1])
        try:
            model(x[:, :, :, :2], image_sizes=sizes)  # two channels: the tower's convolution fails
        except ValueError:
            pass
        restored_after_failure = vision.generate_block_attention_mask is mask_function
        return (
            [np.array(a) for a in (ref_last, last, one, ref_last[:, : 8 * 6])],
            [(np.array(a), np.array(b)) for a, b in zip(ref_states, states)],
            installed,
            vision.generate_block_attention_mask is mask_function and restored_after_failure,
        )

    (ref_last, last, one, ref_first), states, installed, restored = on_own_thread(run)
    assert installed == (True, False, False)  # once, and never another module
    assert restored
    assert last.shape == ref_last.shape == (1, 48 + 32 + 4, 32)
    np.testing.assert_allclose(last, ref_last, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(one, ref_first, rtol=1e-4, atol=1e-5)  # the first image alone
    assert len(states) == 3
    for ref, ours in states:
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


def test_pixtral_checkpoints_get_the_adapter_that_swaps_the_tower():
    from vlmserve.models.pixtral.adapter import PixtralModel
    from vlmserve.models.registry import model_adapter_class

    assert model_adapter_class("pixtral") is PixtralModel
