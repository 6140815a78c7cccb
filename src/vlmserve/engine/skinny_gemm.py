"""`x @ w.T (+ bias)` for the few rows of a decode step, as one CUDA kernel on tensor cores.

A decode step multiplies at most a few dozen rows by every weight matrix. MLX sends each
such matmul to cuBLASLt, which builds its descriptors and asks for a heuristic on every call:
about 13 us of host time per matmul on the H200, whatever the size, and the step has 113 of
them (28 layers x 4 + the logits), while the GPU needs ~1 ms to stream all the weights.
A custom kernel launch costs ~2.5 us of host time.

Each block computes 32 output columns for all rows; its warps split the K dimension and add
their partial sums in shared memory. The products go through `mma.sync` (bf16 or fp16 in,
float32 accumulation), as cuBLAS's do, but in another summation order: results agree to
the output dtype's rounding, not bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import cuda_kernels

MAX_ROWS = 64  # four 16-row tiles per warp
TILES = 4  # 8-column tiles per block: each row tile of x read from cache serves 32 columns
_MMA = {mx.bfloat16: "bf16", mx.float16: "f16"}

_SOURCE = """
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;           // mma fragment coordinates
    const int n0 = blockIdx.x * 8 * NT;               // NT tiles of 8 columns per block
    constexpr int MT = (M + 15) / 16;
    float c[MT][NT][4];
    for (int i = 0; i < MT; ++i) for (int j = 0; j < NT; ++j) for (int e = 0; e < 4; ++e) c[i][j][e] = 0.f;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    // A k32 chunk per warp step; lane (g, t) loads elements 8t..8t+7 of its rows. Two mma k16
    // steps consume them with the same k order in A and B (a dot product's order is free).
    // Each row tile of x, loaded once, serves the NT column tiles.
    #pragma unroll 2
    for (int kb = warp * 32; kb < K; kb += 32 * KW) {
        uint4 wv[NT];
        for (int j = 0; j < NT; ++j)
            wv[j] = n0 + 8 * j < N ? *reinterpret_cast<const uint4*>(w + (size_t)(n0 + 8 * j + g) * K + kb + 8 * t) : zero;
        for (int i = 0; i < MT; ++i) {
            const int r0 = i * 16 + g, r1 = r0 + 8;
            const uint4 x0 = r0 < M ? *reinterpret_cast<const uint4*>(x + (size_t)r0 * K + kb + 8 * t) : zero;
            const uint4 x1 = r1 < M ? *reinterpret_cast<const uint4*>(x + (size_t)r1 * K + kb + 8 * t) : zero;
            for (int j = 0; j < NT; ++j) {
                asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_T "." MMA_T ".f32 "
                             "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
                             : "+f"(c[i][j][0]), "+f"(c[i][j][1]), "+f"(c[i][j][2]), "+f"(c[i][j][3])
                             : "r"(x0.x), "r"(x1.x), "r"(x0.y), "r"(x1.y), "r"(wv[j].x), "r"(wv[j].y));
                asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_T "." MMA_T ".f32 "
                             "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
                             : "+f"(c[i][j][0]), "+f"(c[i][j][1]), "+f"(c[i][j][2]), "+f"(c[i][j][3])
                             : "r"(x0.z), "r"(x1.z), "r"(x0.w), "r"(x1.w), "r"(wv[j].z), "r"(wv[j].w));
            }
        }
    }
    __shared__ float part[KW][MT * 16][8 * NT];       // the warps' partial sums over K
    for (int i = 0; i < MT; ++i) {
        for (int j = 0; j < NT; ++j) {
            part[warp][i * 16 + g][8 * j + 2 * t] = c[i][j][0];
            part[warp][i * 16 + g][8 * j + 2 * t + 1] = c[i][j][1];
            part[warp][i * 16 + g + 8][8 * j + 2 * t] = c[i][j][2];
            part[warp][i * 16 + g + 8][8 * j + 2 * t + 1] = c[i][j][3];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < M * 8 * NT; e += blockDim.x) {
        const int row = e / (8 * NT), col = e % (8 * NT);
        if (n0 + col >= N) continue;
        float s = 0.f;
        for (int k = 0; k < KW; ++k) s += part[k][row][col];
        if (HAS_BIAS) s += static_cast<float>(bias[n0 + col]);
        out[(size_t)row * N + n0 + col] = static_cast<T>(s);
    }
"""


def serves(x: mx.array, weight: mx.array) -> bool:
    """On CUDA; x (..., K) of at most MAX_ROWS rows; weight (N, K) of x's half dtype; N % 8, K % 32."""
    if not cuda_kernels.enabled() or weight.ndim != 2 or x.dtype != weight.dtype or x.dtype not in _MMA:
        return False
    rows = x.size // x.shape[-1]
    n, k = weight.shape
    return x.shape[-1] == k and 0 < rows <= MAX_ROWS and n % 8 == 0 and k % 32 == 0


def matmul_t(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x (..., K) @ weight (N, K).T (+ bias (N,)) -> (..., N). Call only where `serves` holds."""
    n, k = weight.shape
    rows = x.size // k
    warps = 8 if rows <= 32 else 4  # split K; the partial sums fill 32 KB of shared memory either way
    run = cuda_kernels.kernel("vlmserve_skinny_gemm", ("x", "w", "bias"),
                              f'#define MMA_T "{_MMA[x.dtype]}"\n' + _SOURCE)
    out = run(
        inputs=[x.reshape(rows, k), weight, bias if bias is not None else mx.zeros((1,), x.dtype)],
        template=[("T", x.dtype), ("M", rows), ("N", n), ("K", k), ("KW", warps), ("NT", TILES),
                  ("HAS_BIAS", bias is not None)],
        grid=(-(-n // (8 * TILES)) * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1),
        output_shapes=[(rows, n)], output_dtypes=[x.dtype],
    )[0]
    return out.reshape(*x.shape[:-1], n)


def linear(layer, x: mx.array) -> mx.array:
    """`layer(x)` for an nn.Linear, through the kernel where it serves; anything else is called as is."""
    if type(layer) is nn.Linear and serves(x, layer.weight):
        return matmul_t(x, layer.weight, layer.get("bias"))
    return layer(x)
