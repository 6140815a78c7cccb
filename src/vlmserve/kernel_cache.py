"""Where compiled GPU kernels persist between runs, so a restart skips building them again.

MLX's CUDA backend keeps the kernels it generates as PTX in MLX_PTX_CACHE_DIR (by default a
temporary directory, gone with a reboot), and the driver keeps the machine code it makes of
PTX in its own cache, up to CUDA_CACHE_MAXSIZE (256 MiB by default: less than one model's
kernels). `vlmserve serve` sets both, unless the environment already does, before any process
of its own imports MLX: the PTX under the user's cache directory, per MLX version (its
headers are part of every kernel), and a driver cache of 4 GiB.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

DRIVER_CACHE_BYTES = 4 << 30


def _mlx_version() -> str:
    for dist in ("mlx", "mlx-cuda", "mlx-cuda-13", "mlx-cuda-12"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlmserve"


def use_persistent_kernel_cache() -> Path:
    """Set the kernel caches' environment (for this process and those it starts); returns the PTX directory."""
    os.environ.setdefault("MLX_PTX_CACHE_DIR", str(cache_root() / "mlx-ptx" / _mlx_version()))
    os.environ.setdefault("CUDA_CACHE_MAXSIZE", str(DRIVER_CACHE_BYTES))
    return Path(os.environ["MLX_PTX_CACHE_DIR"])
