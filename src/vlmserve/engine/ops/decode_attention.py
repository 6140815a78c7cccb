"""One-query attention over the paged KV pool as a single CUDA kernel.

A decode step attends one new token per row to that row's first `length` cached positions,
found through its block table (engine/ops/paged_layer_cache.py): lengths, block ids and the
table's width are data, so one build serves every batch and context length.
MLX's CUDA SDPA has no kernel for that masked one-query case (cuDNN's builds a plan per
shape), so each layer ran the composed fallback: scale, a matmul, a select, a softmax and a
second matmul, with reshapes around them, in every layer of every step, and
the step is bound by launching kernels. This kernel does it in one launch per layer, with an
online softmax in float32. A block serves a few of the query heads that share one KV head
(GQA) for one row, so each key and value is read by few blocks and the batch still spreads
over the whole GPU (one block per row and KV head left most SMs idle: 45 µs a layer at B=32).
The result agrees with the composed path to bf16 rounding (not bit for bit) and is the same
from call to call; other backends keep mlx_vlm's path.
"""

from __future__ import annotations

import struct

import mlx.core as mx
from mlx_vlm.models import base

from vlmserve.engine.ops import composed_attention, cuda_kernels
from vlmserve.engine.ops.paged_layer_cache import PagedLayerCache
from vlmserve.engine.ops.rebind import rebind_in_mlx_vlm

_SHARED_BYTES = 48 * 1024  # static shared memory a CUDA block may declare
_ORIGINAL = base.scaled_dot_product_attention

# One block per (row, KV head, group of HB of its query heads); NW warps per block. A warp takes
# 32/G positions at a time, G lanes per position (E = D/G elements each, in vector loads of the
# key and of the value), with the keys and values of its next DEPTH positions loading while it
# uses these. Each lane keeps an online softmax per query head in float32; the groups of a warp,
# then the warps of the block, merge theirs in a fixed order, so every call gives the same result.
_SOURCE = """
    constexpr int E = D / G, P = 32 / G, STRIDE = NW * P, GROUPS = NREP / HB;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = lane / G, sub = lane % G;
    const unsigned group_mask = G == 32 ? 0xffffffffu : (((1u << G) - 1u) << (grp * G));
    const int bh = blockIdx.x / GROUPS;             // row * HKV + kv head
    const int row = bh / HKV, kvh = bh % HKV;
    const int len = lengths[row];
    const float sc = __int_as_float(SCALE_BITS);   // a template constant: see few_row_matmul
    const size_t q0 = ((size_t)bh * NREP + (blockIdx.x % GROUPS) * HB) * D;  // this block's first query head
    const int* blocks = table + (size_t)row * width[0];  // the width is data: one build per model
    // Where position p's key (and value) for this lane's KV head and elements starts in the pool.
    auto at = [&](int p) -> size_t {
        return ((size_t)__ldg(blocks + p / BS) * BS + p % BS) * (HKV * D) + (size_t)kvh * D + sub * E;
    };
    // A lane's E elements of a cached row stay raw in registers from their load until their use
    // DEPTH positions later, in the widest pieces their size allows (the cache rows are whole
    // arrays: D * sizeof(T) bytes apart from an aligned start). A load's latency (its table
    // entry's, then its row's) thus overlaps the arithmetic of the positions before it; converted
    // at once, each iteration waited for its next loads.
    constexpr int BYTES = E * sizeof(T);
    auto pick = [] {
        if constexpr (BYTES % 16 == 0) return uint4{};
        else if constexpr (BYTES % 8 == 0) return uint2{};
        else if constexpr (BYTES % 4 == 0) return 0u;
        else return T{};
    };
    using V = decltype(pick());
    constexpr int NV = BYTES / sizeof(V);
    V kr[DEPTH][NV], vr[DEPTH][NV];
    auto fetch = [&](int p, V* kd, V* vd) {
        if (p >= len) return;
        const size_t o = at(p);
        #pragma unroll
        for (int i = 0; i < NV; ++i) { kd[i] = __ldg(reinterpret_cast<const V*>(k + o) + i); vd[i] = __ldg(reinterpret_cast<const V*>(v + o) + i); }
    };
    auto unpack = [](const V* raw, float* dst) {
        const T* t = reinterpret_cast<const T*>(raw);
        #pragma unroll
        for (int e = 0; e < E; ++e) dst[e] = static_cast<float>(t[e]);
    };
    float qr[HB][E], m[HB], l[HB], acc[HB][E];
    #pragma unroll
    for (int h = 0; h < HB; ++h) {
        m[h] = -INFINITY; l[h] = 0.f;
        #pragma unroll
        for (int e = 0; e < E; ++e) { qr[h][e] = static_cast<float>(q[q0 + h * D + sub * E + e]); acc[h][e] = 0.f; }
    }
    // A sliding-window layer's row sees its last WINDOW positions only.
    const int first = (WINDOW > 0 ? max(0, len - WINDOW) : 0) + warp * P + grp;
    #pragma unroll
    for (int s = 0; s < DEPTH; ++s) fetch(first + s * STRIDE, kr[s], vr[s]);
    for (int base = first; base < len; base += DEPTH * STRIDE) {
        #pragma unroll
        for (int s = 0; s < DEPTH; ++s) {
            const int p = base + s * STRIDE;
            if (p >= len) break;
            float kc[E], vc[E];
            unpack(kr[s], kc); unpack(vr[s], vc);
            fetch(p + DEPTH * STRIDE, kr[s], vr[s]);
            #pragma unroll
            for (int h = 0; h < HB; ++h) {
                float sc_ = 0.f;
                #pragma unroll
                for (int e = 0; e < E; ++e) sc_ += qr[h][e] * kc[e];
                #pragma unroll
                for (int o = G / 2; o > 0; o >>= 1) sc_ += __shfl_xor_sync(group_mask, sc_, o, G);
                sc_ *= sc;
                const float mn = fmaxf(m[h], sc_), c = __expf(m[h] - mn), w = __expf(sc_ - mn);
                l[h] = l[h] * c + w;
                #pragma unroll
                for (int e = 0; e < E; ++e) acc[h][e] = acc[h][e] * c + w * vc[e];
                m[h] = mn;
            }
        }
    }
    // Merge the warp's position groups (a butterfly: every lane ends with the same sums).
    __syncwarp();
    #pragma unroll
    for (int o = G; o < 32; o <<= 1) {
        #pragma unroll
        for (int h = 0; h < HB; ++h) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[h], o), lo = __shfl_xor_sync(0xffffffffu, l[h], o);
            const float mn = fmaxf(m[h], mo);
            const float a = m[h] == -INFINITY ? 0.f : __expf(m[h] - mn), b = mo == -INFINITY ? 0.f : __expf(mo - mn);
            l[h] = l[h] * a + lo * b;
            #pragma unroll
            for (int e = 0; e < E; ++e) acc[h][e] = acc[h][e] * a + __shfl_xor_sync(0xffffffffu, acc[h][e], o) * b;
            m[h] = mn;
        }
    }
    // Then the block's warps, through shared memory.
    __shared__ float sm[NW][HB], sl[NW][HB], sacc[NW][HB * D];
    if (grp == 0) {
        #pragma unroll
        for (int h = 0; h < HB; ++h) {
            if (sub == 0) { sm[warp][h] = m[h]; sl[warp][h] = l[h]; }
            #pragma unroll
            for (int e = 0; e < E; ++e) sacc[warp][h * D + sub * E + e] = acc[h][e];
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < HB * D; t += NW * 32) {
        const int h = t / D;
        float top = -INFINITY;
        for (int w = 0; w < NW; ++w) top = fmaxf(top, sm[w][h]);
        float num = 0.f, den = 0.f;
        for (int w = 0; w < NW; ++w) {
            const float f = sm[w][h] == -INFINITY ? 0.f : __expf(sm[w][h] - top);
            num += sacc[w][t] * f; den += sl[w][h] * f;
        }
        out[q0 + t] = static_cast<T>(num / den);
    }
"""


