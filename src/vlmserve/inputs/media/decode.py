"""Bytes -> RGB PIL image, treating every byte as hostile.

- data: URIs must be base64 (`data:image/<type>;base64,...`); bare base64 is accepted too.
  Decoding is strict (validate=True); only whitespace is tolerated.
- The real format is sniffed from magic bytes (PNG, JPEG, WEBP, GIF); the declared type is ignored.
- The pixel count is checked from the header before any pixel is decoded; Pillow's
  DecompressionBombWarning is an error too.
- First frame only; EXIF orientation applied; alpha/transparency flattened onto white.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings

import numpy as np
from PIL import ExifTags, Image, ImageOps

try:  # SIMD base64 (a dependency): the stdlib's decoder takes ~16 ms for a 2.4 MB image, holding the GIL
    from pybase64 import b64decode as fast_b64decode
except ImportError:  # pragma: no cover - an install without it still decodes, slower
    from base64 import b64decode as fast_b64decode

from vlmserve.inputs.media.errors import MediaError, image_error
from vlmserve.inputs.media.policy import MediaPolicy

_WHITESPACE = re.compile(r"\s+")
_DATA_URI = re.compile(r"^data:([^,]*),", re.IGNORECASE | re.DOTALL)
_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


def decode_data_uri(uri: str, policy: MediaPolicy) -> bytes:
    """`data:image/<type>;base64,<payload>` -> raw bytes. Raises MediaError."""
    match = _DATA_URI.match(uri)
    if match is None:
        raise image_error("data URI is malformed")
    params = [p.strip().lower() for p in match.group(1).split(";")]
    if not params[0].startswith("image/"):
        raise image_error("data URI must have an image/* media type")
    if params[-1] != "base64":
        raise image_error("data URI must be base64-encoded")
    return decode_base64_payload(uri[match.end() :], policy)


def decode_base64_payload(payload: str, policy: MediaPolicy) -> bytes:
    # Size check before allocating the decoded copy: 4 chars -> 3 bytes.
    max_chars = 4 * (-(-policy.max_image_bytes // 3))
    if len(payload) > 2 * max_chars + 4096:  # generous room for line breaks before stripping
        raise image_error(f"image exceeds {policy.max_image_bytes} bytes")
    try:  # the common case has no line breaks: decode as is (a regex pass costs ~1 ms per 100 KB, under the GIL)
        if len(payload) > max_chars:
            raise binascii.Error
        data = fast_b64decode(payload, validate=True)
    except (binascii.Error, ValueError):  # line breaks, or what only the stdlib accepts
        compact = _WHITESPACE.sub("", payload)
        if len(compact) > max_chars:
            raise image_error(f"image exceeds {policy.max_image_bytes} bytes") from None
        try:
            data = fast_b64decode(compact, validate=True)
        except (binascii.Error, ValueError):
            try:  # the stdlib's rules decide what is accepted: it takes excess padding, for one
                data = base64.b64decode(compact, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise image_error("image data is not valid base64") from exc
    if not data:
        raise image_error("image data is empty")
    if len(data) > policy.max_image_bytes:
        raise image_error(f"image exceeds {policy.max_image_bytes} bytes")
    return data


def sniff_format(data: bytes) -> str | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def decode_image(data: bytes, policy: MediaPolicy) -> Image.Image:
    """Raw bytes -> fully loaded RGB image (first frame). Raises MediaError(code="invalid_image")."""
    if len(data) > policy.max_image_bytes:
        raise image_error(f"image exceeds {policy.max_image_bytes} bytes")
    fmt = sniff_format(data)
    if fmt is None:
        raise image_error("image format is not supported (use PNG, JPEG, WEBP or GIF)")
    with warnings.catch_warnings():
        # Pillow's own bomb guard (global Image.MAX_IMAGE_PIXELS) becomes a hard error as well.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=[fmt]) as img:  # lazy: header only
                width, height = img.size
                if width <= 0 or height <= 0:
                    raise image_error("image has no pixels")
                if width * height > policy.max_image_pixels:
                    raise image_error(f"image exceeds {policy.max_image_pixels} pixels")
                img.seek(0)  # first frame of animated GIF/WEBP
                img.load()
                rgb = _to_rgb(_orient(img))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            # Pillow's global Image.MAX_IMAGE_PIXELS, which may be below a lax policy's limit.
            raise image_error("image has too many pixels") from exc
        except MemoryError as exc:
            raise image_error("image is too large to decode") from exc
        except MediaError:
            raise
        except Exception as exc:  # noqa: BLE001 - any decoder failure on hostile input
            raise image_error("image could not be decoded") from exc
    return rgb


def _orient(img: Image.Image) -> Image.Image:
    try:
        if img.getexif().get(ExifTags.Base.Orientation, 1) == 1:
            return img  # upright: exif_transpose would only copy it (the RGB conversion copies once)
        return ImageOps.exif_transpose(img)
    except Exception:  # noqa: BLE001 - a corrupt EXIF block should not reject a good image
        return img


# Pillow's 16- and 32-bit integer grayscale (16-bit PNGs): its RGB conversion clips every
# value past 255 (a 16-bit image turns white), so they are brought to 8 bits first.
_WIDE_GRAY = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in _WIDE_GRAY:
        img = _gray_to_8_bits(img)
    has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info
    if not has_alpha:
        return img.convert("RGB")
    rgba = img.convert("RGBA")  # also applies palette / colour-key transparency
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _gray_to_8_bits(img: Image.Image) -> Image.Image:
    """16-bit grayscale (mode I;16*, or I as older Pillows open 16-bit PNGs) as 8-bit L, each
    value's high byte (as Pillow takes 16-bit RGB PNGs to 8 bits); a colour-key transparency
    becomes an alpha channel."""
    values = np.array(img)  # uint16 (I;16*) or int32 (I): one writable copy, shifted in place
    key = img.info.get("transparency")
    alpha = np.where(values == key, np.uint8(0), np.uint8(255)) if isinstance(key, int) else None
    if values.dtype != np.uint16:
        np.clip(values, 0, 65535, out=values)
    values >>= 8
    gray = Image.fromarray(values.astype(np.uint8), "L")
    return gray if alpha is None else Image.merge("LA", (gray, Image.fromarray(alpha, "L")))
