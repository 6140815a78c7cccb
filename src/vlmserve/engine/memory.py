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
