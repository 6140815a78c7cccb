"""Mistral 3: Ministral 3's text model's llama-4 query scaling per row, and Pixtral's vision
tower one image at a time, unmasked (models/pixtral/tower.py).

mlx_vlm's Ministral 3 forward scales every query by its position past the rope's original
length (1 + beta * log(1 + floor(p / original))), with the positions of the first row of the
batch (`cache[0].offset[0].item()`) for every row. In a batch that is another row's position;
in a left-padded batch (rows prefilled together) row 0's padding has negative positions, whose
scale is -inf, and the NaNs it makes reach every row through the keys. The `.item()` also
keeps a compiled decode step from tracing the forward. Here each row takes its own positions
(padding at position 0, scale 1), as an array: a row alone gets the very values mlx_vlm
computes.

The swap is per module instance (its class is replaced by a subclass), so only the model the
server loaded changes.
"""

from __future__ import annotations

import sys

import mlx.core as mx

from vlmserve.models.pixtral.adapter import PixtralModel


def llama4_scale(offset, length: int, beta: float, original: int) -> mx.array:
    """Each query's scale for `length` positions from `offset` (a number, or one per row):
    (length, 1), or (rows, 1, length, 1) to broadcast over (rows, heads, length, dim)."""
    steps = mx.arange(length)
    per_row = isinstance(offset, mx.array) and offset.ndim == 1
    positions = offset.reshape(-1, 1) + steps if per_row else steps + offset
    positions = mx.maximum(positions, 0)  # a left-padded row's padding
    scale = 1 + beta * mx.log(1 + mx.floor(positions / original))
    return scale[:, None, :, None] if per_row else scale[:, None]


def _make_class(base: type) -> type:
    module = sys.modules[base.__module__]

    def __call__(self, inputs: mx.array, cache=None, inputs_embeds: mx.array | None = None):
        h = self.embed_tokens(inputs) if inputs_embeds is None else inputs_embeds
        if cache is None:
            cache = [None] * len(self.layers)
        fa_mask = module.create_attention_mask(h, cache[self.fa_idx])
        swa_mask = None
        if self.swa_idx is not None:
            swa_mask = module.create_attention_mask(h, cache[self.swa_idx], window_size=self.sliding_window)
        rope = self.config.rope_parameters
        offset = 0 if cache[0] is None else cache[0].offset
        attn_scale = llama4_scale(
            offset, h.shape[1], rope["llama_4_scaling_beta"], rope["original_max_position_embeddings"]
        ).astype(h.dtype)
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, attn_scale, swa_mask if layer.use_sliding else fa_mask, cache=layer_cache)
        return self.norm(h)

    return type(f"PerRow{base.__name__}", (base,), {"__call__": __call__})


_CLASSES: dict[type, type] = {}


def install(text_model) -> bool:
    """Swap a Ministral 3 text model's forward for the per-row one; False for other text models."""
    base = type(text_model)
    if base in _CLASSES.values():
        return False
    if base.__name__ != "Ministral3" or not base.__module__.startswith("mlx_vlm.models.mistral3"):
        return False
    if base not in _CLASSES:
        _CLASSES[base] = _make_class(base)
    text_model.__class__ = _CLASSES[base]
    return True


class Mistral3Model(PixtralModel):
    def install_fast_paths(self) -> None:
        install(self.language_model.model)
        super().install_fast_paths()
