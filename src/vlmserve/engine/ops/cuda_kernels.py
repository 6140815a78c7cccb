"""Whether vlmserve's own CUDA kernels (vision q/k rotation, decode attention,
the Qwen decode step's q/k/v split and its few-row matmuls) run, and whether MLX's cuDNN
attention does.

They do on MLX's CUDA backend when the GPU is the default device and of compute capability 8.0
or later, unless the environment sets VLMSERVE_CUDA_KERNELS=0; then, and on every other backend,
mlx_vlm's ops run instead.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from vlmserve.engine.ops import kernel_disk_cache

# Read once: these are asked on every linear layer's call of a step, and neither changes while a
# process runs (the environment is the operator's, set before start).
_SWITCHED_ON = os.environ.get("VLMSERVE_CUDA_KERNELS", "1") != "0"
_CUDA_BACKEND = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
_HAS_KERNEL_API = hasattr(mx.fast, "cuda_kernel")


def on_cuda() -> bool:
    """MLX's CUDA backend, with the GPU as the default device."""
    return _CUDA_BACKEND and mx.default_device() == mx.gpu


def cudnn_enabled() -> bool:
    """Whether MLX may route attention to cuDNN in this process (MLX reads it once, at first use)."""
    return on_cuda() and _cudnn_switched_on()


@functools.cache  # read once, as MLX reads it; asked in every vision block's attention
def _cudnn_switched_on() -> bool:
    return os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1") != "0"


@functools.cache
def _gpu_supported() -> bool:
    """The kernels' bfloat16 tensor-core instructions (mma.sync) need compute capability 8.0
    (Ampere) or later; on older GPUs MLX's own ops serve."""
    try:
        return int(mx.device_info().get("compute_capability_major", 0)) >= 8
    except Exception:  # noqa: BLE001 - no such figure: not a GPU these kernels were built for
        return False


def enabled() -> bool:
    return _SWITCHED_ON and _HAS_KERNEL_API and on_cuda() and _gpu_supported()


@functools.cache
def kernel(
    name: str,
    input_names: tuple[str, ...],
    source: str,
    output_names: tuple[str, ...] = ("out",),
    ensure_row_contiguous: bool = True,
    shared_memory: int = 0,
):
    """The `mx.fast.cuda_kernel` for this source, built once (on first use, on the MLX thread;
    a restart reads the build from the kernel cache: kernel_disk_cache). Without
    `ensure_row_contiguous` the kernel reads views in place (through `<name>_strides`);
    `shared_memory` is the dynamic shared memory of each launch, in bytes."""
    source = compact(source)
    built = mx.fast.cuda_kernel(
        name=name,
        input_names=list(input_names),
        output_names=list(output_names),
        source=source,
        ensure_row_contiguous=ensure_row_contiguous,
        shared_memory=shared_memory,
    )
    if kernel_disk_cache.filer() is None:
        return built
    return kernel_disk_cache.CachedKernel(built, name, input_names, output_names, source)


def note_build(kernel, *, inputs, output_dtypes, template, later: bool = False) -> None:
    """Queue the build these arguments name for the kernel cache ahead of its first use, where
    `kernel` files its builds (a kernel_disk_cache.CachedKernel); a no-op elsewhere. `later`:
    nothing uses it soon (its filing builds the others first)."""
    if isinstance(kernel, kernel_disk_cache.CachedKernel):
        kernel.note(inputs=inputs, output_dtypes=output_dtypes, template=template, later=later)


def compact(source: str) -> str:
    """The source without its comments, indentation and blank lines. MLX assembles a kernel's
    whole source and hashes it on every call (to find the build), so a decode step's ~100
    launches pay for every byte of it in host time."""
    lines = []
    for line in source.splitlines():
        quoted = False
        for i, ch in enumerate(line):
            if ch == '"' and (i == 0 or line[i - 1] != "\\"):
                quoted = not quoted
            elif not quoted and line.startswith("//", i):
                line = line[:i]
                break
        line = line.strip()
        if line:
            lines.append(line)
    return "\n".join(lines) + "\n"
