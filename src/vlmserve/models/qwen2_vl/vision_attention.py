"""Qwen-VL vision attention in one launch per call, or one SDPA per run of equal-length segments.

mlx_vlm's Qwen2-VL / Qwen2.5-VL towers split the patches of all images (and, in Qwen2.5-VL,
of every attention window) at `cu_seqlens` and launch one attention kernel per segment, in
every block. With the images of many requests in one call, that is thousands of small
launches, and on the GPU the tower becomes bound by launching them. Segments of equal
length (images of one size; Qwen2.5-VL's full windows) are stacked on the batch axis
instead, so each run of them costs one kernel. q and k are rotated in one pass (one CUDA
kernel on that backend). The arithmetic per element is unchanged.

On CUDA, where vlmserve's kernels serve the tower's heads, a call's segments all go through
one launch of the prompt attention kernel (engine/ops/prefill_attention.attend_segments: each
segment's bounds are data, every query sees its whole segment, and q, k, v are read where the
projection and the rotation left them). The tower is bound by the host's time per primitive:
against a cuDNN call per run of equal segments, with its views of q, k and v, this took a
448 px image's tower call from 1,240 primitives to 698 (9.4 to 7.6 ms of host time on an H100)
and three images of three sizes from 2,191 to 753 (32.6 to 13.0 ms).

cuDNN's fused attention is faster on the device for large segments (twice as fast at 1024x768),
so a call with a lot of attention (CUDNN_WORK) takes it where its plans are built: runs are cut
into power-of-two image counts (13 = 8 + 4 + 1), so a segment length needs at most log2(max
images) plans, which warm-up builds for its image sizes (`QwenVLModel.warm_vision_plans`); a
large call whose plans are missing takes the one launch, and its plans are built while the
engine is idle, or between steps once the call's lost time has paid for them
(engine/ops/attention_plans). The routes agree to bf16 rounding.

The swap is per module instance (its class is replaced by a subclass), so only the model
the server loaded changes, never another copy of mlx_vlm's classes in the process.
"""

from __future__ import annotations

import functools
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vlmserve.engine.ops import cuda_kernels, prefill_attention
from vlmserve.engine.ops.attention_plans import AttentionPlans, plan_free_loss_s

# When a call whose cuDNN plans are built takes cuDNN's route: its attention work (patches^2
# summed over segments) passes CUDNN_WORK per cuDNN call, or one cuDNN call's passes
# CUDNN_LARGEST. Qwen2-VL's tower heads on an H100 (benchmarks/vision_attention.py and
# host_ops.py): the one launch took 0.04-0.07 ms a block more than cuDNN at one 224-448 px
# image (work up to 1M), 0.3 ms more at eight 448 px images or one 1024x768 image (8-16M),
# while each cuDNN call costs the host 0.15-0.25 ms a block in views and launches. A call of one
# 1024x768 image was done after 35.6 ms through the one launch and 28.6 through cuDNN; of eight
# sizes from 224 px to 1024x768, 88.0 and 70.6-79.9; of 224 px, 640x480 and 768 px, 34.3-38.0
# and 33.1-36.3, with the host's share 13-19 ms against 33-36.
CUDNN_WORK = 8 << 20
CUDNN_LARGEST = 12 << 20


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


