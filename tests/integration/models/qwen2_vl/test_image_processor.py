"""The fast Qwen-VL pixel path gives the processor's bits, cast as the model casts them."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from support.helpers import MODELS
from vlmserve.models.processor import load_processor
from vlmserve.models.qwen2_vl.image_processor import QwenImages, cast_pixels, fast_qwen_images, unpack_patches
from vlmserve.protocol import ChatMessage, ChatRequest, SamplingParams


@pytest.fixture(scope="module")
def image_processor():
    return load_processor(MODELS / "qwen2_vl").image_processor


def _image(rng, h, w, mode):
    if mode == "L":
        return Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8), "L")
    channels = 4 if mode == "RGBA" else 3
    return Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8), mode)


def _patches(out):
    """Pixel values from either form: the packed one unpacked the NumPy way."""
    if "pixel_bytes" not in out:
        return out["pixel_values"]
    assert out["pixel_bytes"].dtype == np.uint8 and out["pixel_table"].shape == (3, 256)
    return unpack_patches(out["pixel_bytes"], out["pixel_table"], out["image_grid_thw"], out["pixel_layout"])


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", None])
def test_same_bits_as_the_processor(image_processor, dtype, packed):
    fast = fast_qwen_images(image_processor, dtype, packed=packed)
    assert isinstance(fast, QwenImages)
    rng = np.random.default_rng(7)
    # Sizes the processor keeps, shrinks (fixture max 224x224) and grows; RGBA and grey too;
    # several images in one call (concatenated in order).
    cases = [
        [_image(rng, 56, 84, "RGB")],
        [_image(rng, 300, 410, "RGB")],
        [_image(rng, 20, 33, "RGB")],
        [_image(rng, 131, 77, "RGBA")],
        [_image(rng, 90, 90, "L")],
        [_image(rng, 56, 56, "RGB"), _image(rng, 170, 99, "RGB"), _image(rng, 28, 140, "RGB")],
    ]
    for images in cases:
        want = image_processor(images=images)
        expected = cast_pixels(np.asarray(want["pixel_values"]), dtype)
        for _ in range(2):  # the second call takes the resized frames remembered for these objects
            got = fast(images=images)
            np.testing.assert_array_equal(got["image_grid_thw"], want["image_grid_thw"])
            assert ("pixel_values" not in got) == packed
            assert _patches(got).dtype == expected.dtype
            np.testing.assert_array_equal(_patches(got), expected)


def test_a_remembered_frame_is_per_image_object_and_size(image_processor):
    """The same decoded object at another size cap is resized again; an equal but distinct object
    is its own entry."""
    rng = np.random.default_rng(3)
    image = _image(rng, 300, 410, "RGB")
    small = fast_qwen_images(image_processor, "bfloat16", packed=True, max_pixels=56 * 56)
    large = fast_qwen_images(image_processor, "bfloat16", packed=True)
    for fast in (large, small, large, small):
        got = fast(images=[image])
        want = image_processor(images=[image], **fast.size_limits)
        np.testing.assert_array_equal(got["image_grid_thw"], want["image_grid_thw"])
        np.testing.assert_array_equal(_patches(got), cast_pixels(np.asarray(want["pixel_values"]), "bfloat16"))
    twin = image.copy()
    twin.putpixel((0, 0), (1, 2, 3))  # a distinct object, changed after copying: not the first's frame
    np.testing.assert_array_equal(
        _patches(large(images=[twin])),
        cast_pixels(np.asarray(image_processor(images=[twin])["pixel_values"]), "bfloat16"),
    )


def test_other_inputs_take_the_processors_path(image_processor):
    """Arrays or processor options are the processor's business; the pixels still come cast."""
    fast = fast_qwen_images(image_processor, "bfloat16")
    array = np.random.default_rng(1).integers(0, 256, (3, 56, 56), dtype=np.uint8)
    want = image_processor(images=[array])
    got = fast(images=[array])
    np.testing.assert_array_equal(got["pixel_values"], cast_pixels(np.asarray(want["pixel_values"]), "bfloat16"))
    assert fast.merge_size == image_processor.merge_size  # the rest reads through


def test_a_processor_that_differs_keeps_its_own_path(image_processor, monkeypatch):
    original = type(image_processor).__call__

    def shifted(self, *args, **kwargs):  # what a changed mlx_vlm could do: other values
        out = original(self, *args, **kwargs)
        out["pixel_values"] = out["pixel_values"] + 1e-3
        return out

    monkeypatch.setattr(type(image_processor), "__call__", shifted)
    assert fast_qwen_images(image_processor, "bfloat16") is None
    assert fast_qwen_images(image_processor, "bfloat16", packed=True) is None


