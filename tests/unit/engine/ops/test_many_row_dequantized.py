"""many_row_dequantized: a quantized linear layer over many rows computes with its weight
dequantized (the same values as MLX's quantized matmul, up to summation order); over few rows it
is MLX's quantized matmul, bit for bit; it stays an nn.QuantizedLinear to every check."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread


def test_many_rows_dequantize_few_rows_stay_quantized():
    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import many_row_dequantized

        mx.random.seed(0)
        layer = nn.QuantizedLinear(128, 96, bias=True, group_size=64, bits=4)
        reference = nn.QuantizedLinear(128, 96, bias=True, group_size=64, bits=4)
        reference.update(layer.parameters())
        holder = nn.Sequential(layer)
        swapped = many_row_dequantized.install(holder)
        few = mx.random.normal((2, 8, 128))
        many = mx.random.normal((many_row_dequantized.MIN_ROWS, 128))
        weight = mx.dequantize(layer["weight"], layer["scales"], layer["biases"], group_size=64, bits=4)
        return (
            swapped,
            isinstance(layer, nn.QuantizedLinear),
            np.array(layer(few)),
            np.array(reference(few)),
            np.array(layer(many)),
            np.array(many @ weight.T + layer["bias"]),
            np.array(reference(many)),
            many_row_dequantized.install(holder),
        )

    swapped, still_quantized, few, few_ref, many, many_dense, many_ref, again = on_own_thread(work)
    assert swapped == 1 and still_quantized and again == 0
    assert np.array_equal(few, few_ref)  # few rows: MLX's quantized matmul itself
    assert np.array_equal(many, many_dense)  # many rows: the dequantized weight's matmul
    np.testing.assert_allclose(many, many_ref, rtol=1e-4, atol=1e-4)  # the same values as quantized