def launch_shape(rep: int, dim: int, itemsize: int = 2) -> tuple[int, int, int, int] | None:
    """(G lanes per position, HB query heads per block, NW warps per block, DEPTH positions a lane
    has loading) for `rep` query heads per KV head of `dim` elements of `itemsize` bytes: the
    first of SHAPES that fits, None if none does. It does not depend on the batch: a row's
    result is the same whatever it is batched with, and one build serves every row count."""
    for g, hb, nw, depth in SHAPES:
        if rep % hb == 0 and dim % g == 0 and _fits(g, hb, nw, depth, dim, itemsize):
            return g, hb, nw, depth
    return None


# Device time of one call on an H200 (Qwen2-VL-2B's 12 query heads over 2 KV heads of 128),
# B rows of n positions: the kernel before, which read each position's row once its last one
# was used (16, 3, 16), and now (8, 3, 8, 4):
#   B=32, n=512: 21.2 µs -> 18.2      B=32, n=2048: 64.5 -> 43.4      B=64, n=512: 34.8 -> 32.4
#   B=8, n=4096: 89.0 -> 66.4         B=4, n=1024: 26.1 -> 20.2
# More query heads per block read each key and value fewer times; fewer give more blocks to
# the GPU's SMs (one head a block, (16, 1, 16, 4), took 46.2 and 15.4 µs in the two small
# batches, and 30-80 in the others).
SHAPES = ((8, 3, 8, 4), (8, 2, 8, 4), (16, 1, 16, 4), (16, 2, 16, 2), (32, 1, 8, 2))


