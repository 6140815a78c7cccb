"""Whether vlmserve's own CUDA kernels (vision q/k rotation, decode attention) run.

They do on MLX's CUDA backend when the GPU is the default device, unless the environment
sets VLMSERVE_CUDA_KERNELS=0; then, and on every other backend, mlx_vlm's ops run instead.
"""

from __future__ import annotations

import os

import mlx.core as mx


def enabled() -> bool:
    cuda = getattr(mx, "cuda", None)
    return (os.environ.get("VLMSERVE_CUDA_KERNELS", "1") != "0" and cuda is not None
            and cuda.is_available() and mx.default_device() == mx.gpu and hasattr(mx.fast, "cuda_kernel"))
