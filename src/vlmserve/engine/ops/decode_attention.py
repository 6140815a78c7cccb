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
# 32/G positions at a time, G lanes per position (E = D/G elements each, one vector load of the
# key and of the value), and loads its next positions while it uses these. Each lane keeps an
# online softmax per query head in float32; the groups of a warp, then the warps of the block,
# merge theirs in a fixed order, so every call gives the same result.
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
        return ((size_t)blocks[p / BS] * BS + p % BS) * (HKV * D) + (size_t)kvh * D + sub * E;
    };
    // E elements of one cached row as floats, in the widest loads their size allows (the
    // cache rows are whole arrays: D * sizeof(T) bytes apart from an aligned start).
    auto load_as = [](const T* src, float* dst, auto chunk) {  // in pieces of chunk's type
        using V = decltype(chunk);
        constexpr int PER = sizeof(V) / sizeof(T);
        #pragma unroll
        for (int i = 0; i < E / PER; ++i) {
            const V raw = __ldg(reinterpret_cast<const V*>(src) + i);
            const T* t = reinterpret_cast<const T*>(&raw);
            #pragma unroll
            for (int j = 0; j < PER; ++j) dst[i * PER + j] = static_cast<float>(t[j]);
        }
    };
    auto load = [&](const T* src, float* dst) {
        constexpr int BYTES = E * sizeof(T);
        if (BYTES % 16 == 0) load_as(src, dst, uint4{});
        else if (BYTES % 8 == 0) load_as(src, dst, uint2{});
        else load_as(src, dst, T{});
    };
    float qr[HB][E], m[HB], l[HB], acc[HB][E];
    #pragma unroll
    for (int h = 0; h < HB; ++h) {
        m[h] = -INFINITY; l[h] = 0.f;
        #pragma unroll
        for (int e = 0; e < E; ++e) { qr[h][e] = static_cast<float>(q[q0 + h * D + sub * E + e]); acc[h][e] = 0.f; }
    }
    float kc[E], vc[E], kn[E], vn[E];
    // A sliding-window layer's row sees its last WINDOW positions only.
    int p = (WINDOW > 0 ? max(0, len - WINDOW) : 0) + warp * P + grp;
    if (p < len) { const size_t o = at(p); load(k + o, kc); load(v + o, vc); }
    for (; p < len; p += STRIDE) {
        if (p + STRIDE < len) { const size_t o = at(p + STRIDE); load(k + o, kn); load(v + o, vn); }
        #pragma unroll
        for (int h = 0; h < HB; ++h) {
            float s = 0.f;
            #pragma unroll
            for (int e = 0; e < E; ++e) s += qr[h][e] * kc[e];
            #pragma unroll
            for (int o = G / 2; o > 0; o >>= 1) s += __shfl_xor_sync(group_mask, s, o, G);
            s *= sc;
            const float mn = fmaxf(m[h], s), c = __expf(m[h] - mn), w = __expf(s - mn);
            l[h] = l[h] * c + w;
            #pragma unroll
            for (int e = 0; e < E; ++e) acc[h][e] = acc[h][e] * c + w * vc[e];
            m[h] = mn;
        }
        #pragma unroll
        for (int e = 0; e < E; ++e) { kc[e] = kn[e]; vc[e] = vn[e]; }
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


def launch_shape(rep: int, dim: int) -> tuple[int, int, int] | None:
    """(G lanes per position, HB query heads per block, NW warps per block) for `rep` query heads
    per KV head of `dim` elements: the first of SHAPES that fits, None if none does."""
    for g, hb, nw in SHAPES:
        if rep % hb == 0 and dim % g == 0 and _fits(g, hb, nw, dim):
            return g, hb, nw
    return None


# Fastest first, one call at a time on an H100 at B=32 and 512 cached positions.
# More query heads per block read each key and value fewer
# times; fewer give more blocks to the GPU's 132 SMs.
SHAPES = ((16, 3, 16), (16, 2, 16), (16, 1, 16), (32, 1, 16), (32, 1, 8))


def _fits(g: int, hb: int, nw: int, dim: int) -> bool:
    """Queries, accumulators and two positions' keys and values in a lane's share of the
    registers (with ~40 to spare), and the warps' partials in static shared memory."""
    e = dim // g
    registers = min(255, 65536 // (32 * nw))
    return 2 * hb * e + 4 * e + 40 <= registers and nw * hb * (dim + 2) * 4 <= _SHARED_BYTES


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
    return serves_heads(queries.shape[1], keys.shape[1], queries.shape[-1])


def serves_heads(q_heads: int, kv_heads: int, dim: int) -> bool:
    """A head dim of 32k, whole query heads per KV head, and a launch shape that fits."""
    if dim % 32 or q_heads % kv_heads:
        return False
    return launch_shape(q_heads // kv_heads, dim) is not None


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
    g, hb, nw = launch_shape(rep, dim)
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
