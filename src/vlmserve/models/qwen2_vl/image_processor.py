"""Qwen-VL pixel patches made straight from uint8 images, in the dtype the vision tower takes.

mlx_vlm's Qwen2/2.5/3-VL image processor turns a resized uint8 image into float32 patches in
about ten whole-array NumPy passes (cast, rescale, normalize, a temporal repeat, a transposing
copy, a concatenate); preprocessing then cast them to bfloat16 in several more. Each pass takes
the GIL back from the event loop and the MLX thread. Rescale and normalize map each byte of a
channel to one value, so a 3x256 table of finished values (the processor's own float32
arithmetic, then the model's cast) replaces them, and one transposing copy writes every patch in
the model's order, both temporal frames at once.

Same bits as the processor followed by the cast: `fast_qwen_images` compares both paths on a
random image before it is used, and keeps the processor's path on any difference (a new
mlx_vlm, another processor class).

Packed (`packed=True`, what the server's preprocessing uses): the patches are not built here
at all. The resized uint8 frames, the table and the patch geometry go to the MLX worker, which
does the same lookup and reordering there (packed_pixels.py): a quarter of the bytes
to pickle, pipe and copy into MLX (a 448² image: 0.6 MB against 2.4 MB of bfloat16 patches),
and no arithmetic anywhere, so the same bits.

The operator's resize cap (`max_pixels`, --max-pixels) is applied as the processor's own size
limits: its smart resize is then an image's only resize, and the grid it picks is patch-aligned
and at most `max_pixels` (for any image the processor takes whose aspect ratio is at most
max_pixels / factor², factor = patch_size * merge_size: one factor-wide row is its least).
"""

from __future__ import annotations

import logging

import numpy as np
from PIL import Image

from vlmserve.models.pixels import cast_pixels, image_bytes
from vlmserve.object_memo import ObjectMemo

log = logging.getLogger(__name__)


