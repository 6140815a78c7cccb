"""Qwen2-VL / Qwen2.5-VL preprocessing (the CPU half of the family's adapter; no MLX).

- The processor's image processor is swapped for its packed twin (image_processor.py): the same
  bits in far fewer passes, shipped as uint8 frames plus a value table that the worker expands
  on the device (packed_pixels.py).
- Image placeholders are expanded after tokenizing, not before (placeholders.py).
- The operator's resize cap (--max-pixels) becomes the image processor's own size limit, so its
  smart resize is an image's one resize, instead of a resize to the cap followed by the
  processor's resize to its patch grid. Where the twin does not take the processor (another
  processor class, a failed self-check), the generic cap (a resize before the processor) stays.
"""

from __future__ import annotations

import copy

from PIL import Image

from vlmserve.models.base import ProcessorAdapter
from vlmserve.models.qwen2_vl.image_processor import fast_qwen_images
from vlmserve.models.qwen2_vl.placeholders import ExpandedPlaceholders, expand_placeholders


class QwenVLProcessing(ProcessorAdapter):
    # The packed path's value table is shipped cast too.
    bfloat16_inputs = ("pixel_values", "pixel_table")

    def __init__(self) -> None:
        self.caps_in_processor = False  # set by prepare_processor: the image processor applies max_pixels

    def prepare_processor(self, processor, pixel_dtype: str | None, max_pixels: int | None = None):
        if isinstance(processor, ExpandedPlaceholders):  # a processor shared by two servers: wrap it anew
            processor = processor.inner
        fast = fast_qwen_images(getattr(processor, "image_processor", None), pixel_dtype, True, max_pixels)
        self.caps_in_processor = fast is not None
        if fast is not None:
            # On a copy: the processor may serve another dtype or cap elsewhere (a second server, tests).
            processor = copy.copy(processor)
            processor.image_processor = fast
        return expand_placeholders(processor)

    def cap_image(self, image: Image.Image, max_pixels: int | None) -> Image.Image:
        if self.caps_in_processor:
            return image
        return super().cap_image(image, max_pixels)
