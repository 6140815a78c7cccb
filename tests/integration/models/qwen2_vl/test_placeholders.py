"""Qwen-VL image placeholders expanded after tokenizing (models/qwen2_vl/placeholders.py) give the
processor's ids and inputs; a text whose placeholders do not match its images, or a call it does
not take, goes to the processor itself."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from support.helpers import MODELS
from vlmserve.models.processor import load_processor
from vlmserve.models.qwen2_vl.placeholders import ExpandedPlaceholders, expand_placeholders


@pytest.fixture(scope="module")
def processor():
    return load_processor(MODELS / "qwen2_vl")


def _images(*sizes):
    rng = np.random.default_rng(len(sizes))
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def _same(want, got):
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)


def test_same_ids_and_inputs_as_the_processor(processor):
    fast = expand_placeholders(processor)
    assert isinstance(fast, ExpandedPlaceholders)
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    prompts = [
        (f"<|im_start|>user\n{pad}Describe it.<|im_end|>\n<|im_start|>assistant\n", [(56, 84)]),
        (f"<|im_start|>user\n{pad} then {pad}\n  and more<|im_end|>\n", [(300, 410), (28, 140)]),
        (f"{pad}{pad}{pad}", [(90, 90), (60, 200), (33, 20)]),
        (
            f"<|im_start|>user\nhi {pad}<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n<|im_start|>user\nwhy?",
            [(64, 64)],
        ),
    ]
    for text, sizes in prompts:
        images = _images(*sizes)
        want = processor(images=images, text=[text], return_tensors="np")
        got = fast(images=images, text=[text], return_tensors="np")
        assert int((np.asarray(got["input_ids"]) == processor.image_token_id).sum()) > len(images)
        _same(want, got)


def test_calls_it_does_not_take_go_to_the_processor(processor):
    fast = ExpandedPlaceholders(processor)
    calls = []

    class Recording:
        image_token, image_token_id = processor.image_token, processor.image_token_id

        def __call__(self, **kwargs):
            calls.append(sorted(kwargs))
            return processor(**kwargs)

    fast.inner = Recording()
    one = _images((56, 56))
    fast(images=one, text=["no placeholder here"], return_tensors="np")  # placeholders != images
    fast(images=_images((56, 56), (28, 28)), text=["<|image_pad|>a", "<|image_pad|>b"], return_tensors="np")  # two
    fast(text=["text only"], return_tensors="np")
    assert calls == [["images", "return_tensors", "text", "videos"]] * 3
