"""Affine-quantized linear layers over many rows (prefill, the vision tower) as a dense matmul of
the weight dequantized on the fly.

On CUDA, MLX's quantized matmul at hundreds of rows or more is a general tiled GEMM, slower
than cuBLAS on the same weight in bf16 even counting the dequantization: on an H200, an
8960x1536 4-bit layer (group 64) over 512 / 2048 / 8192 rows took 0.20 / 0.54 / 1.70 ms
quantized and 0.11 / 0.21 / 0.49 ms dequantized first (benchmarks/qmm_rows.py). A prefill
forward reads each weight once, so the bf16 copy is a transient of one layer. Few rows (a
decode step) keep the quantized kernels, which read a quarter of the bytes.

The outputs differ from MLX's quantized matmul by rounding only (the same dequantized values,
summed in another order); installed on CUDA only, where no test compares them to mlx_vlm's
bit for bit.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

MIN_ROWS = 256  # below this the quantized matmul is as fast (and decode steps stay quantized)


class ManyRowDequantizedLinear(nn.QuantizedLinear):
    """An nn.QuantizedLinear (its class swapped in place: same parameters, same attributes) that
    computes calls over MIN_ROWS rows or more with its weight dequantized."""

    def __call__(self, x: mx.array) -> mx.array:
        if math.prod(x.shape[:-1]) < MIN_ROWS:
            return super().__call__(x)
        w = mx.dequantize(
            self["weight"], self["scales"], self.get("biases"), group_size=self.group_size, bits=self.bits
        )
        y = x @ w.astype(x.dtype).T
        if "bias" in self:
            y = y + self["bias"]
        return y


def install(module: nn.Module) -> int:
    """Swap every affine-quantized linear layer under `module`; returns how many."""
    count = 0
    for _, layer in module.named_modules():
        if type(layer) is nn.QuantizedLinear and getattr(layer, "mode", "affine") == "affine":
            layer.__class__ = ManyRowDequantizedLinear
            count += 1
    return count
