"""Causal attention for a prompt forward (many queries over a cache) as one CUDA kernel.

A prompt piece's forward on CUDA is bound by the host's cost per primitive, and the composed
attention (engine/ops/composed_attention: a scale, two matmuls, a select and a softmax, with
the reshapes around them) was the largest share of it: on an H100, a 555-token piece after
2,300 cached positions (2B model) took 17.8 ms with it and 9.7 ms with the attention left out,
and its scores (heads x queries x keys) went through memory five times a layer.

Here one launch per layer does it the FlashAttention-2 way, with tensor-core `mma.sync`
(bf16 / fp16 in, float32 accumulation). A block holds 64 queries of one head, 16 per warp, in
two streams of four warps that split the block's keys: each stream walks its own tiles of 32
keys, copied into shared memory asynchronously one tile ahead and read by all four of its
warps, with an online softmax in float32. No score leaves the registers; the two streams'
partial results merge once at the end, in a fixed order (the same result from call to call).
On an H100, 28 calls for a 640-position piece over 2,940 keys (Qwen2-VL-2B's heads) took
4.5 ms through MLX, against 8.4 ms composed (2.8 ms as a standalone CUDA program); there, one
stream per block (fewer warps per SM) or 16 queries per tile copy (four times the key reads)
took 35% to 200% longer.

Which keys a query sees is data, so one build serves every prompt: row b's query i (at cache
position off[b] + i) sees keys lo[b] <= j <= off[b] + i, which covers a plain cache after a
prefix (lo 0), several rows' pieces side by side (ragged offsets) and a left-padded group
(lo = the row's padding). A query that sees no key gets zeros. Keys and values are read
where they lie (a cache buffer's view, a transposed copy from the block pool), through their
strides.

The output comes laid out as (B, L, Hq * D), the o-projection's input, so the transpose and
copy after the attention go too. It agrees with the composed path to bf16 rounding, not bit
for bit: the scores stay float32 here (the composed path rounds them to the input dtype) and
the probabilities are rounded to the input dtype before they weight the values.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from vlmserve.engine.ops import cuda_kernels
from vlmserve.engine.ops.decode_attention import float32_bits

MMA_TYPES = {mx.bfloat16: "bf16", mx.float16: "f16"}
KEY_TILE = 32  # keys per shared-memory tile
PAD = 8  # elements after each shared row: the mma loads of 8 rows hit 8 different bank groups

# One block: QW * 16 queries of one (row, head) (a warp's 16 each), whose keys its KS streams of
# QW warps split; grid (query tiles, heads, rows).
_SOURCE = """
    // D: the head dim in memory; DP: the one the tensor cores run (D up to a multiple of 16),
    // whose extra elements are zeros (nothing to a score) and are never written out.
    constexpr int BK = KEY_TILE, RS = DP + PAD, DK = DP / 16, DN = DP / 8, KN = BK / 8;
    constexpr int NW = QW * KS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int qw = warp % QW, ks_id = warp / QW;  // this warp's 16 queries of the block's, its key stream
    const int g = lane >> 2, c = lane & 3;
    const int head = blockIdx.y, b = blockIdx.z, kvh = head / (HQ / HKV);
    // SEGMENTS: q, k and v are parts 0, 1 and 2 of (S, parts, heads, D) arrays, and block row b
    // is the segment lo[b] <= position < lo[b + 1], whose queries see all of its keys.
    const int seg0 = SEGMENTS ? lo[b] : 0;
    const int L = SEGMENTS ? lo[b + 1] - seg0 : q_shape[2];
    const int q_first = blockIdx.x * QW * 16, wq = q_first + qw * 16;
    if (SEGMENTS && q_first >= L) return;  // a shorter segment than the launch's longest
    const int W = SEGMENTS ? L : k_shape[2];
    const int row_off = SEGMENTS ? L : off[b], row_lo = SEGMENTS ? 0 : lo[b];
    const size_t out_row0 = SEGMENTS ? (size_t)seg0 : (size_t)b * L;
    // Each key stream's two stages of a key tile and a value tile: its next tile's copies run
    // while its warps use this one. After the key loop the same memory holds the streams'
    // partial results.
    extern __shared__ __align__(16) unsigned char smem[];
    T* const ks0 = reinterpret_cast<T*>(smem) + ks_id * 4 * BK * RS;
    T* const vs0 = ks0 + 2 * BK * RS;

    // This warp's 16 queries as mma A fragments: rows g and g + 8, all of D (any strides).
    auto pair = [](T lo_, T hi_) {
        return (uint32_t)(*reinterpret_cast<const unsigned short*>(&lo_))
            | ((uint32_t)(*reinterpret_cast<const unsigned short*>(&hi_)) << 16);
    };
    // d += a b for one m16n8k16 tile: a (16x16) as four registers, b (16x8) as two, d in float32.
    auto mma = [](float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.{mma}.{mma}.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    };
    uint32_t qa[DK][4];
    {
        const T* qh = SEGMENTS ? q + (size_t)seg0 * q_strides[0] + (size_t)head * q_strides[2]
                               : q + (size_t)b * q_strides[0] + (size_t)head * q_strides[1];
        const size_t qr = SEGMENTS ? q_strides[0] : q_strides[2], qd = q_strides[3];
        const T* q0 = qh + (size_t)min(wq + g, L - 1) * qr;
        const T* q1 = qh + (size_t)min(wq + g + 8, L - 1) * qr;
        // Element d of a query row, zero in the padding (D is a multiple of 8, so a pair is
        // either side of it).
        auto at = [&](const T* row, size_t d) { return d < D ? row[d * qd] : static_cast<T>(0.f); };
        #pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            const size_t d = kk * 16 + 2 * c;
            qa[kk][0] = pair(at(q0, d), at(q0, d + 1));
            qa[kk][1] = pair(at(q1, d), at(q1, d + 1));
            qa[kk][2] = pair(at(q0, d + 8), at(q0, d + 9));
            qa[kk][3] = pair(at(q1, d + 8), at(q1, d + 9));
        }
    }
    float o[DN][4];
    #pragma unroll
    for (int n = 0; n < DN; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    const float sc = __int_as_float(SCALE_BITS) * 1.4426950408889634f;  // exp2 of scaled scores
    const int qpos0 = row_off + wq + g, qpos1 = qpos0 + 8;  // cache positions of this lane's rows

    const int k_begin = (max(row_lo, 0) / BK) * BK;
    const int k_end = min(W, row_off + min(L, q_first + QW * 16));  // the block's last query sees up to here
    const T* kb = SEGMENTS ? k + (size_t)seg0 * k_strides[0] + k_strides[1] + (size_t)kvh * k_strides[2]
                           : k + (size_t)b * k_strides[0] + (size_t)kvh * k_strides[1];
    const T* vb = SEGMENTS ? v + (size_t)seg0 * v_strides[0] + 2 * v_strides[1] + (size_t)kvh * v_strides[2]
                           : v + (size_t)b * v_strides[0] + (size_t)kvh * v_strides[1];
    const size_t kst = SEGMENTS ? k_strides[0] : k_strides[2], vst = SEGMENTS ? v_strides[0] : v_strides[2];
    const bool k_vec = k_strides[3] == 1 && kst % 8 == 0 && ((unsigned long long)kb & 15) == 0;
    const bool v_vec = v_strides[3] == 1 && vst % 8 == 0 && ((unsigned long long)vb & 15) == 0;
    // A tile's keys and values into one of this stream's stages, by its warps: 16-byte asynchronous copies where
    // rows allow it (a cache's buffer or a view of it), else element by element; zeros past the cache.
    auto load_tile = [&](int stage, int k0) {
        constexpr int VEC = 8, PER_ROW = D / VEC;
        T* const kd = ks0 + stage * BK * RS;
        T* const vd = vs0 + stage * BK * RS;
        #pragma unroll
        for (int i = qw * 32 + lane; i < BK * PER_ROW; i += QW * 32) {
            const int r = i / PER_ROW, e = (i % PER_ROW) * VEC;
            T* const ko = kd + r * RS + e;
            T* const vo = vd + r * RS + e;
            if (k0 + r >= W) {
                *reinterpret_cast<uint4*>(ko) = make_uint4(0, 0, 0, 0);
                *reinterpret_cast<uint4*>(vo) = make_uint4(0, 0, 0, 0);
                continue;
            }
            const T* kp = kb + (size_t)(k0 + r) * kst;
            const T* vp = vb + (size_t)(k0 + r) * vst;
            if (k_vec)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                             :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(ko))), "l"(kp + e));
            else
                for (int x = 0; x < VEC; ++x) ko[x] = kp[(e + x) * k_strides[3]];
            if (v_vec)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                             :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(vo))), "l"(vp + e));
            else
                for (int x = 0; x < VEC; ++x) vo[x] = vp[(e + x) * v_strides[3]];
        }
        asm volatile("cp.async.commit_group;");
    };
    // The QW warps of a stream share its tiles (a named barrier each); stream s takes the
    // block's key tiles s, s + KS, s + 2 KS, ...
    auto stream_sync = [&]() { asm volatile("bar.sync %0, %1;" :: "r"(1 + ks_id), "r"(QW * 32) : "memory"); };
    if constexpr (DP > D) {  // the padding of both stages' key and value rows: zeros, never copied over
        for (int i = qw * 32 + lane; i < 4 * BK * (DP - D); i += QW * 32)
            ks0[(i / (DP - D)) * RS + D + i % (DP - D)] = static_cast<T>(0.f);
    }
    const int first_tile = k_begin + ks_id * BK;
    if (first_tile < k_end) load_tile(0, first_tile);
    for (int k0 = first_tile, stage = 0; k0 < k_end; k0 += KS * BK, stage ^= 1) {
        if (k0 + KS * BK < k_end) load_tile(stage ^ 1, k0 + KS * BK);
        else asm volatile("cp.async.commit_group;");  // an empty group: the wait below stays uniform
        asm volatile("cp.async.wait_group 1;");  // all but the newest group: this tile is in
        stream_sync();
        const T* const ks = ks0 + stage * BK * RS;
        const T* const vs = vs0 + stage * BK * RS;
        // S = Q K^T for the 16 queries and the tile's keys; the key tiles' chains side by side.
        float s[KN][4];
        #pragma unroll
        for (int n = 0; n < KN; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
        #pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            #pragma unroll
            for (int n = 0; n < KN; ++n) {
                const T* kr = ks + (n * 8 + g) * RS + 2 * c + kk * 16;
                const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kr);
                const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kr + 8);
                mma(s[n], qa[kk], b0, b1);
            }
        }
        // Mask, then the online softmax of rows g (c0, c1) and g + 8 (c2, c3).
        float t0 = -INFINITY, t1 = -INFINITY;
        #pragma unroll
        for (int n = 0; n < KN; ++n)
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int j = k0 + n * 8 + 2 * c + (r & 1);
                const int qp = r < 2 ? qpos0 : qpos1;
                const bool seen = j >= row_lo && j <= qp && j < W;
                s[n][r] = seen ? s[n][r] * sc : -INFINITY;
                if (r < 2) t0 = fmaxf(t0, s[n][r]); else t1 = fmaxf(t1, s[n][r]);
            }
        #pragma unroll
        for (int x = 1; x < 4; x <<= 1) {
            t0 = fmaxf(t0, __shfl_xor_sync(0xffffffffu, t0, x));
            t1 = fmaxf(t1, __shfl_xor_sync(0xffffffffu, t1, x));
        }
        const float n0 = fmaxf(m0, t0), n1 = fmaxf(m1, t1);
        // Nothing seen yet in a row: its maximum stays -inf and every weight is 0.
        const float a0 = n0 == -INFINITY ? 1.f : exp2f(m0 - n0), a1 = n1 == -INFINITY ? 1.f : exp2f(m1 - n1);
        const float z0 = n0 == -INFINITY ? 0.f : n0, z1 = n1 == -INFINITY ? 0.f : n1;
        m0 = n0; m1 = n1;
        l0 *= a0; l1 *= a1;
        #pragma unroll
        for (int n = 0; n < DN; ++n) { o[n][0] *= a0; o[n][1] *= a0; o[n][2] *= a1; o[n][3] *= a1; }
        uint32_t p[KN][2];
        #pragma unroll
        for (int n = 0; n < KN; ++n) {
            const T p0 = static_cast<T>(exp2f(s[n][0] - z0)), p1 = static_cast<T>(exp2f(s[n][1] - z0));
            const T p2 = static_cast<T>(exp2f(s[n][2] - z1)), p3 = static_cast<T>(exp2f(s[n][3] - z1));
            l0 += static_cast<float>(p0) + static_cast<float>(p1);
            l1 += static_cast<float>(p2) + static_cast<float>(p3);
            p[n][0] = pair(p0, p1);
            p[n][1] = pair(p2, p3);
        }
        // O += P V, 16 keys a step; V's fragments come transposed by ldmatrix.
        #pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            #pragma unroll
            for (int n = 0; n < DN; n += 2) {
                const T* vr = vs + (kk * 16 + (lane & 15)) * RS + n * 8 + (lane >> 4) * 8;
                const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(vr));
                uint32_t b0, b1, b2, b3;
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                             : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(addr));
                const uint32_t pa[4] = {p[2 * kk][0], p[2 * kk][1], p[2 * kk + 1][0], p[2 * kk + 1][1]};
                mma(o[n], pa, b0, b1);
                mma(o[n + 1], pa, b2, b3);
            }
        }
        stream_sync();  // the stream's warps are done with this stage before its next copies land in it
    }
    asm volatile("cp.async.wait_all;");
    #pragma unroll
    for (int x = 1; x < 4; x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
    // Merge the streams' partial softmaxes through shared memory, in stream order (deterministic).
    constexpr int R = QW * 16;                          // the block's queries
    __syncthreads();
    float* const po = reinterpret_cast<float*>(smem);  // (KS, R, DP) partial outputs
    float* const pm = po + KS * R * DP;                 // (KS, R) maxima
    float* const pl = pm + KS * R;                      // (KS, R) sums
    const int row = ks_id * R + qw * 16 + g;
    #pragma unroll
    for (int n = 0; n < DN; ++n) {
        float* row0 = po + row * DP + n * 8 + 2 * c;
        float* row1 = row0 + 8 * DP;
        row0[0] = o[n][0]; row0[1] = o[n][1]; row1[0] = o[n][2]; row1[1] = o[n][3];
    }
    if (c == 0) {
        pm[row] = m0; pm[row + 8] = m1;
        pl[row] = l0; pl[row + 8] = l1;
    }
    __syncthreads();
    for (int t = threadIdx.x; t < R * D; t += NW * 32) {
        const int r = t / D, d = t % D;
        if (q_first + r >= L) continue;
        float top = -INFINITY;
        #pragma unroll
        for (int w = 0; w < KS; ++w) top = fmaxf(top, pm[w * R + r]);
        float num = 0.f, den = 0.f;
        #pragma unroll
        for (int w = 0; w < KS; ++w) {
            const float f = pm[w * R + r] == -INFINITY ? 0.f : exp2f(pm[w * R + r] - top);
            num += po[(w * R + r) * DP + d] * f;
            den += pl[w * R + r] * f;
        }
        out[(out_row0 + q_first + r) * (HQ * D) + head * D + d] = static_cast<T>(den > 0.f ? num / den : 0.f);
    }
"""

QUERY_WARPS = 4  # warps sharing each key tile, 16 queries each: a tile's copy serves 64 queries
KEY_STREAMS = 2  # groups of QUERY_WARPS warps splitting a block's keys, for more warps per SM
LAYOUT = (QUERY_WARPS, KEY_STREAMS, KEY_TILE)
# A vision tower's segment has thousands of queries, so blocks are many without splitting their
# keys: one stream of four warps took 16-28% less time than two for 448-1024 px images on an H100
# (benchmarks/vision_attention.py), and no other layout tried was faster.
UNMASKED_LAYOUT = (QUERY_WARPS, 1, KEY_TILE)


def serves(dtype: mx.Dtype, q_heads: int, kv_heads: int, dim: int) -> bool:
    """On CUDA with the kernels on: bf16/fp16, whole query heads per KV head, a head dim of 8k
    up to 128 (a wider one would ask more shared memory than many GPUs give a block; one not
    a multiple of 16, such as SigLIP's and Qwen3-VL's 72, runs padded inside the kernel)."""
    return cuda_kernels.enabled() and dtype in MMA_TYPES and q_heads % kv_heads == 0 and dim % 8 == 0 and dim <= 128


def padded_dim(dim: int) -> int:
    """The head dim the tensor cores run: `dim` up to a multiple of 16."""
    return -(-dim // 16) * 16


def shared_bytes(dim: int, itemsize: int = 2, layout: tuple[int, int, int] | None = None) -> int:
    """Each stream's two stages of a key tile and a value tile, rows padded; at least the
    streams' partial results (float32 outputs, maxima and sums of the block's queries) that
    reuse it. 68 KB at a head dim of 128: within what sm_80 and later GPUs give a block."""
    query_warps, key_streams, key_tile = layout or LAYOUT
    staging = key_streams * 2 * 2 * key_tile * (dim + PAD) * itemsize
    return max(staging, key_streams * query_warps * 16 * (dim + 2) * 4)


@functools.cache  # asked on every launch: the source's substitution and hash once per build
def _kernel(dtype: mx.Dtype, dim: int, layout: tuple[int, int, int]):
    return cuda_kernels.kernel(
        f"vlmserve_prefill_attention_{MMA_TYPES[dtype]}",
        ("q", "k", "v", "off", "lo"),
        _SOURCE.replace("{mma}", MMA_TYPES[dtype]),
        ensure_row_contiguous=False,
        shared_memory=shared_bytes(padded_dim(dim), layout=layout),
    )


@functools.cache  # one list per build, made once (MLX only reads it)
def _template(
    dtype: mx.Dtype,
    dim: int,
    q_heads: int,
    kv_heads: int,
    scale: float,
    layout: tuple[int, int, int],
    segments: bool = False,
):
    query_warps, key_streams, key_tile = layout
    return [
        ("SEGMENTS", int(segments)),
        ("T", dtype),
        ("D", dim),
        ("DP", padded_dim(dim)),
        ("HQ", q_heads),
        ("HKV", kv_heads),
        ("QW", query_warps),
        ("KS", key_streams),
        ("KEY_TILE", key_tile),
        ("PAD", PAD),
        ("SCALE_BITS", float32_bits(scale)),
    ]


def _blocks(queries: int, heads: int, rows: int, layout: tuple[int, int, int]) -> dict:
    """The launch's grid and block for `queries` per (head, row): blocks of the layout's query
    warps x key streams, 16 queries a warp (the source's block layout)."""
    query_warps, key_streams, _ = layout
    threads = 32 * query_warps * key_streams
    return {"grid": (-(-queries // (16 * query_warps)) * threads, heads, rows), "threadgroup": (threads, 1, 1)}


def attend(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    offsets: mx.array,
    firsts: mx.array,
    layout: tuple[int, int, int] = LAYOUT,
) -> mx.array:
    """queries (B, Hq, L, D); keys, values (B, Hkv, W, D), all read in place (views too);
    offsets, firsts (B,) int32: row b's query i sits at cache position offsets[b] + i and sees
    keys firsts[b] <= j <= offsets[b] + i. `layout`: (query warps, key streams, key tile) of a
    block. Returns (B, L, Hq * D)."""
    batch, q_heads, length, dim = queries.shape
    return _kernel(queries.dtype, dim, layout)(
        inputs=[queries, keys, values, offsets, firsts],
        template=_template(queries.dtype, dim, q_heads, keys.shape[1], scale, layout),
        **_blocks(length, q_heads, batch, layout),
        output_shapes=[(batch, length, q_heads * dim)],
        output_dtypes=[queries.dtype],
    )[0]


def note_build(
    dtype: mx.Dtype,
    q_heads: int,
    kv_heads: int,
    dim: int,
    scale: float,
    layout: tuple[int, int, int] = LAYOUT,
    segments: bool = False,
) -> None:
    """Queue the build `attend` (or `attend_unmasked` / `attend_segments`, with their layout)
    launches for these heads for side processes to file in the kernel cache, ahead of its first
    use (a no-op where builds are not filed): a first start then reads it instead of compiling
    it on the MLX thread."""
    rows, index = mx.zeros((1, q_heads, 1, dim), dtype=dtype), mx.zeros((1,), dtype=mx.int32)
    inputs = [rows, rows[:, :kv_heads], rows[:, :kv_heads], index, index]
    if segments:
        parts = mx.zeros((1, 2, q_heads, dim), dtype=dtype)
        inputs = [parts, parts, mx.zeros((1, 3, q_heads, dim), dtype=dtype), index, index]
    cuda_kernels.note_build(
        _kernel(dtype, dim, layout),
        inputs=inputs,
        output_dtypes=[dtype],
        template=_template(dtype, dim, q_heads, kv_heads, scale, layout, segments),
    )


def attend_unmasked(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, layout: tuple[int, int, int] = UNMASKED_LAYOUT
) -> mx.array:
    """`attend` with every query seeing all of its row's keys (a vision tower's segments): the
    visibility rule with each row's offset at the keys' width. Returns (B, L, Hq * D)."""
    batch, width = queries.shape[0], keys.shape[2]
    offsets, firsts = mx.full((batch,), width, dtype=mx.int32), mx.zeros((batch,), dtype=mx.int32)
    return attend(queries, keys, values, scale, offsets, firsts, layout)


def attend_segments(
    qk: mx.array,
    qkv: mx.array,
    bounds: mx.array,
    longest: int,
    scale: float,
    layout: tuple[int, int, int] = UNMASKED_LAYOUT,
) -> mx.array:
    """Attention within each segment of a vision tower's positions (its images, or their
    attention windows), all segments in one launch: queries and keys are qk (S, 2, H, D)'s parts
    0 and 1, values qkv (S, 3, H, D)'s part 2, each read in place; bounds (N + 1,) int32 the
    segments' cumulative ends [0, ..., S], `longest` the longest segment's length. Every query
    sees all of its segment's keys. Returns (S, H * D), laid out for the output projection.

    One launch instead of one per run of equal segments and three views of q, k and v each:
    the tower's calls are bound by the host's time per primitive."""
    positions, _, heads, dim = qk.shape
    if qkv.dtype != qk.dtype or qkv.shape[0] != positions or qkv.shape[2:] != qk.shape[2:]:
        raise ValueError(f"qk {qk.shape} {qk.dtype} and qkv {qkv.shape} {qkv.dtype} do not match")
    segments = bounds.shape[0] - 1
    return _kernel(qk.dtype, dim, layout)(
        inputs=[qk, qk, qkv, bounds, bounds],
        template=_template(qk.dtype, dim, heads, heads, scale, layout, segments=True),
        **_blocks(max(longest, 1), heads, segments, layout),
        output_shapes=[(positions, heads * dim)],
        output_dtypes=[qk.dtype],
    )[0]
