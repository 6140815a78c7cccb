"""Any vision tower's attention on CUDA without a cuDNN plan built on the request path.

mlx_vlm's towers call `mx.fast.scaled_dot_product_attention` themselves, and on CUDA MLX
hands every prompt-shaped call to cuDNN, which builds a plan the first time it meets a shape
(42-108 ms on an H100, while every stream waits). A tower meets a new shape with each new
image size, tile count or image count. Inside `routed(plans, rebuild)` (the tower's call), an
unmasked call whose shape has no plan yet runs the plan-free kernel
(engine/ops/prefill_attention: lengths are launch arguments there), and the shape is queued
in `plans` (engine/ops/attention_plans) with `rebuild`, which runs the same tower call again:
built that way, while idle or once the shape has lost a plan's build time, each plan has the
layout (strides) the real calls have. Shapes met inside `plans.building()` (warm-up, those
builds) go to cuDNN. Masked calls (several images in one sequence) keep MLX's route.

The two agree to bf16 rounding. Qwen-VL's towers have their own route
(models/qwen2_vl/vision_attention.py), which batches equal segments first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import mlx.core as mx

from vlmserve.engine.ops import composed_attention, prefill_attention
from vlmserve.engine.ops.attention_plans import AttentionPlans, plan_free_loss_s


def takes(queries: mx.array, keys: mx.array, mask, extra: dict) -> bool:
    """Whether a call goes plan-free when its shape has no plan: one cuDNN would take (prompt-
    shaped, no mask) and the kernel serves (bf16/fp16 self-attention, a head dim it holds)."""
    if mask is not None or any(v is not None and v is not False for v in extra.values()):
        return False
    if queries.ndim != 4 or keys.ndim != 4 or queries.shape[2] != keys.shape[2]:
        return False
    _, q_heads, _, dim = queries.shape
    return composed_attention.avoids_cudnn(queries, None) and prefill_attention.serves(
        queries.dtype, q_heads, keys.shape[1], dim
    )


def _plan_free(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """(B, Hq, L, D) attention by the plan-free kernel, laid out as MLX's call returns it."""
    batch, heads, length, dim = queries.shape
    out = prefill_attention.attend_unmasked(queries, keys, values, scale)  # (B, L, Hq * D)
    return out.reshape(batch, length, heads, dim).transpose(0, 2, 1, 3)


@contextlib.contextmanager
def routed(plans: AttentionPlans, rebuild: Callable[[], None]) -> Iterator[None]:
    """Within: `mx.fast.scaled_dot_product_attention` calls a tower makes take the plan-free
    kernel where their shape has no cuDNN plan (queued with `rebuild`). The worker thread is the
    only one that runs MLX, so nothing else meets the rebinding."""
    original = mx.fast.scaled_dot_product_attention

    def attention(queries, keys, values, *, scale, mask=None, **extra):
        if not takes(queries, keys, mask, extra):
            return original(queries, keys, values, scale=scale, mask=mask, **extra)
        key = ("tower", queries.dtype, tuple(queries.shape), tuple(keys.shape))
        if plans.planned(key):
            plans.note_planned(key)
            return original(queries, keys, values, scale=scale, mask=mask, **extra)
        batch, heads, length, dim = queries.shape
        plans.want(key, rebuild, plan_free_loss_s(batch, length, heads, dim))
        return _plan_free(queries, keys, values, scale)

    mx.fast.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = original
