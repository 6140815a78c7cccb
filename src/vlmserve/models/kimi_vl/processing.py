"""Kimi-VL's CPU half without MLX: mlx-vlm's KimiVLProcessor builds mx.arrays (and evaluates
them) inside the image processor and its __call__, on whatever thread calls it. This twin does
the same arithmetic in NumPy (float32, same order), so preprocessing never touches MLX."""

from __future__ import annotations

import copy
import types

import numpy as np
from PIL import Image
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_utils import make_list_of_images

from vlmserve.models.base import ProcessorAdapter


def _preprocess_numpy(self, images, return_tensors=None, **kwargs) -> BatchFeature:
    pixel_values, grid_hws = [], []
    for image in make_list_of_images(images):
        if not isinstance(image, Image.Image):
            image = Image.fromarray(np.asarray(image))
        image = self.rescale(image, self.merge_kernel_size)  # PIL only
        arr = np.asarray(image.convert("RGB"), dtype=np.float32) / np.float32(255.0)
        arr = arr.transpose(2, 0, 1)
        mean = np.asarray(self.image_mean, dtype=np.float32).reshape(3, 1, 1)
        std = np.asarray(self.image_std, dtype=np.float32).reshape(3, 1, 1)
        arr = (arr - mean) / std
        c, h, w = arr.shape
        p = self.patch_size
        patches = arr.reshape(c, h // p, p, w // p, p).transpose(1, 3, 0, 2, 4).reshape(-1, c, p, p)
        pixel_values.append(patches)
        grid_hws.append((h // p, w // p))
    return BatchFeature(
        data={
            "pixel_values": np.concatenate(pixel_values, axis=0),
            "image_grid_hws": np.asarray(grid_hws, dtype=np.int32),
            "_grid_shapes": [tuple(g) for g in grid_hws],
        }
    )


def _call_numpy(self, images=None, text=None, **kwargs) -> BatchFeature:
    image_inputs = self.image_processor(images) if images is not None else {}
    if isinstance(text, str):
        text = [text]
    text = list(text)
    if images is not None:
        merge = self.image_processor.merge_kernel_size[0] * self.image_processor.merge_kernel_size[1]
        grids = iter(image_inputs["image_grid_hws"])
        for i, sample in enumerate(text):
            while self.image_token in sample:
                n = int(np.prod(next(grids))) // merge
                sample = sample.replace(self.image_token, "<|placeholder|>" * n, 1)
            text[i] = sample.replace("<|placeholder|>", self.image_token)
    ids = [self.tokenizer.encode(t) for t in text]
    width = max(len(x) for x in ids)
    pad = self.tokenizer.pad_token_id or 0
    data = {
        "input_ids": np.asarray([x + [pad] * (width - len(x)) for x in ids], dtype=np.int32),
        "attention_mask": np.asarray([[1] * len(x) + [0] * (width - len(x)) for x in ids], dtype=np.int32),
        **image_inputs,
    }
    data["image_token_id"] = int(self.tokenizer.convert_tokens_to_ids(self.image_token))
    return BatchFeature(data=data)


class KimiVLProcessing(ProcessorAdapter):
    def prepare_processor(self, processor, pixel_dtype, max_pixels=None):
        # On copies: the loaded processor may serve elsewhere (tests, a second server).
        processor = copy.copy(processor)
        processor.image_processor = copy.copy(processor.image_processor)
        processor.image_processor.preprocess = types.MethodType(_preprocess_numpy, processor.image_processor)
        # Python looks __call__ up on the type: the copy gets a subclass with the NumPy one.
        processor.__class__ = type("KimiVLNumpyProcessor", (type(processor),), {"__call__": _call_numpy})
        return processor
