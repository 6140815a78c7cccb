"""A residual add and the RMS norm after it as one CUDA kernel, for a Qwen layer's halves.

A decode step or prompt piece on CUDA is bound by the cost of each primitive it launches, and every layer of
a pre-norm transformer ends both halves the same way: `h = h + delta`, then an RMS norm of h
for what follows. Here one launch per row gives both: h + delta rounded to the activation
dtype (as MLX's add rounds it) and the norm as MLX's rms_norm computes it (the mean square
in float32, x * rsqrt(mean + eps) rounded to the dtype, times the weight). The mean square's
summation order differs from MLX's kernel, so the norm agrees to that rounding, not bit for bit.
"""

from __future__ import annotations

import mlx.core as mx

from vlmserve.engine.ops import cuda_kernels
from vlmserve.engine.ops.decode_attention import float32_bits

_THREADS = 256

# One block of NT threads per row of D elements; thread t holds elements t, t + NT, ...
_SOURCE = """
    constexpr int NT = 256, PER = (D + NT - 1) / NT;
    const int t = threadIdx.x;
    const size_t base = (size_t)blockIdx.x * D;
    float x[PER];
    float ss = 0.f;
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = t + j * NT;
        if (i < D) {
            const T s = static_cast<T>(static_cast<float>(h[base + i]) + static_cast<float>(delta[base + i]));
            h_out[base + i] = s;
            x[j] = static_cast<float>(s);
            ss += x[j] * x[j];
        }
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    __shared__ float part[NT / 32];
    if ((t & 31) == 0) part[t >> 5] = ss;
    __syncthreads();
    float total = 0.f;
    #pragma unroll
    for (int w = 0; w < NT / 32; ++w) total += part[w];
    const float n = rsqrtf(total / D + __int_as_float(EPS_BITS));
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = t + j * NT;
        if (i < D) normed[base + i] = static_cast<T>(static_cast<float>(static_cast<T>(x[j] * n)) * static_cast<float>(weight[i]));
    }
"""


def serves(h: mx.array, norm) -> bool:
    """On CUDA, for a bf16 / fp16 activation and an RMS norm with a weight of its dtype and width
    (`norm` is mlx.nn.RMSNorm or alike: `weight`, `eps`). A float32 model keeps MLX's ops, which
    its prompt forward matches bit for bit."""
    weight = getattr(norm, "weight", None)
    return (
        cuda_kernels.enabled()
        and weight is not None
        and hasattr(norm, "eps")
        and h.dtype in (mx.bfloat16, mx.float16)
        and weight.dtype == h.dtype
        and weight.shape == (h.shape[-1],)
    )


def add_rms_norm(h: mx.array, delta: mx.array, norm, kernel: bool = True) -> tuple[mx.array, mx.array]:
    """(h + delta, norm(h + delta)): in one launch with `kernel` where `serves`; else MLX's two ops."""
    if not kernel or not serves(h, norm) or delta.shape != h.shape or delta.dtype != h.dtype:
        h = h + delta
        return h, norm(h)
    dim = h.shape[-1]
    kernel = cuda_kernels.kernel(
        "vlmserve_add_rms_norm", ("h", "delta", "weight"), _SOURCE, output_names=("h_out", "normed")
    )
    return tuple(
        kernel(
            inputs=[h, delta, norm.weight],
            template=[("T", h.dtype), ("D", dim), ("EPS_BITS", float32_bits(norm.eps))],
            grid=(h.size // dim * _THREADS, 1, 1),
            threadgroup=(_THREADS, 1, 1),
            output_shapes=[h.shape, h.shape],
            output_dtypes=[h.dtype, h.dtype],
        )
    )
