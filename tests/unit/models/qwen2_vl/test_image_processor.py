"""The fast Qwen-VL pixel path (models/qwen2_vl/image_processor.py) takes only mlx_vlm's Qwen
processors (the processor's bits: integration/models/qwen2_vl/test_image_processor.py)."""

from __future__ import annotations

from vlmserve.models.qwen2_vl.image_processor import fast_qwen_images


def test_only_mlx_vlm_qwen_processors_are_taken():
    class Other:
        pass

    assert fast_qwen_images(Other(), "bfloat16") is None
    assert fast_qwen_images(None, "bfloat16") is None
