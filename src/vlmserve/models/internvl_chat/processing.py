"""InternVL preprocessing (the CPU half of the family's adapter; no MLX).

mlx-vlm's InternVL image processor computes its tiles with MLX (`mx.array`, `mx.stack`,
arithmetic) wherever it is called, and preprocessing runs on pool threads: on a GPU those
arrays belong to a stream of another thread. This twin does the same tiling (mlx-vlm's own
`dynamic_preprocess`) and the same float32 arithmetic in NumPy, so the pixels are the same
and no MLX work leaves the engine's worker.
"""

from __future__ import annotations

import copy

import numpy as np
from PIL import Image

from vlmserve.models.base import ProcessorAdapter


class NumpyInternVLImages:
    """Stands in for InternVLImageProcessor: `preprocess` returns NumPy pixel values."""

    def __init__(self, inner):
        from mlx_vlm.models.internvl_chat import processor as upstream

        self.inner = inner
        self._tiles = upstream.dynamic_preprocess
        self._mean = np.asarray(upstream.IMAGENET_MEAN, dtype=np.float32)[:, None, None]
        self._std = np.asarray(upstream.IMAGENET_STD, dtype=np.float32)[:, None, None]

    def __getattr__(self, name):  # size, dynamic_max_num, ... as the processor has them
        return getattr(self.inner, name)

    def preprocess(self, images, return_tensors=None, **kwargs) -> dict:
        ip, size = self.inner, self.inner.size
        per_image = []
        for image in images if isinstance(images, list) else [images]:
            if ip.do_dynamic_preprocess:
                tiles = self._tiles(
                    image,
                    min_num=ip.dynamic_min_num,
                    max_num=ip.dynamic_max_num,
                    image_size=size,
                    use_thumbnail=ip.dynamic_use_thumbnail,
                )
            else:
                tiles = [image.resize((size, size), resample=ip.resample)]
            per_image.append(np.stack([self._transform(tile, size) for tile in tiles]))
        return {"pixel_values": np.concatenate(per_image)[None], "num_patches_list": [t.shape[0] for t in per_image]}

    def _transform(self, tile: Image.Image, size: int) -> np.ndarray:
        if tile.mode != "RGB":
            tile = tile.convert("RGB")
        tile = tile.resize((size, size), resample=Image.Resampling.BICUBIC)
        x = (np.asarray(tile).astype(np.float32) / 255.0).transpose(2, 0, 1)
        return (x - self._mean) / self._std


class InternVLProcessing(ProcessorAdapter):
    def prepare_processor(self, processor, pixel_dtype: str | None, max_pixels: int | None = None):
        processor = copy.copy(processor)  # the loaded processor may serve elsewhere (tests, a second server)
        processor.image_processor = NumpyInternVLImages(processor.image_processor)
        return processor
