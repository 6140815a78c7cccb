"""InternVL's NumPy image processor gives mlx-vlm's pixels, bit for bit, with no MLX call."""

from __future__ import annotations

import numpy as np

from support.families import checkpoint
from support.helpers import IMAGES, on_own_thread


def test_numpy_tiles_equal_mlx_vlms(tmp_path):
    from vlmserve.inputs.media import MediaPolicy, decode_image
    from vlmserve.models.internvl_chat.processing import InternVLProcessing
    from vlmserve.models.processor import load_processor

    processor = load_processor(checkpoint("internvl_chat", "float32", tmp_path))
    ours = InternVLProcessing().prepare_processor(processor, None).image_processor
    images = [
        decode_image(p.read_bytes(), MediaPolicy()) for p in sorted(IMAGES.glob("*.png")) + sorted(IMAGES.glob("*.jpg"))
    ]
    for batch in ([images[0]], images[1:3]):
        got = ours.preprocess(batch)

        def upstream(b=batch):
            out = processor.image_processor.preprocess(b)
            return np.array(out["pixel_values"]), out["num_patches_list"]

        pixels, tiles = on_own_thread(upstream)
        assert isinstance(got["pixel_values"], np.ndarray) and got["num_patches_list"] == tiles
        np.testing.assert_array_equal(got["pixel_values"], pixels)
