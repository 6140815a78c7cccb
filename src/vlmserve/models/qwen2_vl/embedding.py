"""Qwen2-VL / Qwen2.5-VL image prompts embedded without reading the device back.

mlx_vlm reads its own device arrays back while it embeds an image prompt: `mx.sum(...).item()`
per row in the feature merge; the prompt, mask and grid (`.tolist()`, `.item()`) in
`get_rope_index`; `int(t)` per image plus `seqlen.tolist()` in Qwen2-VL's tower, and the
window index's `tolist()` and `int(grid_thw[i, 0])` in Qwen2.5-VL's. Each read
waits for whatever the GPU stream holds (a decode step, the previous request's tower), and a
burst of 32 requests makes hundreds of them. The prompt ids and image grids are on the host
already, so the same integers (M-RoPE positions, image-token positions, rotary and segment
indices) come from NumPy here. The device runs the same ops on the same values, so the
embeddings, positions and features are bit-identical to mlx_vlm's (tests compare them).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np


def mrope_positions(
    ids: np.ndarray, grids: np.ndarray, *, image_token: int, video_token: int, vision_start: int, merge: int
) -> tuple[np.ndarray, int] | None:
    """(3, L) int32 positions and the rope delta of one unpadded image prompt, computed as
    mlx_vlm's `get_rope_index` does; None where that function would not take its image path
    (no image, or video tokens), so the caller keeps mlx_vlm's own."""
    tokens = ids.tolist()
    if image_token not in tokens or video_token in tokens:
        return None
    starts = np.flatnonzero(ids[:-1] == vision_start)
    images = int((ids[starts + 1] == image_token).sum())  # mlx_vlm counts the images this way
    if images == 0 or images > len(grids):
        return None
    pieces: list[np.ndarray] = []
    st = 0
    for t, h, w in np.asarray(grids[:images], dtype=np.int64).tolist():
        ed = tokens.index(image_token, st)
        h, w = h // merge, w // merge
        base = int(pieces[-1].max()) + 1 if pieces else 0
        text = ed - st
        pieces.append(np.broadcast_to(np.arange(text) + base, (3, text)))
        grid = np.stack(
            [np.repeat(np.arange(t), h * w), np.tile(np.repeat(np.arange(h), w), t), np.tile(np.arange(w), t * h)]
        )
        pieces.append(grid + text + base)
        st = ed + t * h * w
    if st < len(tokens):
        base = int(pieces[-1].max()) + 1
        text = len(tokens) - st
        pieces.append(np.broadcast_to(np.arange(text) + base, (3, text)))
    positions = np.concatenate(pieces, axis=1).astype(np.int32)
    if positions.shape[1] != len(tokens):
        return None  # an image block runs past the prompt: leave it to mlx_vlm
    return positions, int(positions.max()) + 1 - len(tokens)


def merge_image_features(embeds: mx.array, features: mx.array, ids: np.ndarray, image_token: int) -> mx.array:
    """mlx_vlm's `merge_input_ids_with_image_features` for one row, with the indices from the host."""
    mask = ids == image_token
    if int(mask.sum()) != features.shape[0]:
        raise ValueError(f"{int(mask.sum())} image tokens in the prompt but {features.shape[0]} image features")
    indices = np.where(mask, np.cumsum(mask, dtype=np.int32) - 1, 0).astype(np.int32)
    row = mx.where(mx.array(mask)[:, None], features[mx.array(indices)], embeds[0])
    return row[None]


def patch_positions(merge: int, grids: np.ndarray, pad: int = 0) -> np.ndarray:
    """(patches + pad, 2) int32 row and column of every patch, merge block by merge block, each
    image's frames in turn (the Qwen-VL towers' `rot_pos_emb` order), then `pad` rows at 0."""
    pos = []
    for t, h, w in np.asarray(grids, dtype=np.int64).tolist():
        hpos = np.repeat(np.arange(h)[:, None], w, axis=1)
        wpos = np.repeat(np.arange(w)[None, :], h, axis=0)
        pair = [p.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1) for p in (hpos, wpos)]
        pos.append(np.tile(np.stack(pair, axis=-1), (t, 1)))
    return np.concatenate(pos + [np.zeros((pad, 2), np.int64)]).astype(np.int32)


def frame_lengths(grids: np.ndarray) -> np.ndarray:
    """Patches of each frame of each image: the towers' full-attention segments."""
    return np.repeat(grids[:, 1] * grids[:, 2], grids[:, 0])


def bounds(seqlens) -> mx.array:
    """Segment lengths -> the int32 `cu_seqlens` the towers' blocks take."""
    return mx.array(np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32))


def _rotary(tower: Any, grids: np.ndarray, pad: int) -> mx.array:
    """The rotary angles of every patch, in the images' patch order (and `pad` rows of position
    0 after them), as the towers' `rot_pos_emb` makes them from the grids."""
    pos_ids = patch_positions(tower.spatial_merge_size, grids, pad)
    table = tower.rotary_pos_emb(mx.array(int(grids[:, 1:].max())))  # a host scalar: no device read
    return table[mx.array(pos_ids)].reshape(pos_ids.shape[0], -1)


