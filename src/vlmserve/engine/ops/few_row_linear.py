"""A decode step's linear layers through the few-row kernels where they serve the call: dense
bf16/fp16 weights (few_row_matmul) and affine-quantized ones (few_row_quantized); the
layer's own call otherwise."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.ops import few_row_matmul, few_row_quantized


def linear(layer: nn.Module, x: mx.array) -> mx.array:
    """`layer(x)` for an nn.Linear or nn.QuantizedLinear."""
    if type(layer) is nn.Linear:
        bias = layer.get("bias", None)
        if few_row_matmul.serves(x, layer["weight"], bias):
            return few_row_matmul.matmul(x, layer["weight"], bias)
    elif type(layer) is nn.QuantizedLinear and few_row_quantized.serves_layer(layer, x):
        return few_row_quantized.matmul(layer, x)
    return layer(x)


def tied_logits(embedding: nn.Module, h: mx.array) -> mx.array:
    """`embedding.as_linear(h)`: the logits of a model whose output layer is its token embedding."""
    if type(embedding) is nn.Embedding and few_row_matmul.serves(h, embedding.weight):
        return few_row_matmul.matmul(h, embedding.weight)
    if type(embedding) is nn.QuantizedEmbedding and few_row_quantized.serves_layer(embedding, h):
        return few_row_quantized.matmul(embedding, h)
    return embedding.as_linear(h)
