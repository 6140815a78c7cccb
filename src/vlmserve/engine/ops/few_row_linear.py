"""A decode step's linear layers through the few-row kernels where they serve the call: dense
bf16/fp16 weights (few_row_matmul) and affine-quantized ones (few_row_quantized); the
layer's own call otherwise.

A launch takes up to few_row_matmul.most_rows rows: 64 for a narrow layer (once that build is
checked, while the server is idle), 32 for a wide one. A quantized layer over more rows runs
the kernel on even slices (at 32 rows MLX's quantized matmul took 3 to 10 times the kernel's
time per layer on the H100, so two or four launches still cost less); a dense one takes MLX's
matmul."""

from __future__ import annotations

import math
from itertools import accumulate

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.ops import few_row_matmul, few_row_quantized

# Where a layer's launches are kept: an attribute of the layer, not one of its parameters.
_LAUNCHES = "_vlmserve_few_row_launches"


def linear(layer: nn.Module, x: mx.array) -> mx.array:
    """`layer(x)` for an nn.Linear or nn.QuantizedLinear."""
    if type(layer) is nn.Linear:
        launch = _launch(layer, x, _dense_launch)
        if launch is not None:
            return launch(x)
    elif isinstance(layer, nn.QuantizedLinear):  # many_row_dequantized's subclass too
        return _quantized(layer, x, layer)
    return layer(x)


def tied_logits(embedding: nn.Module, h: mx.array) -> mx.array:
    """`embedding.as_linear(h)`: the logits of a model whose output layer is its token embedding."""
    if type(embedding) is nn.Embedding:
        launch = _launch(embedding, h, _dense_launch)
        if launch is not None:
            return launch(h)
    if isinstance(embedding, nn.QuantizedEmbedding):  # many_row_dequantized's subclass too
        return _quantized(embedding, h, embedding.as_linear)
    return embedding.as_linear(h)


def _launch(layer: nn.Module, x: mx.array, make):
    """The kernel launch that serves layer(x), or None (the layer's own call): `make`'s answer,
    kept on the layer per input dtype and shape once it is final. A decode step asks this of
    every linear layer, and the checks and launch settings cost more host time than the launch.
    A kept launch is used only while the layer holds the weight it was made for (a shallow copy
    of a layer shares the attribute, and may hold other weights)."""
    kept = layer.__dict__.get(_LAUNCHES)
    if kept is None:
        kept = {}
        object.__setattr__(layer, _LAUNCHES, kept)  # past nn.Module's __setattr__, which would make it a parameter
    key = (x.dtype, x.shape)
    weight = layer["weight"]
    hit = kept.get(key)
    if hit is not None and hit[0] is weight:
        return hit[1]
    launch, final = make(layer, x)
    if final:
        kept[key] = (weight, launch)
    return launch


def _dense_launch(layer: nn.Module, x: mx.array):
    bias = layer.get("bias", None)
    served = few_row_matmul.verdict(x, layer["weight"], bias)
    launch = few_row_matmul.prepare(x, layer["weight"], bias) if served else None
    return launch, served is not None  # an unchecked build may serve later


def _quantized_launch(layer: nn.Module, x: mx.array):
    served = few_row_quantized.verdict(layer, x)
    launch = few_row_quantized.prepare(layer, x) if served else None
    return launch, served is not None  # an unchecked setting may be served later


def _quantized(layer: nn.Module, x: mx.array, own) -> mx.array:
    """The kernel over x's rows: one launch where it serves them, else even slices of at most
    64 rows, else of at most 32; `own(x)` where none serves."""
    launch = _launch(layer, x, _quantized_launch)
    if launch is not None:
        return launch(x)
    rows = math.prod(x.shape[:-1])
    flat = x.reshape(rows, x.shape[-1])
    for most in (few_row_matmul.NARROW_MAX_ROWS, few_row_matmul.MAX_ROWS):
        if rows <= most or most > few_row_matmul.most_rows(layer["weight"].shape[0]):
            continue
        count = -(-rows // most)
        sizes = [rows // count + (i < rows % count) for i in range(count)]  # each >= most / 2
        pieces = mx.split(flat, list(accumulate(sizes[:-1])), axis=0)
        launches = [_launch(layer, p, _quantized_launch) for p in pieces]
        if all(launch is not None for launch in launches):
            out = mx.concatenate([launch(p) for launch, p in zip(launches, pieces)], axis=0)
            return out.reshape(*x.shape[:-1], out.shape[-1])
    return own(x)