def pad_segments(pad: int, longest: int) -> list[int]:
    """`pad` rows past the images as segments of their own, none longer than `longest` (the
    longest real one, at least a merge unit of 4 rows): the one attention launch sizes its grid
    by the longest segment, so a long pad beside small images or windows would widen it for all."""
    step = max(4, longest // 4 * 4)
    return [step] * (pad // step) + ([pad % step] if pad % step else [])


def _padded(pixels: mx.array, grids: np.ndarray, rows: int | None) -> tuple[mx.array, np.ndarray, int]:
    """The pixels with `rows - patches` rows of zeros after them (none without `rows`), the
    segments' lengths (the images' frames, then the zeros in segments of their own), and the
    rows added."""
    seqlens = frame_lengths(grids)
    pad = 0 if rows is None else rows - pixels.shape[0]
    if pad <= 0:
        return pixels, seqlens, 0
    zeros = mx.zeros((pad, pixels.shape[1]), pixels.dtype)
    return mx.concatenate([pixels, zeros]), np.concatenate([seqlens, pad_segments(pad, int(seqlens.max()))]), pad


def qwen2_vl_tower(tower: Any, pixels: mx.array, grids: np.ndarray, rows: int | None = None) -> mx.array:
    """Qwen2-VL's `VisionModel.__call__` with its rotary and segment indices built on the host.
    With `rows` (at least the images' patches), the blocks run on that many patch rows: those
    past the images are zeros in segments of their own (`pad_segments`), dropped from the features."""
    patches = pixels.shape[0]
    pixels, seqlens, pad = _padded(pixels, grids, rows)
    rotary = _rotary(tower, grids, pad)
    cu_seqlens = bounds(seqlens)
    hidden = tower.patch_embed(pixels)
    for block in tower.blocks:
        hidden = block(hidden, cu_seqlens=cu_seqlens, rotary_pos_emb=rotary)
    features = tower.merger(hidden)
    return features[: patches // tower.spatial_merge_size**2] if pad else features


def window_index(tower: Any, grids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's `get_window_index` on the host: the merge units' order, window by window,
    and the windows' bounds in patches (empty windows included, as mlx_vlm keeps them)."""
    merge, unit = tower.spatial_merge_size, tower.spatial_merge_unit
    size = tower.window_size // merge // tower.patch_size
    order, bounds, base = [], [0], 0
    for t, h, w in np.asarray(grids, dtype=np.int64).tolist():
        gh, gw = h // merge, w // merge
        pad_h, pad_w = size - gh % size, size - gw % size
        nh, nw = (gh + pad_h) // size, (gw + pad_w) // size
        index = np.arange(t * gh * gw).reshape(t, gh, gw)
        index = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-100)
        index = index.reshape(t, nh, size, nw, size).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, size, size)
        seqlens = (index != -100).sum(axis=(2, 3)).reshape(-1)
        flat = index.reshape(-1)
        order.append(flat[flat != -100] + base)
        bounds.extend((np.cumsum(seqlens) * unit + bounds[-1]).tolist())
        base += t * gh * gw
    return np.concatenate(order).astype(np.int32), np.array(bounds, dtype=np.int32)


def qwen2_5_vl_tower(tower: Any, pixels: mx.array, grids: np.ndarray, rows: int | None = None) -> mx.array:
    """Qwen2.5-VL's `VisionModel.__call__` with its rotary, window and segment indices built on
    the host (mlx_vlm's reads the device back, waiting for the stream's work). `rows` as in
    `qwen2_vl_tower`: the rows past the images are segments of their own in the windowed
    blocks and the full ones alike, and keep their place at the end."""
    unit = tower.spatial_merge_unit
    patches = pixels.shape[0]
    pixels, seqlens, pad = _padded(pixels, grids, rows)
    order, windows = window_index(tower, grids)
    if pad:
        order = np.concatenate([order, np.arange(patches // unit, (patches + pad) // unit, dtype=np.int32)])
        pieces = pad_segments(pad, int(np.diff(windows).max()))
        windows = np.concatenate([windows, patches + np.cumsum(pieces)]).astype(np.int32)
    total = patches + pad
    units = mx.array(order)
    hidden = tower.patch_embed(pixels)
    hidden = hidden.reshape(total // unit, unit, -1)[units].reshape(total, -1)
    rotary = _rotary(tower, grids, pad)
    rotary = rotary.reshape(total // unit, unit, -1)[units].reshape(total, -1)
    full, windowed = bounds(seqlens), mx.array(windows)
    for i, block in enumerate(tower.blocks):
        hidden = block(hidden, cu_seqlens=full if i in tower.fullatt_block_indexes else windowed, rotary_pos_emb=rotary)
    features = tower.merger(hidden)[mx.array(np.argsort(order).astype(np.int32))]
    return features[: patches // unit] if pad else features