def test_a_wrapped_processor_is_rewrapped_for_another_dtype(image_processor):
    """Two servers sharing one processor object each get their own model's dtype."""
    bf16 = fast_qwen_images(image_processor, "bfloat16")
    fp16 = fast_qwen_images(bf16, "float16")
    assert fp16.inner is image_processor and fp16.table.dtype == np.float16


def test_preprocessors_sharing_a_processor_keep_their_own_dtypes():
    from vlmserve.config import ServerConfig
    from vlmserve.inputs.preprocess import Preprocessor

    processor = load_processor(MODELS / "qwen2_vl")
    plain = Preprocessor(processor, 4096, ServerConfig(), pixel_dtype=None, model_type="qwen2_vl")
    halves = Preprocessor(plain.processor, 4096, ServerConfig(), pixel_dtype="float16", model_type="qwen2_vl")
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (56, 56, 3), dtype=np.uint8))
    prompt = plain.render(ChatRequest([ChatMessage("user", [("image", None), ("text", "hi")])], SamplingParams()))
    # Preprocessing ships packed frames; the table holds the finished values in the model's dtype.
    assert plain.encode(prompt, [image]).model_inputs["pixel_table"].dtype == np.float32
    assert halves.encode(prompt, [image]).model_inputs["pixel_table"].dtype == np.float16
    plain.close()
    halves.close()


@pytest.mark.parametrize("max_pixels", [12_000, 20_000, 38_000])
def test_max_pixels_is_the_processors_one_resize_and_the_grid_obeys_it(max_pixels):
    """--max-pixels lowers the image processor's own size limit: the image is resized once, by the
    processor's smart resize, to a patch-aligned grid of at most max_pixels (for any aspect ratio up
    to max_pixels / factor², past which one factor-wide row is already more)."""
    from vlmserve.config import ServerConfig
    from vlmserve.inputs.preprocess import Preprocessor

    processor = load_processor(MODELS / "qwen2_vl")
    inner = processor.image_processor
    factor = inner.patch_size * inner.merge_size
    pre = Preprocessor(processor, 4096, ServerConfig(max_pixels=max_pixels), model_type="qwen2_vl")
    assert pre.adapter.caps_in_processor
    limits = pre.processor.image_processor.size_limits
    assert limits["max_pixels"] == min(inner.max_pixels, max_pixels)
    prompt = pre.render(ChatRequest([ChatMessage("user", [("image", None), ("text", "hi")])], SamplingParams()))
    rng = np.random.default_rng(max_pixels)
    sizes = [(195, 194), (10, 10), (28, 28), (1000, 1000), (33, 400)] + [
        tuple(int(v) for v in rng.integers(8, 1200, 2)) for _ in range(300)
    ]
    checked = 0
    for h, w in sizes:
        if max(h, w) / min(h, w) > max_pixels / factor**2:
            continue
        image = Image.new("RGB", (w, h))
        assert pre.adapter.cap_image(image, max_pixels) is image  # no resize before the processor's
        gh, gw = inner._resolved_size(h, w, **limits)
        assert gh % factor == 0 and gw % factor == 0 and gh * gw <= max_pixels, (h, w, gh, gw)
        checked += 1
    assert checked > 100
    # Through preprocessing: the shipped grid and frames are that one resize's, with the
    # processor's own bits at the lowered limit.
    for h, w in [(195, 194), (300, 410), (90, 700)]:
        image = _image(rng, h, w, "RGB")
        out = pre.encode(prompt, [pre.adapter.cap_image(image, max_pixels)]).model_inputs
        _, gh, gw = (int(v) for v in out["image_grid_thw"][0])
        ps = inner.patch_size
        assert (gh * ps) * (gw * ps) <= max_pixels and gh % inner.merge_size == 0 and gw % inner.merge_size == 0
        assert out["pixel_bytes"].size == gh * ps * gw * ps * 3
        want = inner(images=[image], **limits)
        np.testing.assert_array_equal(out["image_grid_thw"], want["image_grid_thw"])
        np.testing.assert_array_equal(_patches(out), want["pixel_values"])
    pre.close()


def test_max_pixels_falls_back_to_a_resize_first_without_the_fast_path(monkeypatch):
    """Where the processor's twin does not take it (another processor class), the cap is the
    generic one: a resize before the processor."""
    from vlmserve.config import ServerConfig
    from vlmserve.inputs.preprocess import Preprocessor
    from vlmserve.models.qwen2_vl import processing

    monkeypatch.setattr(processing, "fast_qwen_images", lambda *args, **kwargs: None)
    processor = load_processor(MODELS / "qwen2_vl")
    pre = Preprocessor(processor, 4096, ServerConfig(max_pixels=20_000), model_type="qwen2_vl")
    assert not pre.adapter.caps_in_processor and getattr(pre.processor, "inner", pre.processor) is processor
    capped = pre.adapter.cap_image(Image.new("RGB", (400, 300)), 20_000)
    assert capped.width * capped.height <= 20_000
    pre.close()