def power_of_two_pieces(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Each (start, count, length) run cut into runs of power-of-two counts, largest first."""
    pieces = []
    for start, count, length in runs:
        while count:
            piece = 1 << (count.bit_length() - 1)
            pieces.append((start, piece, length))
            start, count = start + piece * length, count - piece
    return pieces


def _run_views(q: mx.array, k: mx.array, v: mx.array, start: int, count: int, length: int) -> list[mx.array]:
    """A run's q, k, v (n*L, H, D) rows as (n, H, L, D)."""
    heads, dim = q.shape[1:]
    end = start + count * length
    return [t[start:end].reshape(count, length, heads, dim).transpose(0, 2, 1, 3) for t in (q, k, v)]


def _through_cudnn(q_run: mx.array, k_run: mx.array, v_run: mx.array, scale: float) -> mx.array:
    count, heads, length, dim = q_run.shape
    out = mx.fast.scaled_dot_product_attention(q_run, k_run, v_run, scale=scale, mask=None)
    return out.transpose(0, 2, 1, 3).reshape(count * length, heads, dim)


def _plan_builder(dtype: mx.Dtype, count: int, length: int, heads: int, dim: int, scale: float):
    """One cuDNN call of this piece's shape, laid out as the tower lays it out (the plan's key holds strides)."""

    def build() -> None:
        qk = mx.zeros((count * length, 2, heads, dim), dtype=dtype)
        qkv = mx.zeros((count * length, 3, heads, dim), dtype=dtype)
        # cuDNN builds the plan as the call is queued; nothing waits for the device to run it.
        mx.async_eval(_through_cudnn(*_run_views(qk[:, 0], qk[:, 1], qkv[:, 2], 0, count, length), scale))

    return build


def _key(dtype: mx.Dtype, heads: int, dim: int, count: int, length: int) -> tuple:
    return (dtype, heads, dim, count, length)


class _Segments:
    """A tower call's segments: their bounds (host numbers), the cuDNN pieces, the attention work
    (patches^2 summed) and the longest segment."""

    def __init__(self, bounds: list[int]):
        self.bounds = bounds
        runs = segment_runs(bounds)
        self.pieces = power_of_two_pieces(runs) if cuda_kernels.cudnn_enabled() else runs
        self.work = sum(count * length * length for _, count, length in runs)
        self.largest = max((count * length * length for _, count, length in self.pieces), default=0)
        self.longest = max((length for _, _, length in runs), default=0)

    def worth_cudnn(self) -> bool:
        """Whether cuDNN's faster kernel saves more device time than its route costs the host
        (CUDNN_WORK per cuDNN call, or one call past CUDNN_LARGEST)."""
        return self.work >= CUDNN_WORK * len(self.pieces) or self.largest >= CUDNN_LARGEST


class _Layout(_Segments):
    """What the blocks of one tower call share about its segments (`_Segments`), found by the
    identity of its `cu_seqlens`."""

    def __init__(self, cu_seqlens: mx.array):
        self.cu_seqlens = cu_seqlens  # held: the identity the blocks look it up by stays its own
        super().__init__(cu_seqlens.tolist())

    def covers(self, positions: int) -> bool:
        """Whether the segments run from 0 to `positions` without a gap (every row is written)."""
        b = self.bounds
        return len(b) > 1 and b[0] == 0 and b[-1] == positions and all(lo <= hi for lo, hi in zip(b, b[1:]))


_LAYOUTS: list[_Layout] = []  # the tower call in progress's (Qwen2.5-VL's blocks alternate two)


def _layout(cu_seqlens: mx.array) -> _Layout:
    for layout in _LAYOUTS:
        if layout.cu_seqlens is cu_seqlens:
            return layout
    _LAYOUTS[:] = [_Layout(cu_seqlens), *_LAYOUTS[:1]]
    return _LAYOUTS[0]


def may_take_cudnn(seqlens: list[int]) -> bool:
    """Whether a tower call of segments of these lengths has enough attention work for cuDNN's
    route (`_takes_cudnn`, plans aside); the others always take the one launch, which any
    segment lengths suit."""
    return cuda_kernels.cudnn_enabled() and _Segments([0, *np.cumsum(seqlens).tolist()]).worth_cudnn()


def one_launch_serves(tower: nn.Module, dtype: mx.Dtype) -> bool:
    """Whether vlmserve's prompt-attention kernel serves this tower's attention (its one launch)."""
    attn = _installed(tower)
    return attn is not None and prefill_attention.serves(dtype, attn.num_heads, attn.num_heads, attn.head_dim)


def _takes_cudnn(layout: _Layout, dtype: mx.Dtype, heads: int, dim: int, scale: float, plans) -> bool:
    """Whether a tower call's attention goes to cuDNN run by run (`segment_attention`) rather than
    all segments in one launch of vlmserve's kernel: where cuDNN's faster kernel saves more
    device time than its route costs the host (CUDNN_WORK), and every piece's plan is built.
    Such a call whose plans are missing takes the one launch, and the missing plans are queued
    with what the whole call loses without cuDNN."""
    if plans is None or not cuda_kernels.cudnn_enabled():
        return False
    if not layout.worth_cudnn():
        return False
    pieces = [(count, length) for _, count, length in layout.pieces]
    missing = [(count, length) for count, length in pieces if not plans.planned(_key(dtype, heads, dim, count, length))]
    if missing:
        lost = sum(plan_free_loss_s(count, length, heads, dim) for count, length in pieces)
        for count, length in missing:
            build = _plan_builder(dtype, count, length, heads, dim, scale)
            plans.want(_key(dtype, heads, dim, count, length), build, lost / len(missing))
    return not missing


def segment_attention(
    q: mx.array, k: mx.array, v: mx.array, layout: _Layout, scale: float, plans: AttentionPlans | None = None
) -> mx.array:
    """Attention within each segment of q, k, v (S, H, D), segments as `layout` holds them: one
    SDPA per run of equal segments (power-of-two pieces of them on cuDNN), each noted in `plans`
    as planned."""
    _, heads, dim = q.shape
    cudnn = cuda_kernels.cudnn_enabled()
    outs = []
    for start, count, length in layout.pieces:
        outs.append(_through_cudnn(*_run_views(q, k, v, start, count, length), scale))
        if cudnn and plans is not None:
            plans.note_planned(_key(q.dtype, heads, dim, count, length))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


# mlx_vlm's apply_rotary_pos_emb_vision as one CUDA kernel over q and k: out = x*cos + rotate_half(x)*sin
# in float32, rounded once to x's dtype. The eager form is six full passes over q and k, and
# on CUDA the tower spent about half its attention time there. The products and the sum are
# rounded explicitly (no fused multiply-add), so the result is bit-identical to the eager ops.
_ROTATE_QK_SOURCE = """
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)qkv_shape[0] * 2 * HD) return;  // the size from the launch, not a tiny array (managed memory)
    const unsigned int half = D / 2;
    size_t row = i / (2 * HD);                 // position: q and k of one row are 2*HD apart in out
    size_t src = row * (3 * HD) + i % (2 * HD);  // the same element in qkv (S, 3, H, D)
    unsigned int d = i % D;
    float c = cos_t[row * half + d % half];
    float s = sin_t[row * half + d % half];
    float x = static_cast<float>(qkv[src]);
    float other = d < half ? -static_cast<float>(qkv[src + half]) : static_cast<float>(qkv[src - half]);
    out[i] = static_cast<T>(__fadd_rn(__fmul_rn(x, c), __fmul_rn(other, s)));
"""


def rotate_qk(qkv: mx.array, freqs: mx.array, rotary) -> mx.array:
    """q and k of qkv (S, 3, H, D) rotated as mlx_vlm's `rotary` (apply_rotary_pos_emb_vision) does: (S, 2, H, D)."""
    seq, _, heads, dim = qkv.shape
    if freqs.dtype != mx.float32 or not cuda_kernels.enabled():
        # One call for q and k together: (S, 2H, D) rows share a position, as q's and k's heads do.
        return rotary(qkv[:, :2].reshape(1, seq, 2 * heads, dim), freqs).reshape(seq, 2, heads, dim)
    total = seq * 2 * heads * dim
    return _rotate_kernel()(
        inputs=[qkv, *_cos_sin(freqs)],
        template=_rotate_template(qkv.dtype, heads, dim),
        grid=(total, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(seq, 2, heads, dim)],
        output_dtypes=[qkv.dtype],
    )[0]


# [freqs, cos, sin] of the tower call in progress, held until the next call (a few MB for the
# largest); the MLX thread is the only one that runs towers.
_TABLES: list = []


def _cos_sin(freqs: mx.array) -> tuple[mx.array, mx.array]:
    """cos and sin of a tower call's rotary angles, made once for all of its blocks (each block
    gets the same `freqs` array)."""
    if not _TABLES or _TABLES[0] is not freqs:
        _TABLES[:] = [freqs, mx.cos(freqs), mx.sin(freqs)]
    return _TABLES[1], _TABLES[2]


def _rotate_kernel():
    return cuda_kernels.kernel("vlmserve_rotate_qk", ("qkv", "cos_t", "sin_t"), _ROTATE_QK_SOURCE)


@functools.cache  # one list per build, made once (MLX only reads it)
def _rotate_template(dtype: mx.Dtype, heads: int, dim: int) -> list:
    return [("T", dtype), ("D", dim), ("HD", heads * dim)]


def _make_class(base: type) -> type:
    rotary = sys.modules[base.__module__].apply_rotary_pos_emb_vision

    def __call__(self, x: mx.array, cu_seqlens: mx.array, rotary_pos_emb: mx.array = None) -> mx.array:
        seq_length = x.shape[0]
        qkv = self.qkv(x).reshape(seq_length, 3, self.num_heads, -1)
        qk = rotate_qk(qkv, rotary_pos_emb, rotary)
        layout = _layout(cu_seqlens)
        plans = getattr(self, "attention_plans", None)
        heads, dim = self.num_heads, qk.shape[-1]
        if (
            layout.covers(seq_length)
            and prefill_attention.serves(qk.dtype, heads, heads, dim)
            and not _takes_cudnn(layout, qk.dtype, heads, dim, self.scale, plans)
        ):
            cu = cu_seqlens if cu_seqlens.dtype == mx.int32 else cu_seqlens.astype(mx.int32)
            return self.proj(prefill_attention.attend_segments(qk, qkv, cu, layout.longest, self.scale))
        out = segment_attention(qk[:, 0], qk[:, 1], qkv[:, 2], layout, self.scale, plans)
        return self.proj(out.reshape(seq_length, -1))

    return type(f"Segment{base.__name__}", (base,), {"__call__": __call__})


_CLASSES: dict[type, type] = {}


def install(tower: nn.Module, plans: AttentionPlans | None = None) -> int:
    """Swap the tower's per-segment attention modules for this module's version, sharing `plans`
    (None: calls the one launch serves take it, others go to cuDNN where MLX sends them);
    returns how many."""
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
        attn.attention_plans = plans
        swapped += 1
    return swapped


def build_plans(tower: nn.Module, dtype: mx.Dtype, length: int, counts: list[int], plans: AttentionPlans) -> list[int]:
    """Build cuDNN's attention plans for `counts` segments of `length` patches at the tower's
    heads, laid out as its calls lay them out (warm-up), and note them in `plans`; returns the
    counts built."""
    attn = _installed(tower)
    if attn is None:
        return []
    for count in counts:
        _plan_builder(dtype, count, length, attn.num_heads, attn.head_dim, attn.scale)()
        plans.note_planned(_key(dtype, attn.num_heads, attn.head_dim, count, length))
    return counts


def _installed(tower: nn.Module):
    """The tower's first attention module of this module's classes, if any."""
    blocks = getattr(tower, "blocks", [])
    return next((b.attn for b in blocks if type(getattr(b, "attn", None)) in _CLASSES.values()), None)


def note_builds(tower: nn.Module, dtype: mx.Dtype) -> None:
    """Queue the builds of the tower's kernels for its heads and activation dtype ahead of its
    first image (a few seconds of compiling each on a first start otherwise): the q/k rotation,
    and the one-launch attention where it serves the tower."""
    attn = _installed(tower)
    if attn is None:
        return
    heads, dim = attn.num_heads, attn.head_dim
    qkv, table = mx.zeros((1, 3, heads, dim), dtype=dtype), mx.zeros((1, dim // 2), dtype=mx.float32)
    cuda_kernels.note_build(
        _rotate_kernel(),
        inputs=[qkv, table, table],
        output_dtypes=[dtype],
        template=_rotate_template(dtype, heads, dim),
    )
    if prefill_attention.serves(dtype, heads, heads, dim):
        layout = prefill_attention.UNMASKED_LAYOUT
        prefill_attention.note_build(dtype, heads, heads, dim, attn.scale, layout, segments=True)


def uninstall(tower: nn.Module) -> int:
    """Give the tower back mlx_vlm's own attention modules (for comparisons); returns how many."""
    swapped = 0
    for block in getattr(tower, "blocks", []):
        attn = getattr(block, "attn", None)
        if type(attn) in _CLASSES.values():
            attn.__class__ = type(attn).__mro__[1]
            swapped += 1
    return swapped
