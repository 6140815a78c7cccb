"""The kernel builds a start runs beside the engine: MLX's quantized matmul (kernel_prebuild) and
indexing kernels (indexing_prebuild), started as soon as the model is known.

An engine process starts them before it imports its model libraries (process_main), which
takes seconds that the builds then overlap: on a first start the load's first forward meets
modules they are building. Imports MLX's core only (to ask for its CUDA backend).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from vlmserve.engine import indexing_prebuild, kernel_prebuild
from vlmserve.engine.ops import cuda_kernels
from vlmserve.kernel_cache import use_persistent_kernel_cache

log = logging.getLogger(__name__)


@dataclass
class SideBuilds:
    """What one start set building: the model they are for, and the build processes."""

    model_path: Path
    qmm: list[kernel_prebuild.KernelBuild] = field(default_factory=list)
    indexing: indexing_prebuild.Prebuild | None = None


def start(model_path: Path) -> SideBuilds:
    """Start the builds this model lacks in the kernel cache (none off CUDA)."""
    builds = SideBuilds(model_path)
    if not cuda_kernels.on_cuda():
        return builds
    try:
        _start_on_cuda(builds)
    except BaseException:
        stop(builds)  # none outlives a start that fails halfway
        raise
    return builds


def _start_on_cuda(builds: SideBuilds) -> None:
    model_path = builds.model_path
    ptx = use_persistent_kernel_cache()
    entries = sum(1 for _ in ptx.iterdir()) if ptx.is_dir() else 0
    if entries:
        log.info("kernel cache: %s (%d entries from earlier runs)", ptx, entries)
    else:  # MLX builds each of its kernels at first use, one after another: say why this start is slow
        log.info(
            "kernel cache: %s is empty: this start builds the GPU kernels (most beside the engine; "
            "a minute or two in all for a small model); later starts on this machine read them from there",
            ptx,
        )
    # The engine serves the affine settings' layers dequantized until their builds land
    # (many_row_dequantized): those run behind the builds it waits for.
    background = ("affine",) if cuda_kernels.enabled() else ()
    builds.qmm = kernel_prebuild.start(model_path, background)
    if builds.qmm:
        log.info("building %d quantized matmul kernels in parallel processes", len(builds.qmm))
    builds.indexing = indexing_prebuild.start(model_path)
    if builds.indexing is not None:
        log.info(
            "building %d of MLX's indexing kernels in %d parallel processes",
            len(builds.indexing.specs),
            len(builds.indexing.builds),
        )


def start_early(model: str) -> SideBuilds | None:
    """`start` for the model a server names, before the engine loads, where it is on disk already:
    None otherwise (the engine's start fetches it, or says why it cannot, and starts them then)."""
    from vlmserve.models.paths import resolve_model_path

    try:
        path = resolve_model_path(model, local_only=True)
    except Exception:  # noqa: BLE001 - not here yet, or no model: the engine's start deals with it
        return None
    try:
        return start(path)
    except Exception:  # noqa: BLE001 - an odd config or cache: the engine's start tries again, and says why
        log.warning("could not start the kernel builds ahead of the load", exc_info=True)
        return None


def stop(builds: SideBuilds) -> None:
    """End the build processes still running (what they filed stays filed)."""
    for build in builds.qmm:
        build.kill()
    if builds.indexing is not None:
        builds.indexing.stop()
