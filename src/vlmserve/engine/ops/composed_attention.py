"""Attention as MLX composes it when it has no fused kernel for a call, and when to use it.

With cuDNN attention on (MLX's default on CUDA, kept by vlmserve since the vision tower
gains a third from it), `mx.fast.scaled_dot_product_attention` hands every prompt-shaped
call to cuDNN, which builds a plan per new (batch, length, mask) shape: ~70 ms each on an
H100, for as long as a server meets new prompt shapes. The language model's prompt
attention (the vision tower's is bucketed, see vision_attention) therefore runs the ops
MLX itself runs without cuDNN: `composed` is MLX's fallback (fast.cpp) op for op, so the
results are the ones MLX gave with cuDNN off. Calls that MLX's own vector kernel serves
(a few queries, no array mask) still go to `mx.fast`.
"""

from __future__ import annotations

import mlx.core as mx

_VECTOR_MAX_QUERIES = 3  # MLX's CUDA vector kernel takes fewer than 4 queries and no array mask


def avoids_cudnn(queries: mx.array, mask) -> bool:
    """True where MLX without cuDNN composes the call (so `composed` gives its results, plan-free)."""
    return queries.shape[2] > _VECTOR_MAX_QUERIES or isinstance(mask, mx.array)


def composed(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None, sinks: mx.array | None = None
) -> mx.array:
    """MLX's composed scaled_dot_product_attention: (B, Hq, Lq, D) x (B, Hkv, Lk, D) -> (B, Hq, Lq, Dv)."""
    dtype = mx.result_type(queries, keys, values)
    q, k, v = queries.astype(dtype), keys.astype(dtype), values.astype(dtype)
    batch, q_heads, q_len, _ = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    causal = isinstance(mask, str)
    if causal and mask != "causal":
        raise ValueError(f"unsupported mask mode {mask!r}")
    grouped = isinstance(mask, mx.array) and mask.ndim == 5  # laid out by grouped_mask already
    if isinstance(mask, mx.array) and not grouped:
        mask = mask if mask.dtype == mx.bool_ else mask.astype(dtype)
        mask = mx.broadcast_to(mask, (batch, q_heads, q_len, k_len))
    q = mx.array(scale, dtype=dtype) * q
    repeats = q_heads // kv_heads
    if repeats > 1:
        q = q.reshape(batch, kv_heads, repeats, q_len, q.shape[-1])
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ mx.swapaxes(k, -1, -2)
    if causal:
        offset = k_len - q_len
        mask = mx.arange(offset, q_len + offset)[:, None] >= mx.arange(0, k_len)[None]
    if mask is not None:
        if repeats > 1 and mask.ndim >= 3 and not grouped:
            mask = (
                mx.expand_dims(mask, -3)
                if mask.shape[-3] == 1
                else mask.reshape(*mask.shape[:-3], kv_heads, repeats, *mask.shape[-2:])
            )
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    if sinks is not None:
        sink = mx.expand_dims(sinks.astype(dtype), (0, 2, 3))
        if scores.ndim == 5:
            sink = sink.reshape(1, kv_heads, repeats, 1, 1)
        sink = mx.broadcast_to(sink, (*scores.shape[:-1], 1))
        scores = mx.concatenate([sink, scores], axis=-1)
    scores = mx.softmax(scores, axis=-1, precise=True)
    if sinks is not None:
        scores = scores[..., 1:]
    out = scores @ v
    if repeats > 1:
        out = out.reshape(batch, q_heads, q_len, out.shape[-1])
    return out


def grouped_mask(mask, q_heads: int, kv_heads: int):
    """A (B, 1, L, K) boolean mask laid out as `composed` lays it out for grouped-query scores,
    (B, 1, 1, L, K): made once, it serves every layer of a forward, where each layer would
    otherwise broadcast it to all heads and copy it. The selected values are the same."""
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_ or mask.ndim != 4 or mask.shape[1] != 1:
        return mask
    return mx.expand_dims(mask, 2) if q_heads > kv_heads else mask
