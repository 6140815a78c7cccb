"""Any vision tower's attention on CUDA without a cuDNN plan built on the request path.

mlx_vlm's towers call `mx.fast.scaled_dot_product_attention` themselves, and on CUDA MLX
hands every prompt-shaped call to cuDNN, which builds a plan the first time it meets a shape
(42-108 ms on an H100, while every stream waits). A tower meets a new shape with each new
image size, tile count or image count.

Inside `routed(plans, call, rebuild)` (one tower call), an unmasked call whose shape has no
plan yet runs the plan-free kernel (engine/ops/prefill_attention: lengths are launch
arguments there). Once the tower call returns, its shapes are queued in `plans`
(engine/ops/attention_plans) with `rebuild`, which runs that tower call again on stand-in
pixels of the same shape: while the engine is idle, or between steps once the shapes have
lost that rebuild's cost. Its plans then have the layout (strides) the real calls have, and
only the shapes it met count as planned. cuDNN's plans are keyed by strides, and a tower that
slices each image out of the whole call's queries lays an image out by what else the call
holds, so a shape's key includes `call`, the tower call's signature. Shapes met inside
`plans.building()` (warm-up, those rebuilds) go to cuDNN. Masked calls (several images in one
sequence) keep MLX's route.

The two agree to bf16 rounding. Qwen-VL's towers have their own route
(models/qwen2_vl/vision_attention.py), which batches equal segments first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator

import mlx.core as mx

from vlmserve.engine.ops import composed_attention, cuda_kernels, prefill_attention
from vlmserve.engine.ops.attention_plans import PLAN_BUILD_S, AttentionPlans, plan_free_loss_s


def available() -> bool:
    """Whether towers take this route here: cuDNN would build plans, and the kernel can run."""
    return cuda_kernels.cudnn_enabled() and cuda_kernels.enabled()


def takes(queries: mx.array, keys: mx.array, values: mx.array, mask, extra: dict) -> bool:
    """Whether a call goes plan-free when its shape has no plan: one cuDNN would take (prompt-
    shaped, no mask) and the kernel serves (bf16/fp16 self-attention of one dtype, keys and
    values alike, a head dim it holds once padded to a multiple of 8)."""
    if mask is not None or any(v is not None and v is not False for v in extra.values()):
        return False
    if queries.ndim != 4 or keys.shape != values.shape or keys.ndim != 4:
        return False
    if queries.dtype != keys.dtype or keys.dtype != values.dtype:
        return False
    batch, q_heads, length, dim = queries.shape
    if keys.shape[0] != batch or keys.shape[2] != length or keys.shape[3] != dim:
        return False
    return composed_attention.avoids_cudnn(queries, None) and prefill_attention.serves(
        queries.dtype, q_heads, keys.shape[1], _kernel_dim(dim)
    )


def _kernel_dim(dim: int) -> int:
    """The head dim handed to the kernel: the next multiple of 8 (it pads to 16 itself, so
    SigLIP so400m's 72 goes in as it is)."""
    return -(-dim // 8) * 8


def _plan_free(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """(B, Hq, L, D) attention by the plan-free kernel, laid out as MLX's call returns it. A head
    dim the kernel does not take is padded with zeros, which add nothing to a score, and the
    values' padding is cut off the output (the kernel pads a multiple of 8 itself)."""
    batch, heads, length, dim = queries.shape
    padded = _kernel_dim(dim)
    if padded != dim:
        widths = [(0, 0), (0, 0), (0, 0), (0, padded - dim)]
        queries, keys, values = (mx.pad(t, widths) for t in (queries, keys, values))
    out = prefill_attention.attend_unmasked(queries, keys, values, scale)  # (B, L, Hq * padded)
    out = out.reshape(batch, length, heads, padded)
    return (out if padded == dim else out[..., :dim]).transpose(0, 2, 1, 3)


@contextlib.contextmanager
def routed(plans: AttentionPlans, call: Hashable, rebuild: Callable[[], Callable[[], None]]) -> Iterator[None]:
    """Within: `mx.fast.scaled_dot_product_attention` calls a tower makes take the plan-free
    kernel where their shape (in this tower call, `call`) has no cuDNN plan; those shapes are
    queued with the build `rebuild()` makes (asked for only then) if the tower call returns.
    The worker thread is the only one that runs MLX, so nothing else meets the rebinding."""
    original = mx.fast.scaled_dot_product_attention
    lost: dict[Hashable, float] = {}

    def attention(queries, keys, values, *, scale, mask=None, **extra):
        if not takes(queries, keys, values, mask, extra):
            return original(queries, keys, values, scale=scale, mask=mask, **extra)
        key = ("tower", call, queries.dtype, tuple(queries.shape), tuple(keys.shape))
        if plans.planned(key):
            plans.note_planned(key)
            return original(queries, keys, values, scale=scale, mask=mask, **extra)
        batch, heads, length, dim = queries.shape
        lost[key] = lost.get(key, 0.0) + plan_free_loss_s(batch, length, heads, dim)
        return _plan_free(queries, keys, values, scale)

    mx.fast.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = original
    # Their build runs the whole tower call again: about a plan's build for the call (an
    # estimate) besides each plan's own.
    if not lost:
        return
    build, build_s = rebuild(), PLAN_BUILD_S * (len(lost) + 1)
    for key, seconds in lost.items():
        plans.want(key, build, seconds, build_s=build_s, notes_itself=True)
