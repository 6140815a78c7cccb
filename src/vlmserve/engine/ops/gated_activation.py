"""SwiGLU of a fused gate/up projection's output as one CUDA kernel, for a Qwen layer's MLP.

With the gate and up projections fused into one matmul (fused_projections), the MLP splits its
output in two and calls mlx_vlm's compiled `silu(gate) * up`: two primitives, where one kernel
reading both halves in place does. Each op's result is rounded to the activation dtype, as
the composed ops round it (the sigmoid's exp is CUDA's fast one: to that rounding).
"""

from __future__ import annotations

import mlx.core as mx

from vlmserve.engine.ops import cuda_kernels

_SOURCE = """
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t rows = 1;  // every position of every row: (..., 2H)
    for (int d = 0; d < gate_up_ndim - 1; ++d) rows *= gate_up_shape[d];
    if (i >= rows * H) return;
    const size_t row = i / H, j = i % H;
    const float g = static_cast<float>(gate_up[row * 2 * H + j]);
    const float u = static_cast<float>(gate_up[row * 2 * H + H + j]);
    const T s = static_cast<T>(1.f / (1.f + __expf(-g)));
    const T a = static_cast<T>(g * static_cast<float>(s));
    out[i] = static_cast<T>(static_cast<float>(a) * u);
"""


def serves(gate_up: mx.array, split: int) -> bool:
    """On CUDA, for a gate and an up half of equal width (gate first) along the last axis, in
    bf16 / fp16 (a float32 model keeps MLX's ops, which its prompt forward matches bit for bit)."""
    return (
        cuda_kernels.enabled()
        and gate_up.ndim >= 1
        and gate_up.shape[-1] == 2 * split
        and gate_up.dtype in (mx.bfloat16, mx.float16)
    )


def swiglu_halves(gate_up: mx.array, split: int) -> mx.array:
    """silu(gate_up[..., :split]) * gate_up[..., split:], in one launch (`serves` first)."""
    kernel = cuda_kernels.kernel("vlmserve_swiglu_halves", ("gate_up",), _SOURCE)
    shape = (*gate_up.shape[:-1], split)
    total = gate_up.size // 2
    return kernel(
        inputs=[gate_up],
        template=[("T", gate_up.dtype), ("H", split)],
        grid=(-(-total // 256) * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[shape],
        output_dtypes=[gate_up.dtype],
    )[0]
