"""Preprocessed one-turn chat requests with random images, as the server's preprocessing makes them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from vlmserve.config import ServerConfig
from vlmserve.inputs.preprocess import Preprocessor
from vlmserve.models.processor import load_processor
from vlmserve.models.registry import model_type_of
from vlmserve.protocol import ChatMessage, ChatRequest, SamplingParams


def prepared_chats(path: Path, sizes: list[tuple[int, int] | None], text: str, context: int = 32768) -> list:
    """A request per entry of `sizes`: one random image of that (width, height) and `text`, or
    `text` alone for None."""
    pre = Preprocessor(load_processor(path), context, ServerConfig(), model_type=model_type_of(path))
    rng = np.random.default_rng(0)
    try:
        out = []
        for size in sizes:
            images = (
                [] if size is None else [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))]
            )
            parts = [("image", None)] * len(images) + [("text", text)]
            out.append(pre.encode(pre.render(ChatRequest([ChatMessage("user", parts)], SamplingParams())), images))
        return out
    finally:
        pre.close()
