"""The host's time to build and queue a graph against the time until the device is done."""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np


def host_and_done_ms(build: Callable[[], list], repeat: int, prepare: Callable[[], None] = lambda: None):
    """Median ms over `repeat` runs of `build()` (after `prepare()`, untimed): until its arrays
    are queued (the host's share), and until they are computed."""
    hosts, totals = [], []
    for _ in range(repeat):
        prepare()
        mx.synchronize()
        t0 = time.perf_counter()
        arrays = build()
        mx.async_eval(arrays)
        t1 = time.perf_counter()
        mx.eval(arrays)
        hosts.append(t1 - t0)
        totals.append(time.perf_counter() - t0)
    return float(np.median(hosts)) * 1e3, float(np.median(totals)) * 1e3
