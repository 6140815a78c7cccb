"""Decoding hostile image bytes: formats, bombs, truncation, frames, EXIF, alpha, base64, cache."""

from __future__ import annotations

import base64
import io
import struct
import threading
import time
import zlib

import pytest
from PIL import Image

from vlmserve.inputs.media import ImageCache, MediaError, MediaPolicy, decode_image, load_image_bytes
from vlmserve.inputs.media import cache as cache_mod
from vlmserve.inputs.media.decode import decode_base64_payload

POLICY = MediaPolicy()


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def noisy(size=(64, 48), mode="RGB") -> Image.Image:
    return Image.frombytes(mode, size, bytes((i * 37 + i // 7) % 256 for i in range(size[0] * size[1] * len(mode))))


def png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def expect(code: str, fn, *args):
    with pytest.raises(MediaError) as info:
        fn(*args)
    assert info.value.code == code
    return info.value


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_supported_formats_decode_to_rgb(fmt):
    img = decode_image(encode(noisy(), fmt), POLICY)
    assert img.mode == "RGB" and img.size == (64, 48)


def test_declared_type_is_ignored_format_is_sniffed():
    png = encode(noisy(), "PNG")
    uri = "data:image/gif;base64," + base64.b64encode(png).decode()
    assert load_image_bytes(uri, POLICY) == png
    assert decode_image(png, POLICY).size == (64, 48)


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "ICO", "PPM"])
def test_unsupported_formats_rejected(fmt):
    err = expect("invalid_image", decode_image, encode(noisy((16, 16)), fmt), POLICY)
    assert "not supported" in err.message


def test_html_and_garbage_rejected():
    expect("invalid_image", decode_image, b"<html><body>hi</body></html>", POLICY)
    expect("invalid_image", decode_image, b"", POLICY)
    expect("invalid_image", decode_image, b"\x89PNG\r\n\x1a\n" + b"\0" * 40, POLICY)


def test_truncated_png_rejected():
    data = encode(noisy((256, 256)), "PNG")
    expect("invalid_image", decode_image, data[: len(data) // 2], POLICY)


def test_truncated_jpeg_rejected():
    data = encode(noisy((256, 256)), "JPEG")
    expect("invalid_image", decode_image, data[: len(data) // 3], POLICY)


def test_huge_declared_dimensions_rejected_without_allocating():
    start = time.monotonic()
    err = expect("invalid_image", decode_image, png_header_only(100_000, 100_000), POLICY)
    assert "pixels" in err.message
    assert time.monotonic() - start < 1.0


def test_policy_pixel_limit_checked_before_load():
    err = expect("invalid_image", decode_image, encode(noisy((20, 20)), "PNG"), MediaPolicy(max_image_pixels=399))
    assert err.message == "image exceeds 399 pixels"
    assert decode_image(encode(noisy((20, 20)), "PNG"), MediaPolicy(max_image_pixels=400)).size == (20, 20)


def test_pillow_bomb_warning_is_an_error():
    # Under a lax policy, Pillow's own DecompressionBombWarning (>89M px) must still reject.
    lax = MediaPolicy(max_image_pixels=10**12)
    expect("invalid_image", decode_image, png_header_only(10_000, 10_000), lax)


def test_byte_limit():
    data = encode(noisy(), "PNG")
    err = expect("invalid_image", decode_image, data, MediaPolicy(max_image_bytes=len(data) - 1))
    assert err.message == f"image exceeds {len(data) - 1} bytes"


def test_animated_gif_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    img = decode_image(buf.getvalue(), POLICY)
    assert img.mode == "RGB" and img.size == (8, 8)
    assert img.getpixel((4, 4)) == (255, 0, 0)


def test_animated_webp_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in [(255, 0, 0), (0, 0, 255)]]
    buf = io.BytesIO()
    frames[0].save(buf, "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    img = decode_image(buf.getvalue(), POLICY)
    assert img.getpixel((4, 4)) == (255, 0, 0)


def test_rgba_flattened_on_white():
    img = Image.new("RGBA", (4, 1))
    img.putdata([(0, 0, 0, 0), (0, 0, 0, 255), (255, 0, 0, 0), (0, 0, 0, 128)])
    out = decode_image(encode(img, "PNG"), POLICY)
    assert out.mode == "RGB"
    assert out.getpixel((0, 0)) == (255, 255, 255)
    assert out.getpixel((1, 0)) == (0, 0, 0)
    assert out.getpixel((2, 0)) == (255, 255, 255)
    assert all(120 <= v <= 135 for v in out.getpixel((3, 0)))


def test_la_and_palette_transparency_flattened_on_white():
    la = Image.new("LA", (2, 1))
    la.putdata([(0, 0), (0, 255)])
    out = decode_image(encode(la, "PNG"), POLICY)
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((1, 0)) == (0, 0, 0)

    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    pal.putdata([0, 1])
    out = decode_image(encode(pal, "GIF", transparency=0), POLICY)
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((1, 0)) == (255, 0, 0)
    out = decode_image(encode(pal, "PNG", transparency=0), POLICY)
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((1, 0)) == (255, 0, 0)


def test_16_bit_grayscale_keeps_its_values():
    """A 16-bit PNG (Pillow's I;16) becomes each value's high byte, not white (Pillow's own RGB
    conversion clips it at 255); a colour-key transparency is flattened on white."""
    import numpy as np

    values = np.tile(np.linspace(0, 65535, 256).astype(np.uint16), (4, 1))
    wide = Image.fromarray(values)
    assert wide.mode.startswith("I")
    out = np.asarray(decode_image(encode(wide, "PNG"), POLICY))
    assert out.shape == (4, 256, 3)
    np.testing.assert_array_equal(out[..., 0], values >> 8)
    assert (out[..., 0] == out[..., 2]).all()

    out = np.asarray(decode_image(encode(wide, "PNG", transparency=int(values[0, 1])), POLICY))
    assert tuple(out[0, 1]) == (255, 255, 255) and out[0, 2, 0] == values[0, 2] >> 8


def test_exif_orientation_applied():
    img = Image.new("RGB", (40, 20), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 20, 20))  # left half red
    exif = Image.Exif()
    exif[0x0112] = 6  # display = rotate 90 degrees clockwise
    out = decode_image(encode(img, "JPEG", exif=exif.tobytes(), quality=95), POLICY)
    assert out.size == (20, 40)
    top, bottom = out.getpixel((10, 5)), out.getpixel((10, 35))
    assert top[0] > 200 and top[2] < 60  # red went to the top
    assert bottom[2] > 200 and bottom[0] < 60


def test_grayscale_and_cmyk_convert_to_rgb():
    assert decode_image(encode(noisy(mode="L"), "PNG"), POLICY).mode == "RGB"
    assert decode_image(encode(noisy(mode="CMYK"), "JPEG"), POLICY).mode == "RGB"


# -- base64 / data URIs (through load_image_bytes, the caller's entry point) ------------------


def test_data_uri_and_bare_base64_with_whitespace():
    png = encode(noisy(), "PNG")
    b64 = base64.b64encode(png).decode()
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))
    assert load_image_bytes("data:image/png;base64," + wrapped, POLICY) == png
    assert load_image_bytes("DATA:image/PNG;BASE64," + b64, POLICY) == png
    assert load_image_bytes(wrapped + "\n", POLICY) == png


@pytest.mark.parametrize(
    "uri",
    [
        "data:image/png;base64,@@@@",
        "data:image/png;base64,iVBORw0KGgo=garbage!",
        "data:image/png;base64,iVBORw0KGgo",  # bad padding
        "data:image/png;base64,",
        "iVBORw0KGgo*AAAA",
        "data:image/png,%89PNG%0D%0A",  # not base64
        "data:text/html;base64,PGh0bWw+",
    ],
)
def test_malformed_data_rejected(uri):
    expect("invalid_image", load_image_bytes, uri, POLICY)


def test_base64_accepts_what_the_stdlib_accepts_and_decodes_the_same():
    """The fast decoder serves what it accepts; anything else gets the stdlib's rules."""
    import os

    payload = os.urandom(30_003)
    b64 = base64.b64encode(payload).decode()
    assert decode_base64_payload(b64, POLICY) == payload
    assert decode_base64_payload(base64.b64encode(b"ABC").decode() + "=", POLICY) == b"ABC"  # excess padding
    with pytest.raises(MediaError):
        decode_base64_payload(b64[:-1], POLICY)


def test_base64_size_limit_before_decoding():
    policy = MediaPolicy(max_image_bytes=100)
    err = expect("invalid_image", load_image_bytes, "data:image/png;base64," + "A" * 10_000, policy)
    assert err.message == "image exceeds 100 bytes"


def test_data_uri_then_decode_roundtrip_pixels():
    src = noisy()
    png = encode(src, "PNG")
    img = decode_image(load_image_bytes("data:image/png;base64," + base64.b64encode(png).decode(), POLICY), POLICY)
    assert img.tobytes() == src.tobytes()


# -- ImageCache --------------------------------------------------------------------------------


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = cache_mod.decode_image

    def wrapper(data, policy):
        calls.append(data)
        time.sleep(0.02)  # widen the window for the concurrency test
        return real(data, policy)

    monkeypatch.setattr(cache_mod, "decode_image", wrapper)
    return calls


def test_cache_decodes_same_bytes_once(counted):
    cache = ImageCache(max_entries=4)
    data = encode(noisy(), "PNG")
    first = cache.get_or_decode(data, POLICY)
    assert cache.get_or_decode(bytes(data), POLICY) is first
    assert len(counted) == 1 and cache.hits == 1 and cache.misses == 1


def test_cache_concurrent_same_bytes_decoded_once(counted):
    cache = ImageCache()
    data = encode(noisy(), "PNG")
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get_or_decode(data, POLICY))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(counted) == 1 and len(results) == 8 and all(r is results[0] for r in results)


def test_cache_lru_eviction_by_entries(counted):
    cache = ImageCache(max_entries=2)
    a, b, c = (encode(Image.new("RGB", (4, 4), (i, 0, 0)), "PNG") for i in (1, 2, 3))
    cache.get_or_decode(a, POLICY)
    cache.get_or_decode(b, POLICY)
    cache.get_or_decode(a, POLICY)  # a is now most recent
    cache.get_or_decode(c, POLICY)  # evicts b
    assert len(cache) == 2 and len(counted) == 3
    cache.get_or_decode(a, POLICY)
    assert len(counted) == 3
    cache.get_or_decode(b, POLICY)
    assert len(counted) == 4


def test_cache_bounded_by_pixels(counted):
    cache = ImageCache(max_entries=100, max_pixels=250)
    imgs = [encode(Image.new("RGB", (10, 10), (i, 0, 0)), "PNG") for i in range(5)]
    for data in imgs:
        cache.get_or_decode(data, POLICY)
    assert len(cache) == 2 and cache.total_pixels == 200
    big = encode(Image.new("RGB", (20, 20)), "PNG")
    cache.get_or_decode(big, POLICY)  # larger than the whole budget: returned, not cached
    assert len(cache) == 2


def test_cache_does_not_cache_failures_and_reapplies_policy(counted):
    cache = ImageCache()
    for _ in range(2):
        expect("invalid_image", cache.get_or_decode, b"not an image", POLICY)
    assert len(counted) == 2 and len(cache) == 0
    data = encode(noisy((20, 20)), "PNG")
    cache.get_or_decode(data, POLICY)
    expect("invalid_image", cache.get_or_decode, data, MediaPolicy(max_image_pixels=100))