class QwenImages:
    """Stands in for the processor's `image_processor`: same outputs, cast pixels."""

    def __init__(self, inner, pixel_dtype: str | None, packed: bool = False, max_pixels: int | None = None):
        self.inner = inner
        self.pixel_dtype = pixel_dtype
        self.packed = packed
        self.size_limits = size_limits(inner, max_pixels)
        values = np.arange(256, dtype=np.uint8).astype(np.float32)
        if inner.do_rescale:
            values = values * inner.rescale_factor
        table = np.repeat(values[None], 3, axis=0)
        if inner.do_normalize:  # the processor's own float32 expression, per channel
            table = (table - np.array(inner.image_mean, dtype=np.float32)[:, None]) / np.array(
                inner.image_std, dtype=np.float32
            )[:, None]
        self.table = cast_pixels(table, pixel_dtype)  # float32 throughout, as in the processor

    def __getattr__(self, name):  # merge_size, patch_size, ... as the processor has them
        return getattr(self.inner, name)

    def __call__(self, images=None, **kwargs):
        flat = images if isinstance(images, (list, tuple)) else [images]
        if kwargs or not flat or not all(isinstance(im, Image.Image) for im in flat):
            out = dict(self.inner(images=images, **{**self.size_limits, **kwargs}))
            out["pixel_values"] = cast_pixels(np.asarray(out["pixel_values"]), self.pixel_dtype)
            return out
        ps = self.inner.patch_size
        frames, grids = [], []
        for image in flat:
            h, w = self.inner._resolved_size(image.height, image.width, **self.size_limits)
            frames.append(_FRAMES.get(image, (h, w), lambda image=image, h=h, w=w: _rgb_frame(image, h, w)))
            grids.append([1, h // ps, w // ps])
        packed = {
            "pixel_bytes": np.concatenate(frames),
            "pixel_table": self.table,
            "pixel_layout": np.array(self.layout, dtype=np.int64),
            "image_grid_thw": np.array(grids, dtype=np.int64),
        }
        if self.packed:
            return packed
        return {
            "pixel_values": unpack_patches(packed["pixel_bytes"], self.table, packed["image_grid_thw"], self.layout),
            "image_grid_thw": packed["image_grid_thw"],
        }

    @property
    def layout(self) -> tuple[int, int, int]:
        """(patch size, temporal patch size, merge size): what unpacking needs besides the grids."""
        return self.inner.patch_size, self.inner.temporal_patch_size, self.inner.merge_size


def _rgb_frame(image: Image.Image, h: int, w: int) -> np.ndarray:
    """The image as RGB bytes at (h, w), flat and read-only (it may be shared, see _FRAMES)."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    if (h, w) != (rgb.height, rgb.width):
        rgb = rgb.resize((w, h), resample=Image.BICUBIC)
    frame = np.asarray(rgb).reshape(-1)
    frame.flags.writeable = False
    return frame


# A chat sends its image again every turn, and the image cache hands back the same decoded
# object: its resized frame is made once.
_FRAMES = ObjectMemo(
    max_entries=64,
    max_bytes=512 << 20,
    size=lambda image, frame: image_bytes(image) + frame.nbytes,  # both stay alive
)


def size_limits(inner, max_pixels: int | None) -> dict[str, int]:
    """The processor's size limits lowered to the operator's cap (none: the processor's own)."""
    if not max_pixels:
        return {}
    return {"min_pixels": min(inner.min_pixels, max_pixels), "max_pixels": min(inner.max_pixels, max_pixels)}


def unpack_patches(raw: np.ndarray, table: np.ndarray, grids: np.ndarray, layout) -> np.ndarray:
    """Packed frames -> the processor's patches: packed_pixels.py's `expand` in NumPy."""
    ps, tps, ms = (int(v) for v in layout)
    rows = int(sum(int(gh) * int(gw) for _, gh, gw in grids))
    out = np.empty((rows, 3, tps, ps, ps), dtype=table.dtype)
    start = row = 0
    for _, gh, gw in grids:
        gh, gw = int(gh), int(gw)
        frame = raw[start : start + gh * ps * gw * ps * 3].reshape(gh * ps, gw * ps, 3)
        start += frame.size
        # (H, W, C) bytes -> finished values, then the processor's patch order:
        # (h blocks, w blocks, merge rows, merge cols, channel, frame, patch row, patch col).
        vals = np.stack([table[c][frame[:, :, c]] for c in range(3)])
        vals = vals.reshape(3, gh // ms, ms, ps, gw // ms, ms, ps).transpose(1, 4, 2, 5, 0, 3, 6)
        n = gh * gw
        out[row : row + n].reshape(gh // ms, gw // ms, ms, ms, 3, tps, ps, ps)[...] = vals[:, :, :, :, :, None]
        row += n
    return out.reshape(rows, 3 * tps * ps * ps)


def fast_qwen_images(image_processor, pixel_dtype: str | None, packed: bool = False, max_pixels: int | None = None):
    """A QwenImages over mlx_vlm's Qwen-VL image processor when it gives the same bits, else None.

    `max_pixels`: the operator's resize cap, applied through the processor's own size limits."""
    if isinstance(image_processor, QwenImages):  # a processor shared by two servers: re-wrap for this use
        image_processor = image_processor.inner
    if type(image_processor).__module__.split(".")[0] != "mlx_vlm" or not all(
        hasattr(image_processor, a)
        for a in (
            "_resolved_size",
            "_process_one",
            "temporal_patch_size",
            "merge_size",
            "patch_size",
            "image_mean",
            "image_std",
            "min_pixels",
            "max_pixels",
        )
    ):
        return None
    try:
        fast = QwenImages(image_processor, pixel_dtype, packed, max_pixels)
        rng = np.random.default_rng(0)
        probe = Image.fromarray(rng.integers(0, 256, (61, 97, 3), dtype=np.uint8))  # resized: odd size
        want = image_processor(images=[probe], **fast.size_limits)
        got = fast(images=[probe])
        if packed:
            got = {
                "image_grid_thw": got["image_grid_thw"],
                "pixel_values": unpack_patches(
                    got["pixel_bytes"], got["pixel_table"], got["image_grid_thw"], got["pixel_layout"]
                ),
            }
        same = np.array_equal(got["image_grid_thw"], want["image_grid_thw"]) and np.array_equal(
            got["pixel_values"], cast_pixels(np.asarray(want["pixel_values"]), pixel_dtype)
        )
    except Exception:  # noqa: BLE001 - an unexpected processor keeps its own path
        log.warning("the fast Qwen-VL image path failed its self-check; using the processor's", exc_info=True)
        return None
    if not same:
        log.warning(
            "the fast Qwen-VL image path differs from %s; using the processor's", type(image_processor).__name__
        )
        return None
    return fast
