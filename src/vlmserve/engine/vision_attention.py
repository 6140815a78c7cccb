"""Qwen-VL vision attention with one SDPA per run of equal-length segments.

mlx_vlm's Qwen2-VL / Qwen2.5-VL towers split the patches of all images (and, in Qwen2.5-VL,
of every attention window) at `cu_seqlens` and launch one attention kernel per segment, in
every block. With the images of many requests in one call, that is thousands of small
launches, and on the GPU the tower becomes bound by launching them. Segments of equal
length (images of one size; Qwen2.5-VL's full windows) are stacked on the batch axis
instead, so each run of them costs one kernel. The arithmetic per segment is unchanged.

The swap is per module instance (its class is replaced by a subclass), so only the model
the server loaded changes, never another copy of mlx_vlm's classes in the process.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn


def segment_runs(bounds: list[int]) -> list[tuple[int, int, int]]:
    """Cumulative bounds [0, a, b, ...] -> (start, count, length) runs of equal-length segments."""
    runs: list[tuple[int, int, int]] = []
    for lo, hi in zip(bounds, bounds[1:]):
        length = hi - lo
        if length <= 0:
            continue
        if runs and runs[-1][2] == length:
            start, count, _ = runs[-1]
            runs[-1] = (start, count + 1, length)
        else:
            runs.append((lo, 1, length))
    return runs


def segment_attention(q: mx.array, k: mx.array, v: mx.array, bounds: list[int], scale: float) -> mx.array:
    """Attention within each segment of q, k, v (1, H, S, D); segments are given by `bounds`."""
    _, heads, _, dim = q.shape
    outs = []
    for start, count, length in segment_runs(bounds):
        end = start + count * length

        def stack(t: mx.array) -> mx.array:  # (1, H, n*L, D) -> (n, H, L, D)
            return t[0, :, start:end].reshape(heads, count, length, dim).transpose(1, 0, 2, 3)

        out = mx.fast.scaled_dot_product_attention(stack(q), stack(k), stack(v), scale=scale, mask=None)
        outs.append(out.transpose(1, 0, 2, 3).reshape(1, heads, count * length, dim))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def _make_class(base: type) -> type:
    rotary = sys.modules[base.__module__].apply_rotary_pos_emb_vision

    def __call__(self, x: mx.array, cu_seqlens: mx.array, rotary_pos_emb: mx.array = None) -> mx.array:
        seq_length = x.shape[0]
        qkv = self.qkv(x).reshape(seq_length, 3, self.num_heads, -1).transpose(1, 0, 2, 3)
        q, k, v = mx.split(qkv, 3)
        q = rotary(mx.expand_dims(q, 0), rotary_pos_emb)[0].transpose(0, 2, 1, 3)
        k = rotary(mx.expand_dims(k, 0), rotary_pos_emb)[0].transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        out = segment_attention(q, k, v, cu_seqlens.tolist(), self.scale)
        return self.proj(out.transpose(0, 2, 1, 3).reshape(seq_length, -1))

    return type(f"Segment{base.__name__}", (base,), {"__call__": __call__})


_CLASSES: dict[type, type] = {}


def install(tower: nn.Module) -> int:
    """Swap the tower's per-segment attention modules for the run-batched version; returns how many."""
    swapped = 0
    for block in getattr(tower, "blocks", []):
        attn = getattr(block, "attn", None)
        if attn is None or not hasattr(attn, "qkv") or type(attn) in _CLASSES.values():
            continue
        base = type(attn)
        if not hasattr(sys.modules.get(base.__module__), "apply_rotary_pos_emb_vision"):
            continue
        if base not in _CLASSES:
            _CLASSES[base] = _make_class(base)
        attn.__class__ = _CLASSES[base]
        swapped += 1
    return swapped


def uninstall(tower: nn.Module) -> int:
    """Give the tower back mlx_vlm's own attention modules (for comparisons); returns how many."""
    swapped = 0
    for block in getattr(tower, "blocks", []):
        attn = getattr(block, "attn", None)
        if type(attn) in _CLASSES.values():
            attn.__class__ = type(attn).__mro__[1]
            swapped += 1
    return swapped
