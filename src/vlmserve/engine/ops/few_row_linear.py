"""A decode step's linear layers through the few-row kernels where they serve the call: dense
bf16/fp16 weights (few_row_matmul) and affine-quantized ones (few_row_quantized); the
layer's own call otherwise.

A quantized layer over more rows than one launch takes (a step of 48 to 128 rows) runs the
kernel on even slices of at most MAX_ROWS rows: at 32 rows MLX's quantized matmul took 3 to
10 times the kernel's time per layer on the H100, so two or four launches still cost less.
(Dense layers past MAX_ROWS keep MLX's matmul, which is as fast there.)"""

from __future__ import annotations

import math
from itertools import accumulate

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.ops import few_row_matmul, few_row_quantized


def linear(layer: nn.Module, x: mx.array) -> mx.array:
    """`layer(x)` for an nn.Linear or nn.QuantizedLinear."""
    if type(layer) is nn.Linear:
        bias = layer.get("bias", None)
        if few_row_matmul.serves(x, layer["weight"], bias):
            return few_row_matmul.matmul(x, layer["weight"], bias)
    elif isinstance(layer, nn.QuantizedLinear):  # many_row_dequantized's subclass too
        return _quantized(layer, x, layer)
    return layer(x)


def tied_logits(embedding: nn.Module, h: mx.array) -> mx.array:
    """`embedding.as_linear(h)`: the logits of a model whose output layer is its token embedding."""
    if type(embedding) is nn.Embedding and few_row_matmul.serves(h, embedding.weight):
        return few_row_matmul.matmul(h, embedding.weight)
    if type(embedding) is nn.QuantizedEmbedding:
        return _quantized(embedding, h, embedding.as_linear)
    return embedding.as_linear(h)


def _quantized(layer: nn.Module, x: mx.array, own) -> mx.array:
    """The kernel over x's rows, in even slices past MAX_ROWS; `own(x)` where it does not serve."""
    if few_row_quantized.serves_layer(layer, x):
        return few_row_quantized.matmul(layer, x)
    rows = math.prod(x.shape[:-1])
    if rows <= few_row_matmul.MAX_ROWS:
        return own(x)
    count = -(-rows // few_row_matmul.MAX_ROWS)
    sizes = [rows // count + (i < rows % count) for i in range(count)]  # each >= MAX_ROWS / 2
    flat = x.reshape(rows, x.shape[-1])
    pieces = mx.split(flat, list(accumulate(sizes[:-1])), axis=0)
    if not all(few_row_quantized.serves_layer(layer, p) for p in pieces):
        return own(x)
    out = mx.concatenate([few_row_quantized.matmul(layer, p) for p in pieces], axis=0)
    return out.reshape(*x.shape[:-1], out.shape[-1])
