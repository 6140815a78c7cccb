"""Qwen3-VL's vision tower call without reading the device back.

mlx_vlm's `VisionModel.__call__` reads device arrays back several times per image: the grid's
largest side (`.item()`), each image's position-embedding indices and weights (eight
`tolist()`s of arrays it has just computed) and each image's frame count (`int(grid_thw[i, 0])`).
Each read waits for whatever the GPU stream holds (a decode step, the previous request's
tower). Here the grid is read once, as the call's input, the integers (positions, segment
bounds) come from NumPy, and the interpolation's indices and weights stay on the device, made
by the same ops; the features and deepstack features are bit-identical to mlx_vlm's (tests
compare them).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_vlm.models.qwen3_vl.vision import VisionModel as Qwen3VLVisionModel

from vlmserve.models.qwen2_vl import embedding  # the Qwen-VL towers' host-side indices

# The methods `tower_call` mirrors: a tower class that overrides any of them keeps its own call.
_MIRRORED = ("__call__", "rot_pos_emb", "fast_pos_embed_interpolate")


def _position_embeddings(tower: Any, grids: np.ndarray) -> mx.array:
    """`fast_pos_embed_interpolate`: the same device ops per image, its indices and weights
    concatenated on the device instead of read back and rebuilt."""
    side = tower.num_grid_per_side
    indices: list[list[mx.array]] = [[] for _ in range(4)]
    weights: list[list[mx.array]] = [[] for _ in range(4)]
    for _, h, w in grids.tolist():
        h_idx, w_idx = mx.linspace(0, side - 1, h), mx.linspace(0, side - 1, w)
        h_floor, w_floor = h_idx.astype(mx.int32), w_idx.astype(mx.int32)
        h_ceil, w_ceil = mx.minimum(h_floor + 1, side - 1), mx.minimum(w_floor + 1, side - 1)
        dh, dw = h_idx - h_floor.astype(mx.float32), w_idx - w_floor.astype(mx.float32)
        base, base_ceil = h_floor * side, h_ceil * side
        for i, (rows, cols) in enumerate(((base, w_floor), (base, w_ceil), (base_ceil, w_floor), (base_ceil, w_ceil))):
            indices[i].append((rows[:, None] + cols[None, :]).flatten())
        for i, (a, b) in enumerate(((1 - dh, 1 - dw), (1 - dh, dw), (dh, 1 - dw), (dh, dw))):
            weights[i].append((a[:, None] * b[None, :]).flatten())
    idx = mx.stack([mx.concatenate(parts) for parts in indices]).astype(mx.int32)
    embeds = tower.pos_embed(idx)
    weight = mx.stack([mx.concatenate(parts) for parts in weights]).astype(embeds.dtype)
    embeds = embeds * weight[:, :, None]
    summed = embeds[0] + embeds[1] + embeds[2] + embeds[3]
    merge = tower.config.spatial_merge_size
    out, start = [], 0
    for t, h, w in grids.tolist():
        part = summed[start : start + h * w]
        start += h * w
        dim = part.shape[-1]
        part = mx.tile(part, (t, 1)).reshape(t, h, w, dim)
        part = part.reshape(t, h // merge, merge, w // merge, merge, dim).transpose(0, 1, 3, 2, 4, 5).reshape(-1, dim)
        out.append(part)
    return mx.concatenate(out)


def tower_call(tower: Any, hidden_states: mx.array, grid_thw: mx.array) -> tuple[mx.array, list[mx.array]]:
    """mlx_vlm's Qwen3-VL `VisionModel.__call__`, its indices from the host: (features, deepstack features)."""
    grids = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)  # the call's input: read once
    hidden = tower.patch_embed(hidden_states) + _position_embeddings(tower, grids)
    pos = mx.array(embedding.patch_positions(tower.spatial_merge_size, grids))
    table = tower.rotary_pos_emb(int(grids[:, 1:].max()))
    rotary = mx.concatenate([table[pos[:, 0]], table[pos[:, 1]]], axis=-1)
    cu_seqlens = embedding.bounds(embedding.frame_lengths(grids))
    hidden = hidden.reshape(hidden.shape[0], -1)
    rotary = rotary.reshape(hidden.shape[0], -1)
    deepstack = []
    for i, block in enumerate(tower.blocks):
        hidden = block(hidden, cu_seqlens=cu_seqlens, rotary_pos_emb=rotary)
        if i in tower.deepstack_visual_indexes:
            deepstack.append(tower.deepstack_merger_list[tower.deepstack_visual_indexes.index(i)](hidden))
    return tower.merger(hidden), deepstack


_CLASSES: dict[type, type] = {}


def install(tower: nn.Module) -> bool:
    """Give this tower instance the call above where it runs mlx_vlm's Qwen3-VL code (its class or a
    subclass that overrides none of what the call mirrors); returns whether it did."""
    base = type(tower)
    if base in _CLASSES.values():
        return True
    if not isinstance(tower, Qwen3VLVisionModel) or any(
        getattr(base, name) is not getattr(Qwen3VLVisionModel, name) for name in _MIRRORED
    ):
        return False
    if base not in _CLASSES:
        _CLASSES[base] = type(f"HostIndexed{base.__name__}", (base,), {"__call__": _call})
    tower.__class__ = _CLASSES[base]
    return True


def _call(self, hidden_states: mx.array, grid_thw: mx.array, **kwargs):
    return tower_call(self, hidden_states, grid_thw)
