"""A depthwise 1-D convolution (one filter per channel: LFM2-VL's short convolution, Qwen3.5's
convolution before its gated delta rule) as a few shifted multiply-adds, on CUDA.

MLX runs `mx.conv1d` on CUDA through cuDNN, whose cost at a new input shape falls on the
step that meets it, and prompts prefilled together meet a new (rows, length) shape at most
steps. On an H200 (LFM2-VL with a 1.2B text model, bf16, W1 and the mixed workload at c=32),
steps that prefilled prompts together took 160-520 ms with MLX's convolution and 8-112 ms,
in proportion to their tokens, with this one. A filter of 3 or 4 taps is that many
elementwise products: nothing built per shape, and less work than a convolution launch.

Products and their sum are float32, rounded once to the output dtype, as cuDNN accumulates.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.ops import cuda_kernels


def depthwise_conv1d(x: mx.array, weight: mx.array, padding: int = 0) -> mx.array:
    """`mx.conv1d(x, weight, padding=padding, groups=C)` for x (B, L, C) and weight (C, K, 1),
    stride and dilation 1: out[b, t, c] = sum_k x[b, t + k, c] * weight[c, k, 0]."""
    dtype = mx.result_type(x, weight)
    if padding:
        x = mx.pad(x, [(0, 0), (padding, padding), (0, 0)])
    taps = weight.shape[1]
    length = x.shape[1] - taps + 1
    if length < 1:  # as mx.conv1d: slices would broadcast to an empty result instead
        raise ValueError(f"a {taps}-tap filter needs at least {taps} positions, not {x.shape[1]}")
    w = weight[:, :, 0].astype(mx.float32)
    out = x[:, :length].astype(mx.float32) * w[:, 0]
    for k in range(1, taps):
        out = out + x[:, k : k + length].astype(mx.float32) * w[:, k]
    return out.astype(dtype)


class PlanFreeDepthwiseConv1d(nn.Conv1d):
    """An `nn.Conv1d` of one filter per channel that runs `depthwise_conv1d` (same parameters)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = depthwise_conv1d(x, self.weight, self.padding)
        return y + self.bias if "bias" in self else y


def is_depthwise(module) -> bool:
    """An nn.Conv1d with one filter per channel, stride 1 and dilation 1."""
    return (
        isinstance(module, nn.Conv1d)
        and module.weight.shape[-1] == 1
        and module.groups == module.weight.shape[0]
        and module.stride == 1
        and module.dilation == 1
    )


def install(model: nn.Module, force: bool = False) -> int:
    """Run the depthwise convolutions in `model` plan-free, on CUDA (elsewhere MLX's own
    kernel needs no plan, and keeps mlx_vlm's outputs bit for bit); returns how many."""
    if not (force or cuda_kernels.on_cuda()):
        return 0
    swapped = 0
    for _, module in model.named_modules():
        if is_depthwise(module) and type(module) is nn.Conv1d:
            module.__class__ = PlanFreeDepthwiseConv1d  # same attributes and parameters
            swapped += 1
    return swapped
