"""Reuse of an image's rows of the prompt embedding, for families without a feature path of
their own: a later turn about the same picture, or another question about it, skips the
vision tower.

Most families merge their vision features into the prompt embedding at the image placeholder
tokens and nowhere else. Their rows there are then the image's features, as the language model
reads them: a request whose images (by content hash) were embedded before takes its text
embedding from the model's own text path and puts the remembered rows back at its placeholders.

Deepstack models (Qwen3-VL) also hand some language layers the image's rows again: those are
kept with it, and the images' M-RoPE positions are computed as the image path computes them.

That holds only where the merge is that simple. So it is checked once per model, on its first
image prompt: the prompt rebuilt this way must equal the model's own, bit for bit (embedding,
positions, every extra input). A family that merges otherwise (a merge that changes the
prompt's length, an attention mask only images bring) fails the check and keeps running its
tower for every request.

Limits: the check runs once, on the model's first image prompt (usually warm-up's one image),
and takes a merge that places one image's rows in order to place several the same way. The
key is a prompt's images together, in order: a chat that adds an image each turn reuses
nothing for that turn (its prompt KV, keyed by content, still is).
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)


class ImageRows:
    def __init__(self, image_token_id: int | None):
        self.image_token_id = image_token_id
        self.works: bool | None = None  # None until the first image prompt has been checked

    def key(self, image_hashes: tuple[str, ...], prompt_ids: np.ndarray) -> tuple[str, np.ndarray] | None:
        """The cache key of a prompt's images together, and the positions of their rows (None: no
        reuse for this prompt)."""
        if self.works is False or self.image_token_id is None or not image_hashes:
            return None
        positions = np.flatnonzero(prompt_ids == self.image_token_id)
        return ("rows:" + "|".join(image_hashes), positions) if len(positions) else None

    @staticmethod
    def take(embeds: mx.array, positions: np.ndarray) -> mx.array:
        """The rows at `positions` of a (1, L, H) embedding."""
        return embeds[0, mx.array(positions)]

    @staticmethod
    def place(text_embeds: mx.array, positions: np.ndarray, rows: mx.array) -> mx.array:
        """`text_embeds` in the rows' dtype with the rows at `positions`."""
        embeds = text_embeds.astype(rows.dtype)
        embeds[:, mx.array(positions)] = rows[None]
        return embeds

    def check(self, model_type: str, own: Any, rebuilt: Any) -> bool:
        """Record whether the rebuilt prompt state equals the model's own (see the module's docstring)."""
        self.works = _same(own, rebuilt)
        log.info(
            "%s: image embedding rows %s reused across requests about the same images",
            model_type,
            "are" if self.works else "are not (the model's merge is not a plain placement)",
        )
        return self.works


def _same(a: Any, b: Any) -> bool:
    """Whether two prompt states (or parts of them) hold the same values, types and dtypes."""
    if isinstance(a, mx.array) or isinstance(b, mx.array):
        return (
            isinstance(a, mx.array)
            and isinstance(b, mx.array)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(mx.array_equal(a, b).item())
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
