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

While MLX's quantized matmul kernels for a setting (bits, group size) are still being built by
side processes after a first start (engine/kernel_prebuild.py: ~30 s each with an empty kernel
cache), calls of 8 rows or more that would take them run dequantized too (`hold`, `release`):
no request waits for that build. Fewer rows take MLX's quantized matrix-vector kernel, which
is compiled into MLX.

The weight is dequantized by a kernel of its own where vlmserve's CUDA kernels run (4 or 8 bits,
bf16 or fp16 scales): each thread turns one 32-bit word of codes into 8 or 4 weights, written
in one 16- or 8-byte store, computing scale * q + bias in float32 and rounding once.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.ops import cuda_kernels

MIN_ROWS = 256  # below this the quantized matmul is as fast (and decode steps stay quantized)
QMM_MIN_ROWS = 8  # from here MLX's quantized matmul takes its compiled-at-first-use kernel

# (bits, group size) whose MLX quantized matmul kernels are not built yet: see the docstring.
_UNBUILT: set[tuple[int, int]] = set()
# Settings held in this process and since built -> the activation dtype they were built for.
_BUILT: dict[tuple[int, int], mx.Dtype] = {}


def hold(settings) -> None:
    """Run calls of QMM_MIN_ROWS rows or more dequantized for these (bits, group size) settings."""
    _UNBUILT.update(settings)


def release(setting: tuple[int, int], dtype: mx.Dtype) -> None:
    """MLX's kernels for this setting are built, for `dtype` activations: the calls they serve
    take the quantized matmul again (`_dequantized`)."""
    if setting in _UNBUILT:
        _UNBUILT.discard(setting)
        _BUILT[setting] = dtype


def unhold(setting: tuple[int, int]) -> None:
    """Let go of a held setting without a build taken for it: MLX's quantized matmul serves its
    calls as it would have (warm-up then compiles what they take)."""
    _UNBUILT.discard(setting)


def reset() -> None:
    """Forget every setting held or built (an engine that stops)."""
    _UNBUILT.clear()
    _BUILT.clear()


def held() -> frozenset[tuple[int, int]]:
    return frozenset(_UNBUILT)


def _dequantized(layer: nn.Module, x: mx.array) -> bool:
    """Whether layer(x) runs on the dequantized weight."""
    rows = math.prod(x.shape[:-1])
    if rows >= MIN_ROWS or x.shape[-1] <= layer.group_size:
        # A single group a row: MLX's CUDA quantized matmul (0.32.4) gives wrong and run-to-run
        # different results there, at any row count (benchmarks/qmm_one_group.py).
        return True
    if rows < QMM_MIN_ROWS or not (_UNBUILT or _BUILT):
        return False
    setting = (layer.bits, layer.group_size)
    if setting in _UNBUILT:
        return True
    built = _BUILT.get(setting)
    return built is not None and not _built_kernel_takes(layer, x, built)


def _built_kernel_takes(layer: nn.Module, x: mx.array, dtype: mx.Dtype) -> bool:
    """Whether MLX's quantized matmul takes layer(x) with the kernel built for `dtype`: its tiled
    kernel's own test (supports_qmm_sm80: outputs a multiple of 128, inputs of max(64, group
    size)). Another call would compile another kernel (MLX's qmm_naive) at its first use, which
    warm-up did not run (the setting was held then): it stays dequantized."""
    n, k = layer["weight"].shape[0], x.shape[-1]
    return x.dtype == dtype and n % 128 == 0 and k % max(64, layer.group_size) == 0


class ManyRowDequantizedLinear(nn.QuantizedLinear):
    """An nn.QuantizedLinear (its class swapped in place: same parameters, same attributes) that
    computes calls over MIN_ROWS rows or more with its weight dequantized."""

    def __call__(self, x: mx.array) -> mx.array:
        if not _dequantized(self, x):
            return super().__call__(x)
        y = x @ dequantize(self).astype(x.dtype).T
        if "bias" in self:
            y = y + self["bias"]
        return y


