"""Pixel arrays in the dtype a vision tower takes, made on the CPU (NumPy only, no MLX).

A model whose tower casts its pixels first (ModelInfo.pixel_dtype) can be sent them already cast:
half the bytes to copy, and the same values, as the cast rounds the way MLX's does. NumPy has no
bfloat16, so bfloat16 travels as its bit patterns in uint16 (PreparedRequest.bfloat16_inputs).
"""

from __future__ import annotations

import numpy as np
from PIL import Image


def image_bytes(image: Image.Image) -> int:
    """What a decoded image holds in memory: width x height x bands."""
    return image.width * image.height * len(image.getbands())


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 rounded to nearest even (as MLX casts), as uint16 bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    t = bits >> 16  # in place from here: a 448² image is 4.8 MB per pass
    t &= 1
    t += 0x7FFF
    t += bits
    t >>= 16
    out = t.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def cast_pixels(x: np.ndarray, pixel_dtype: str | None) -> np.ndarray:
    """float32 pixels -> what the model's vision tower takes (bfloat16 as uint16 bits)."""
    if pixel_dtype == "bfloat16":
        return to_bfloat16_bits(x)
    if pixel_dtype == "float16":
        return x.astype(np.float16)
    return x
