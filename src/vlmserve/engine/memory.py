"""How much memory the KV blocks may take: the operator's figure, or a share of the device's.

vLLM's `--gpu-memory-utilization` in spirit: the server as a whole may use that fraction of
the device's memory; what the weights and a working reserve leave of it is the KV budget.
The pools grow into it only as rows need blocks (runner/block_pool.py), so a large budget
costs nothing until traffic uses it.
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx

log = logging.getLogger(__name__)

_GIB = 1 << 30


def device_memory_bytes() -> int:
    """The memory the device can use: what MLX reports, else the host's RAM (CPU backend)."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def wire_memory(weights_bytes: int) -> int | None:
    """On Apple silicon, keep up to the GPU's recommended working set wired (resident), as
    mlx-lm and mlx-vlm do while they generate: macOS may otherwise page weights and KV out
    under memory pressure, and each step then waits for them. Returns the limit set, None on
    other backends (nothing to do there)."""
    metal = getattr(mx, "metal", None)
    if metal is None or not metal.is_available():
        return None
    limit = int(mx.device_info().get("max_recommended_working_set_size", 0))
    if not limit:
        return None
    if weights_bytes > 0.9 * limit:
        log.warning(
            "the weights take %.1f GB of the GPU's %.1f GB recommended working set: expect paging and "
            "slow steps (a smaller quantization or a machine with more memory avoids it)",
            weights_bytes / 1e9,
            limit / 1e9,
        )
    try:
        mx.set_wired_limit(limit)
    except Exception as exc:  # noqa: BLE001 - above the system's own wired limit (sysctl iogpu.wired_limit_mb)
        log.warning("the wired memory limit was not set (%s); weights may page out under memory pressure", exc)
        return None
    log.info("wired memory limit: %.1f GB (the GPU's recommended working set)", limit / 1e9)
    return limit


def kv_budget_bytes(kv_cache_memory_gb: float | None, utilization: float) -> int:
    """Bytes the KV blocks may hold. Call after the weights are loaded (they count against it)."""
    if kv_cache_memory_gb is not None:
        return int(kv_cache_memory_gb * _GIB)
    total = device_memory_bytes()
    reserve = max(2 * _GIB, total // 10)  # activations of prefill and the vision tower, MLX's buffer cache
    budget = int(utilization * total) - mx.get_active_memory() - reserve
    if budget < _GIB // 4:
        log.warning(
            "little memory is left for KV blocks (%.2f GB of %.1f GB at --gpu-memory-utilization %.2f); "
            "set --kv-cache-memory to choose the size",
            max(0, budget) / 1e9,
            total / 1e9,
            utilization,
        )
    return max(_GIB // 4, budget)


def working_memory_bytes(working_memory_gb: float | None) -> int:
    """What one step may hold beyond the memory in use when it starts (StepMemoryBound): the
    operator's figure, else an 80th of the device's memory, within 1 to 2 GiB (docs/benchmarks.md
    has the peaks and throughput that chose it)."""
    if working_memory_gb is not None:
        if working_memory_gb < 0:
            raise ValueError(f"--working-memory must be 0 (no bound) or more, not {working_memory_gb}")
        return int(working_memory_gb * _GIB)
    return min(2 * _GIB, max(_GIB, device_memory_bytes() // 80))


class StepMemoryBound:
    """Keeps a step's temporaries within an allowance above the memory in use when it starts.

    MLX encodes work ahead of the GPU (up to ten command buffers; on an H100 a buffer takes up
    to 100 ops and ~1 GB of inputs), and an encoded op's temporaries stay allocated until the
    GPU has run it. So a big forward (a vision-tower call over many images, a prefill of 20
    prompts) held most of its layers' activations at once: 16 GB on a 2B model, for a few
    hundred MB that any one layer needs. MLX's memory limit is where its evaluation stops
    encoding until the GPU has freed buffers, and where its allocator hands cached buffers
    back; set before each step to the weights, KV and caches in use plus the allowance, it
    bounds both. A step whose arrays alone exceed it still runs (MLX only waits)."""

    def __init__(self, allowance: int):
        self.allowance = allowance

    def apply(self) -> None:
        mx.set_memory_limit(mx.get_active_memory() + self.allowance)