class ManyRowDequantizedEmbedding(nn.QuantizedEmbedding):
    """An nn.QuantizedEmbedding whose `as_linear` (the logits of a model whose output layer is its
    token embedding) is computed as ManyRowDequantizedLinear's calls are."""

    def as_linear(self, x: mx.array) -> mx.array:
        if not _dequantized(self, x):
            return super().as_linear(x)
        return x @ dequantize(self).astype(x.dtype).T


_SWAPS = {nn.QuantizedLinear: ManyRowDequantizedLinear, nn.QuantizedEmbedding: ManyRowDequantizedEmbedding}

_DEQUANTIZE = """
    constexpr int CPW = 32 / BITS;                   // codes per 32-bit word
    constexpr int WPR = K / CPW;                     // words per weight row
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)w_shape[0] * WPR) return;
    const size_t row = i / WPR;
    const int k0 = (int)(i % WPR) * CPW;
    const float s = static_cast<float>(scales[row * (K / GS) + k0 / GS]);
    const float b = static_cast<float>(biases[row * (K / GS) + k0 / GS]);
    const uint32_t v = w[i];
    T out[CPW];
    #pragma unroll
    for (int j = 0; j < CPW; ++j) out[j] = static_cast<T>((float)((v >> (BITS * j)) & ((1u << BITS) - 1)) * s + b);
    if constexpr (CPW == 8) {
        *reinterpret_cast<uint4*>(y + row * K + k0) = *reinterpret_cast<const uint4*>(out);
    } else {
        *reinterpret_cast<uint2*>(y + row * K + k0) = *reinterpret_cast<const uint2*>(out);
    }
"""
_THREADS = 256


def _kernel_serves(layer: nn.Module) -> bool:
    w, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    return (
        cuda_kernels.enabled()
        and layer.bits in (4, 8)
        and biases is not None
        and scales.dtype in (mx.bfloat16, mx.float16)
        and biases.dtype == scales.dtype
        and w.dtype == mx.uint32
        and w.ndim == 2
    )


def dequantize(layer: nn.Module) -> mx.array:
    """The layer's weight (N, K) in its scales' dtype, as `mx.dequantize` computes it."""
    w, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    if not _kernel_serves(layer):
        return mx.dequantize(w, scales, biases, group_size=layer.group_size, bits=layer.bits)
    kernel, call = _kernel_call(layer)
    return kernel(
        **call,
        grid=(-(-w.size // _THREADS) * _THREADS, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(w.shape[0], w.shape[1] * 32 // layer.bits)],
    )[0]


def _kernel_call(layer: nn.Module):
    """The dequantize kernel and the arguments that name its build for this layer."""
    w, scales, biases = layer["weight"], layer["scales"], layer["biases"]
    kernel = cuda_kernels.kernel("vlmserve_dequantize", ("w", "scales", "biases"), _DEQUANTIZE, output_names=("y",))
    template = [
        ("T", scales.dtype),
        ("BITS", layer.bits),
        ("GS", layer.group_size),
        ("K", w.shape[1] * 32 // layer.bits),
    ]
    return kernel, {"inputs": [w, scales, biases], "template": template, "output_dtypes": [scales.dtype]}


def prefetch(module: nn.Module) -> None:
    """Queue the dequantize kernel's build of every swapped layer under `module` for the kernel
    cache (kernel_disk_cache): side processes compile them before the first prompt needs them."""
    for _, layer in module.named_modules():
        if type(layer) in _SWAPS.values() and _kernel_serves(layer):
            kernel, call = _kernel_call(layer)
            cuda_kernels.note_build(kernel, **call)


def install(module: nn.Module) -> int:
    """Swap every affine-quantized linear layer and embedding under `module`; returns how many."""
    count = 0
    for _, layer in module.named_modules():
        swap = _SWAPS.get(type(layer))
        if swap is not None and getattr(layer, "mode", "affine") == "affine":
            layer.__class__ = swap
            count += 1
    return count


def installed(module: nn.Module) -> bool:
    """Whether `install` swapped any layer under `module`."""
    return any(type(layer) in _SWAPS.values() for _, layer in module.named_modules())
