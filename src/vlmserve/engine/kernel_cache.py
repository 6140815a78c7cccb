"""Where compiled GPU kernels persist between runs.

MLX's CUDA backend keeps the PTX it compiles in the system temp directory by default (lost at
reboot, and unwritable for a service user when another user made it first), and the CUDA
driver its binaries in ~/.nv/ComputeCache, up to 256 MiB (less than one model's kernels).
Unless the environment names them already, both go under the user's cache directory and the
driver's may hold 4 GiB, so a restart on the same machine reuses the kernels the last run
built. The driver reads its variables once, when CUDA starts: call this before any MLX work.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import mlx.core as mx

log = logging.getLogger(__name__)

DRIVER_CACHE_BYTES = 4 << 30


def cache_root() -> Path:
    """$VLMSERVE_CACHE_DIR, else vlmserve under $XDG_CACHE_HOME (default ~/.cache)."""
    explicit = os.environ.get("VLMSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlmserve"


def use_persistent_kernel_cache() -> Path:
    """Name the two caches' directories (both are made on first use); returns MLX's."""
    ptx = Path(os.environ.setdefault("MLX_PTX_CACHE_DIR", str(cache_root() / "mlx-ptx" / mx.__version__)))
    os.environ.setdefault("CUDA_CACHE_PATH", str(cache_root() / "cuda"))
    os.environ.setdefault("CUDA_CACHE_MAXSIZE", str(DRIVER_CACHE_BYTES))
    if getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
        entries = sum(1 for _ in ptx.iterdir()) if ptx.is_dir() else 0
        log.info("kernel cache: %s (%d entries from earlier runs)", ptx, entries)
    return ptx
