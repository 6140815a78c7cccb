"""LLaVA-NeXT preprocessing (the CPU half of the family's adapter; no MLX)."""

from __future__ import annotations

from vlmserve.models.base import ProcessorAdapter


class LlavaNextProcessing(ProcessorAdapter):
    # mlx-vlm's LLaVA-NeXT embeds only the first image of a prompt (`pixel_values[0]`): a
    # request with more is refused rather than answered about one image.
    max_images = 1