def _fits(g: int, hb: int, nw: int, depth: int, dim: int, itemsize: int) -> bool:
    """Queries, accumulators, a position's keys and values as floats and `depth` positions' raw
    ones in a lane's share of the registers (with ~40 to spare), and the warps' partials in
    static shared memory."""
    e = dim // g
    registers = min(255, 65536 // (32 * nw))
    raw = 2 * depth * -(-e * itemsize // 4)
    return 2 * hb * e + 2 * e + raw + 40 <= registers and nw * hb * (dim + 2) * 4 <= _SHARED_BYTES


def float32_bits(value: float) -> int:
    """The bits of `value` as a float32, as a signed int: a float template constant."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def available(queries: mx.array, keys: mx.array) -> bool:
    """Whether the kernel serves this call: on CUDA, for a shape it takes."""
    return cuda_kernels.enabled() and serves(queries, keys)


def serves(queries: mx.array, keys: mx.array) -> bool:
    """One query per row, of the cache's dtype, and heads the kernel takes (`serves_heads`)."""
    if queries.shape[2] != 1 or queries.dtype != keys.dtype:
        return False
    return serves_heads(queries.shape[1], keys.shape[1], queries.shape[-1], keys.dtype.size)


def serves_heads(q_heads: int, kv_heads: int, dim: int, itemsize: int = 4) -> bool:
    """A head dim of 32k, whole query heads per KV head, and a launch shape that fits (for
    elements of `itemsize` bytes; float32's by default, which fit wherever narrower ones do)."""
    if dim % 32 or q_heads % kv_heads:
        return False
    return launch_shape(q_heads // kv_heads, dim, itemsize) is not None


def attend(
    queries: mx.array,
    cache: PagedLayerCache,
    lengths: mx.array,
    scale: float,
    out_shape: tuple[int, ...] | None = None,
    window: int = 0,
) -> mx.array:
    """queries (B, Hq, 1, D) over the cache's pools (N, Hkv, D) (whole arrays: the kernel loads
    their rows in 16-byte pieces); row b attends to its first lengths[b] positions, or with a
    sliding `window`, to the last `window` of them. The output is (B, Hq, 1, D), or the same
    memory as `out_shape` (e.g. (B, 1, Hq*D))."""
    batch, q_heads, _, dim = queries.shape
    kv_heads = cache.keys.shape[1]
    rep = q_heads // kv_heads
    if queries.dtype != cache.keys.dtype or cache.values.dtype != cache.keys.dtype:
        raise ValueError(f"queries of {queries.dtype} over a KV pool of {cache.keys.dtype}: the kernel reads one dtype")
    g, hb, nw, depth = launch_shape(rep, dim, queries.dtype.size)
    kernel = cuda_kernels.kernel(
        "vlmserve_paged_decode_attention", ("q", "k", "v", "lengths", "table", "width"), _SOURCE
    )
    cache.used_kernel()
    return kernel(
        inputs=[
            queries,
            cache.keys,
            cache.values,
            lengths.astype(mx.int32),
            cache.table,
            mx.array([cache.table.shape[1]], dtype=mx.int32),
        ],
        template=[
            ("T", queries.dtype),
            ("D", dim),
            ("NREP", rep),
            ("HKV", kv_heads),
            ("BS", cache.block_size),
            ("G", g),
            ("HB", hb),
            ("NW", nw),
            ("DEPTH", depth),
            ("SCALE_BITS", float32_bits(scale)),
            ("WINDOW", window),
        ],
        grid=(batch * kv_heads * (rep // hb) * 32 * nw, 1, 1),
        threadgroup=(32 * nw, 1, 1),
        output_shapes=[out_shape or queries.shape],
        output_dtypes=[queries.dtype],
    )[0]


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx_vlm's attention entry point; one-token steps over the paged pool take the kernel
    (sliding-window layers too, given the mask the pool's cache made for them), and prompt
    attention on CUDA keeps off cuDNN's per-shape plans (composed_attention)."""
    window = cache.kernel_window(mask) if isinstance(cache, PagedLayerCache) else None
    if (
        sinks is None
        and window is not None
        and cache.values.shape[-1] == queries.shape[-1]  # the kernel reads values at the keys' width
        and available(queries, cache.keys)
    ):
        return attend(queries, cache, cache.offset + queries.shape[2], scale, window=window)
    quantized = hasattr(cache, "bits") or hasattr(cache, "dequantize")  # mlx_vlm's own paths for these
    if not quantized and composed_attention.avoids_cudnn(queries, mask) and cuda_kernels.cudnn_enabled():
        return composed_attention.composed(queries, keys, values, scale, mask, sinks)
    return _ORIGINAL(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def install() -> int:
    """Rebind mlx_vlm's attention entry point in its model modules; returns the modules changed."""
    return rebind_in_mlx_vlm("scaled_dot_product_attention", _ORIGINAL, scaled_dot_product_attention)


def uninstall() -> None:
    rebind_in_mlx_vlm("scaled_dot_product_attention", scaled_dot_product_attention, _ORIGINAL)
