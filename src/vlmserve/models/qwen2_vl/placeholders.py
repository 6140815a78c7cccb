"""Qwen-VL prompt ids without tokenizing every image placeholder.

The processor writes each image's placeholder out as one `<|image_pad|>` per image token (1,020
for a 1024x768 image) and tokenizes that text: for an image chat's follow-up turn the tokenizer
took ~5 ms of its ~7 ms of preprocessing on those placeholders. The placeholder is an added
token, so the tokenizer splits the text at each one, and the ids of the text around them do not
depend on how many there are: tokenizing one per image and repeating its id gives the same ids.
`expand_placeholders` checks that on a probe before it is used, and keeps the processor's own
path on any difference (another tokenizer or processor class, a new mlx_vlm).
"""

from __future__ import annotations

import logging

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

# What the fast path takes besides text and images; anything else goes to the processor.
_PLAIN_KWARGS = frozenset({"return_tensors", "add_special_tokens"})


class ExpandedPlaceholders:
    """Stands in for a Qwen-VL processor: the same outputs, its image placeholders expanded
    after tokenizing instead of before."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):  # tokenizer, chat_template, image_processor, ... as the processor has them
        if name == "inner":  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        images = images if images is None or isinstance(images, (list, tuple)) else [images]
        texts = text if isinstance(text, list) else [text]
        token = self.inner.image_token
        if (
            not images
            or videos is not None
            or set(kwargs) - _PLAIN_KWARGS
            or len(texts) != 1
            or not isinstance(texts[0], str)
            or texts[0].count(token) != len(images)
        ):
            return self.inner(images=images, text=text, videos=videos, **kwargs)
        image_inputs = dict(self.inner.image_processor(images=images))
        grid = np.asarray(image_inputs["image_grid_thw"]).reshape(-1, 3)
        counts = grid.prod(axis=1) // self.inner.image_processor.merge_size**2
        tokenizing = {k: v for k, v in kwargs.items() if k != "return_tensors"}
        ids = np.asarray(self.inner.tokenizer(texts, **tokenizing)["input_ids"][0], dtype=np.int64)
        at = np.flatnonzero(ids == self.inner.image_token_id)
        if len(at) != len(images):  # the text's tokens do not line up with its images: the processor decides
            return self.inner(images=images, text=text, videos=videos, **kwargs)
        repeats = np.ones(len(ids), dtype=np.int64)
        repeats[at] = counts
        ids = np.repeat(ids, repeats)[None]
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), **image_inputs}


def expand_placeholders(processor):
    """An ExpandedPlaceholders over this processor when it gives the processor's ids on a probe
    (two images of different sizes, text around and between them), else the processor."""
    try:
        token = processor.image_token
        fast = ExpandedPlaceholders(processor)
        rng = np.random.default_rng(0)
        images = [Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8)) for size in ((61, 97, 3), (120, 56, 3))]
        text = f"<|im_start|>user\n{token} a {token}b  c<|im_end|>\n<|im_start|>assistant\n"
        want = np.asarray(processor(images=images, text=[text], return_tensors="np")["input_ids"]).reshape(-1)
        got = fast(images=images, text=[text], return_tensors="np")["input_ids"].reshape(-1)
        same = np.array_equal(want, got) and int((want == processor.image_token_id).sum()) > len(images)
    except Exception:  # noqa: BLE001 - an unexpected processor keeps its own path
        log.warning("expanding Qwen-VL image placeholders after tokenizing failed its self-check", exc_info=True)
        return processor
    if not same:
        log.warning("expanding image placeholders after tokenizing differs for %s; not used", type(processor).__name__)
        return processor
    return fast
