"""One-query attention over the slot KV cache as a single CUDA kernel.

A decode step attends one new token per row to that row's first `length` cached positions.
MLX's CUDA SDPA has no kernel for that masked one-query case (with cuDNN off, see
engine/__init__.py), so each layer ran the composed fallback: scale, a matmul, a select, a
softmax and a second matmul, with reshapes around them, in every layer of every step, and
the step is bound by launching kernels. This kernel does it in one launch per layer: one
thread block per (row, KV head) serves all the query heads that share it (GQA), reads each
key and value once, and keeps an online softmax in float32. The result agrees with the
composed path to bf16 rounding (not bit for bit); other backends keep mlx_vlm's path.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_vlm.models import base

from . import cuda_kernels
from .rebind import rebind_in_mlx_vlm
from .slot_cache import SlotLayerCache

WARPS = 16  # per block; each walks every WARPS-th cached position
_SHARED_BYTES = 48 * 1024  # static shared memory a CUDA block may declare
_REGISTER_FLOATS = 64  # per lane for the queries and accumulators of one KV head's query heads
_ORIGINAL = base.scaled_dot_product_attention

_SOURCE = """
    constexpr int E = D / 32;                      // head-dim elements per lane
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int bh = blockIdx.x;                     // row * HKV + kv head
    const int row = bh / HKV;
    const int len = lengths[row];
    const float sc = scale[0];
    const size_t q0 = (size_t)bh * NREP * D;       // the NREP query heads of this kv head
    float qr[NREP][E], m[NREP], l[NREP], acc[NREP][E];
    for (int r = 0; r < NREP; ++r) {
        m[r] = -INFINITY; l[r] = 0.f;
        for (int e = 0; e < E; ++e) { qr[r][e] = static_cast<float>(q[q0 + r * D + lane * E + e]); acc[r][e] = 0.f; }
    }
    for (int p = warp; p < len; p += NW) {
        const size_t base = ((size_t)bh * CAP + p) * D + lane * E;
        float kr[E], vr[E];
        for (int e = 0; e < E; ++e) { kr[e] = static_cast<float>(k[base + e]); vr[e] = static_cast<float>(v[base + e]); }
        for (int r = 0; r < NREP; ++r) {
            float s = 0.f;
            for (int e = 0; e < E; ++e) s += qr[r][e] * kr[e];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
            s *= sc;
            const float mn = fmaxf(m[r], s), c = __expf(m[r] - mn), w = __expf(s - mn);
            l[r] = l[r] * c + w;
            for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * c + w * vr[e];
            m[r] = mn;
        }
    }
    // Combine the warps' partial softmaxes, one query head at a time (small shared memory).
    __shared__ float sm[NW][NREP], sl[NW][NREP], sacc[NW][D];
    if (lane == 0) {
        for (int r = 0; r < NREP; ++r) { sm[warp][r] = m[r]; sl[warp][r] = l[r]; }
    }
    for (int r = 0; r < NREP; ++r) {
        for (int e = 0; e < E; ++e) sacc[warp][lane * E + e] = acc[r][e];
        __syncthreads();
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float mx_ = -INFINITY;
            for (int w = 0; w < NW; ++w) mx_ = fmaxf(mx_, sm[w][r]);
            float num = 0.f, den = 0.f;
            for (int w = 0; w < NW; ++w) {
                const float f = sm[w][r] == -INFINITY ? 0.f : __expf(sm[w][r] - mx_);
                num += sacc[w][d] * f; den += sl[w][r] * f;
            }
            out[q0 + r * D + d] = static_cast<T>(num / den);
        }
        __syncthreads();
    }
"""

def available(queries: mx.array, keys: mx.array) -> bool:
    """Whether the kernel serves this call: on CUDA, for a shape it takes."""
    return cuda_kernels.enabled() and serves(queries, keys)


def serves(queries: mx.array, keys: mx.array) -> bool:
    """One query per row, of the cache's dtype, and heads the kernel takes (`serves_heads`)."""
    if queries.shape[2] != 1 or queries.dtype != keys.dtype:
        return False
    return serves_heads(queries.shape[1], keys.shape[1], queries.shape[-1])


def serves_heads(q_heads: int, kv_heads: int, dim: int) -> bool:
    """A head dim of 32k, and the query heads of one KV head fit a lane's registers."""
    if dim % 32 or q_heads % kv_heads:
        return False
    rep = q_heads // kv_heads
    return rep * dim // 32 <= _REGISTER_FLOATS and WARPS * (dim + 2 * rep) * 4 <= _SHARED_BYTES


def attend(queries: mx.array, keys: mx.array, values: mx.array, lengths: mx.array, scale: float,
           out_shape: tuple[int, ...] | None = None) -> mx.array:
    """queries (B, Hq, 1, D); keys, values (B, Hkv, capacity, D); row b attends to its first lengths[b]
    positions. The output is (B, Hq, 1, D), or the same memory as `out_shape` (e.g. (B, 1, Hq*D))."""
    batch, q_heads, _, dim = queries.shape
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    kernel = cuda_kernels.kernel("vlmserve_decode_attention", ("q", "k", "v", "lengths", "scale"), _SOURCE)
    return kernel(
        inputs=[queries, keys, values, lengths.astype(mx.int32), mx.array([scale], dtype=mx.float32)],
        template=[("T", queries.dtype), ("D", dim), ("NREP", q_heads // kv_heads), ("HKV", kv_heads),
                  ("CAP", capacity), ("NW", WARPS)],
        grid=(batch * kv_heads * 32 * WARPS, 1, 1), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[out_shape or queries.shape], output_dtypes=[queries.dtype],
    )[0]


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx_vlm's attention entry point; one-token steps over the slot cache take the kernel."""
    if (sinks is None and isinstance(cache, SlotLayerCache) and cache.plain_mask
            and available(queries, keys)):
        return attend(queries, keys, values, cache.offset + queries.shape[2], scale)
    return _ORIGINAL(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def install() -> int:
    """Rebind mlx_vlm's attention entry point in its model modules; returns the modules changed."""
    return rebind_in_mlx_vlm("scaled_dot_product_attention", _ORIGINAL, scaled_dot_product_attention)


def uninstall() -> None:
    rebind_in_mlx_vlm("scaled_dot_product_attention", scaled_dot_product_attention, _ORIGINAL)
