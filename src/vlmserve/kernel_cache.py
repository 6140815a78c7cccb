"""Where compiled GPU kernels persist between runs.

MLX's CUDA backend keeps the PTX it compiles in the system temp directory by default (lost at
reboot, and unwritable for a service user when another user made it first), and the CUDA
driver its binaries in ~/.nv/ComputeCache, up to 256 MiB (less than one model's kernels).
Unless the environment names them already, both go under the user's cache directory and the
driver's may hold 4 GiB, so a restart on the same machine reuses the kernels the last run
built. The driver reads its variables when CUDA starts, which importing MLX does: `vlmserve
serve` calls this first, before any of its processes imports MLX. No MLX import here.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

DRIVER_CACHE_BYTES = 4 << 30


def cache_root() -> Path:
    """$VLMSERVE_CACHE_DIR, else vlmserve under $XDG_CACHE_HOME (default ~/.cache)."""
    explicit = os.environ.get("VLMSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlmserve"


def package_version(package: str) -> str:
    """An installed package's version without importing it ("unknown" where it is not installed):
    what a cache of kernels built with it is keyed by."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def use_persistent_kernel_cache() -> Path:
    """Name the caches in the environment (for this process and those it starts); returns MLX's directory."""
    # MLX's own headers are part of every kernel it builds: one directory per MLX version.
    ptx = Path(os.environ.setdefault("MLX_PTX_CACHE_DIR", str(cache_root() / "mlx-ptx" / package_version("mlx"))))
    os.environ.setdefault("CUDA_CACHE_PATH", str(cache_root() / "cuda"))
    os.environ.setdefault("CUDA_CACHE_MAXSIZE", str(DRIVER_CACHE_BYTES))
    # MLX's in-memory caches on CUDA (attention plans, matmul setups) raise on every miss once a
    # thread's misses pass twice their capacity, a check meant for benchmarks: a server that
    # meets a few hundred image sizes over its life would then fail requests. Their LRU eviction
    # stays.
    os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")
    return ptx
