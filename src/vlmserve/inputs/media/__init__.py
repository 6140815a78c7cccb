"""Image ingest: bytes in, RGB PIL images out. No MLX, no HTTP-server code.

All functions are synchronous and may block (network, decode): call them from the CPU
preprocessing pool, never from the event loop. Every failure raises MediaError with
code "invalid_image_url" or "invalid_image" and a client-safe message.
"""

from vlmserve.inputs.media.cache import ImageCache
from vlmserve.inputs.media.decode import decode_image, sniff_format
from vlmserve.inputs.media.errors import INVALID_IMAGE, INVALID_IMAGE_URL, MediaError
from vlmserve.inputs.media.fetch import FetchCancel, load_image_bytes
from vlmserve.inputs.media.policy import MediaPolicy

__all__ = [
    "INVALID_IMAGE",
    "INVALID_IMAGE_URL",
    "ImageCache",
    "MediaError",
    "MediaPolicy",
    "decode_image",
    "FetchCancel",
    "load_image_bytes",
    "sniff_format",
]
