"""A linear layer over a few rows (a decode step's batch) as one CUDA kernel.

On CUDA a compiled decode step is bound by the host's cost per primitive, and MLX's
matmul is the dearest one to launch: each call builds cuBLASLt descriptors, asks for a
heuristic and is captured into the step's graph, whatever the size: 14-22 µs of host time
against 7 µs for this kernel on the hosts measured.
A step has ~4 matmuls per layer. This kernel computes Y = X @ W^T (+ bias) for 2 to 32 rows with tensor-core
`mma.sync` (bf16 / fp16 in, float32 accumulation): each warp streams 16·F rows of W
straight from memory, 16 bytes per lane, for every WARPS-th chunk of 32 inputs, and the
block's warps then add their partial sums in a fixed order (deterministic).

The lane that loads 8 consecutive weights of a row hands 4 of them to each of two mma
steps; the rows of X are loaded the same way, so both operands see the same permutation
of k inside each chunk and the dot products are unchanged. It agrees with MLX's matmul to
float32 summation order (not bit for bit). Other backends, dtypes and shapes keep MLX's.
"""

from __future__ import annotations

import functools
import math
import os

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.ops import cuda_kernels

# One row: MLX's own gemv is as fast. Past 32 rows, a B=64 step got slower with the kernel on the H100.
MIN_ROWS, MAX_ROWS = 2, 32

_MMA_TYPES = {mx.bfloat16: "bf16", mx.float16: "f16"}

_SOURCE = """
    // Rows and width from the launch itself, not from an array: MLX keeps arrays of a few bytes in
    // host-shared (managed) memory, and a kernel that reads one waits on it.
    int M = 1;
    for (int i = 0; i < x_ndim - 1; ++i) M *= x_shape[i];
    const int N = gridDim.x * 16 * F;                // one build serves every M and N of this K
    constexpr int KC = K / 32;                       // chunks of 32 inputs
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;           // mma fragment row group, column pair
    const size_t n0 = (size_t)blockIdx.x * 16 * F;   // this block's first output feature
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    // W is read once: past L1 (which keeps X, read by every block), with the next 256 bytes into L2.
    auto stream = [](const uint4* p) {
        uint4 v;
        asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
        return v;
    };
    float acc[F][MT][4];
    #pragma unroll
    for (int f = 0; f < F; ++f)
        #pragma unroll
        for (int t = 0; t < MT; ++t)
            #pragma unroll
            for (int r = 0; r < 4; ++r) acc[f][t][r] = 0.f;
    for (int kc0 = warp; kc0 < KC; kc0 += U * WARPS) {
        uint4 a[U][F][2], b[U][MT];
        #pragma unroll
        for (int u = 0; u < U; ++u) {                // issue every load of U chunks first, unbranched:
            const bool live = kc0 + u * WARPS < KC;  // out-of-range chunks and rows read a valid
            const int kc = live ? kc0 + u * WARPS : kc0;  // address and are zeroed after
            #pragma unroll
            for (int f = 0; f < F; ++f)
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    a[u][f][h] = stream(wv + ((n0 + f * 16 + h * 8 + g) * K + kc * 32) / 8 + c);
                    if (!live) a[u][f][h] = zero;
                }
            #pragma unroll
            for (int t = 0; t < MT; ++t) {
                const int row = t * 8 + g;
                b[u][t] = __ldg(xv + ((size_t)(row < M ? row : M - 1) * K + kc * 32) / 8 + c);
                if (!live || row >= M) b[u][t] = zero;
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u)
            #pragma unroll
            for (int f = 0; f < F; ++f)
                #pragma unroll
                for (int t = 0; t < MT; ++t) {
                    float* d = acc[f][t];
                    asm volatile(
                        "mma.sync.aligned.m16n8k16.row.col.f32.{mma}.{mma}.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                        : "r"(a[u][f][0].x), "r"(a[u][f][1].x), "r"(a[u][f][0].y), "r"(a[u][f][1].y),
                          "r"(b[u][t].x), "r"(b[u][t].y));
                    asm volatile(
                        "mma.sync.aligned.m16n8k16.row.col.f32.{mma}.{mma}.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                        : "r"(a[u][f][0].z), "r"(a[u][f][1].z), "r"(a[u][f][0].w), "r"(a[u][f][1].w),
                          "r"(b[u][t].z), "r"(b[u][t].w));
                }
    }
    // Sum the warps' partials pairwise, always in the same order.
    __shared__ float red[WARPS > 1 ? WARPS / 2 : 1][F * MT * 4][32];
    #pragma unroll
    for (int half = WARPS / 2; half >= 1; half /= 2) {
        if (warp >= half && warp < 2 * half) {
            #pragma unroll
            for (int f = 0; f < F; ++f)
                #pragma unroll
                for (int t = 0; t < MT; ++t)
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) red[warp - half][(f * MT + t) * 4 + r][lane] = acc[f][t][r];
        }
        __syncthreads();
        if (warp < half) {
            #pragma unroll
            for (int f = 0; f < F; ++f)
                #pragma unroll
                for (int t = 0; t < MT; ++t)
                    #pragma unroll
                    for (int r = 0; r < 4; ++r) acc[f][t][r] += red[warp][(f * MT + t) * 4 + r][lane];
        }
        __syncthreads();
    }
    if (warp != 0) return;
    #pragma unroll
    for (int f = 0; f < F; ++f)
        #pragma unroll
        for (int t = 0; t < MT; ++t)
            #pragma unroll
            for (int r = 0; r < 4; ++r) {             // c0..c3: (feature g | g+8) x (row 2c | 2c+1)
                const size_t n = n0 + f * 16 + (r >> 1) * 8 + g;
                const int m = t * 8 + 2 * c + (r & 1);
                if (m < M) {
                    float v = acc[f][t][r];
                    {bias}
                    y[(size_t)m * N + n] = static_cast<T>(v);
                }
            }
"""


