"""`x @ w.T (+ bias)` for the few rows of a decode step, as one CUDA kernel on tensor cores.

A decode step multiplies at most a few dozen rows by every weight matrix. MLX sends each
such matmul to cuBLASLt, which builds its descriptors and asks for a heuristic on every call:
about 13 us of host time per matmul on the H200, whatever the size, and the step has 113 of
them (28 layers x 4 + the logits), while the GPU needs ~1 ms to stream all the weights.
A custom kernel launch costs ~2.5 us of host time.

Each block computes 8 output columns for all rows; its warps split the K dimension and add
their partial sums in shared memory. The products go through `mma.sync` (bf16 or fp16 in,
float32 accumulation), as cuBLAS's do, but in another summation order: results agree to
the output dtype's rounding, not bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import cuda_kernels

MAX_ROWS = 64  # four 16-row tiles per warp
WARPS = 4
_MMA = {mx.bfloat16: "bf16", mx.float16: "f16"}

_SOURCE = """
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;           // mma fragment coordinates
    const int n0 = blockIdx.x * 8;
    constexpr int MT = (M + 15) / 16;
    float c[MT][4];
    for (int i = 0; i < MT; ++i) for (int j = 0; j < 4; ++j) c[i][j] = 0.f;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    // A k32 chunk per warp step; lane (g, t) loads elements 8t..8t+7 of its rows. Two mma k16
    // steps consume them with the same k order in A and B (a dot product's order is free).
    #pragma unroll 4
    for (int kb = warp * 32; kb < K; kb += 32 * KW) {
        const uint4 wv = *reinterpret_cast<const uint4*>(w + (size_t)(n0 + g) * K + kb + 8 * t);
        for (int i = 0; i < MT; ++i) {
            const int r0 = i * 16 + g, r1 = r0 + 8;
            const uint4 x0 = r0 < M ? *reinterpret_cast<const uint4*>(x + (size_t)r0 * K + kb + 8 * t) : zero;
            const uint4 x1 = r1 < M ? *reinterpret_cast<const uint4*>(x + (size_t)r1 * K + kb + 8 * t) : zero;
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_T "." MMA_T ".f32 "
                         "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
                         : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3])
                         : "r"(x0.x), "r"(x1.x), "r"(x0.y), "r"(x1.y), "r"(wv.x), "r"(wv.y));
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_T "." MMA_T ".f32 "
                         "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
                         : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3])
                         : "r"(x0.z), "r"(x1.z), "r"(x0.w), "r"(x1.w), "r"(wv.z), "r"(wv.w));
        }
    }
    __shared__ float part[KW][MT * 16][8];
    for (int i = 0; i < MT; ++i) {
        part[warp][i * 16 + g][2 * t] = c[i][0];
        part[warp][i * 16 + g][2 * t + 1] = c[i][1];
        part[warp][i * 16 + g + 8][2 * t] = c[i][2];
        part[warp][i * 16 + g + 8][2 * t + 1] = c[i][3];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < M * 8; e += blockDim.x) {
        const int row = e / 8, col = e % 8;
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
    run = cuda_kernels.kernel("vlmserve_skinny_gemm", ("x", "w", "bias"),
                              f'#define MMA_T "{_MMA[x.dtype]}"\n' + _SOURCE)
    out = run(
        inputs=[x.reshape(rows, k), weight, bias if bias is not None else mx.zeros((1,), x.dtype)],
        template=[("T", x.dtype), ("M", rows), ("N", n), ("K", k), ("KW", WARPS), ("HAS_BIAS", bias is not None)],
        grid=(n // 8 * 32 * WARPS, 1, 1), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(rows, n)], output_dtypes=[x.dtype],
    )[0]
    return out.reshape(*x.shape[:-1], n)


def linear(layer, x: mx.array) -> mx.array:
    """`layer(x)` for an nn.Linear, through the kernel where it serves; anything else is called as is."""
    if type(layer) is nn.Linear and serves(x, layer.weight):
        return matmul_t(x, layer.weight, layer.get("bias"))
    return layer(x)
