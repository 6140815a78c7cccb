"""Kimi-VL's NumPy processor gives mlx-vlm's ids and pixels, bit for bit, with no MLX call."""

from __future__ import annotations

import numpy as np

from support.families import checkpoint
from support.helpers import IMAGES, on_own_thread

PROMPT = (
    "<|im_user|>user<|im_middle|><|media_start|>image<|media_content|><|media_pad|><|media_end|>x"
    "<|media_start|>image<|media_content|><|media_pad|><|media_end|>Hi<|im_end|>"
)


def test_numpy_processor_equals_mlx_vlms(tmp_path):
    from vlmserve.inputs.media import MediaPolicy, decode_image
    from vlmserve.models.kimi_vl.processing import KimiVLProcessing
    from vlmserve.models.processor import load_processor

    path = checkpoint("kimi_vl", "float32", tmp_path)
    ours = KimiVLProcessing().prepare_processor(load_processor(path), None)
    images = [decode_image((IMAGES / n).read_bytes(), MediaPolicy()) for n in ("small_64x48.png", "large_224x160.jpg")]
    got = ours(text=[PROMPT], images=images, return_tensors="np")

    def upstream():
        out = load_processor(path)(text=[PROMPT], images=images, return_tensors="np")
        return {k: np.array(v) for k, v in out.items()}

    want = on_own_thread(upstream)
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[key]), value, err_msg=key)