def serves(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> bool:
    """On CUDA with the kernels on (and VLMSERVE_FEW_ROW_MATMUL not 0): a bf16/fp16 weight (N, K)
    with N % 16 == 0 and K % 32 == 0, an input of the same dtype whose rows (all axes but the
    last) number MIN_ROWS to MAX_ROWS."""
    if os.environ.get("VLMSERVE_FEW_ROW_MATMUL", "1") == "0" or not cuda_kernels.enabled():
        return False
    if weight.ndim != 2 or weight.dtype not in _MMA_TYPES:
        return False
    n, k = weight.shape
    if n % 16 or k % 32 or x.dtype != weight.dtype or x.ndim < 1 or x.shape[-1] != k:
        return False
    if bias is not None and (bias.shape != (n,) or bias.dtype != weight.dtype):
        return False
    return MIN_ROWS <= math.prod(x.shape[:-1]) <= MAX_ROWS


def _launch_shape(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(MT, F, WARPS, U) for m <= MAX_ROWS rows: 8-row tiles, 16-feature tiles per warp, warps
    splitting K, chunks in flight. Chosen by the kernel's own time on the H100 for each layer
    shape of a 2B-parameter decode step, one call at a time as a step runs them: wide layers
    want several feature tiles per warp (X is read fewer times), deep ones many warps per block, narrow ones all their loads in flight at once."""
    mt = 1 if m <= 8 else 4  # two tile counts only: each build costs the server's start ~2 s of JIT
    wide, deep = n >= 8192, k >= 4096
    if wide:
        f = next(f for f in (4, 2, 1) if n % (16 * f) == 0)
        return mt, f, 4, 1
    # Deep layers: 16 warps, not the 32 that timed 20% faster, so a build never asks more than
    # 128 registers a thread (a 1024-thread block gets 64; past that the launch fails).
    return (mt, 1, 16, 1) if deep else (mt, 1, 8, 8)


@functools.cache
def _kernel(mma: str, with_bias: bool):
    """The kernel for one mma input type, with or without bias (its source formatted once)."""
    source = _SOURCE.replace("{mma}", mma)
    source = source.replace("{bias}", "v += static_cast<float>(bias[n]);" if with_bias else "")
    inputs = ("x", "w", "bias") if with_bias else ("x", "w")
    return cuda_kernels.kernel(
        f"vlmserve_few_row_mm_{mma}{'_bias' if with_bias else ''}", inputs, source, output_names=("y",)
    )


def matmul(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x (..., K) @ weight.T (+ bias) for a weight (N, K) and input `serves` accepts."""
    n, k = weight.shape
    m = math.prod(x.shape[:-1])
    mt, f, warps, u = _launch_shape(m, n, k)
    kernel = _kernel(_MMA_TYPES[weight.dtype], bias is not None)
    return kernel(
        inputs=[x, weight] + ([bias] if bias is not None else []),
        template=[("T", weight.dtype), ("K", k), ("MT", mt), ("F", f), ("WARPS", warps), ("U", u)],
        grid=(n // (16 * f) * 32 * warps, 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[x.shape[:-1] + (n,)],
        output_dtypes=[weight.dtype],
    )[0]


def linear(layer: nn.Module, x: mx.array) -> mx.array:
    """`layer(x)` for an nn.Linear, through the kernel when it serves the call."""
    if type(layer) is nn.Linear:
        bias = layer.get("bias", None)
        if serves(x, layer["weight"], bias):
            return matmul(x, layer["weight"], bias)
    return layer(x)
