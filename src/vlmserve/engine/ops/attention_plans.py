"""Which attention shapes have a cuDNN plan on this thread; the others wait for idle time.

On CUDA, MLX hands a prompt-shaped `mx.fast.scaled_dot_product_attention` call to cuDNN's
fused attention, which builds a plan the first time it meets a shape: ~70 ms on an H100, on
the request path, while every stream waits. A vision tower meets new shapes with every new
image size. So a call whose shape has no plan yet runs a kernel that needs none (lengths are
launch arguments there), and its shape is queued; the engine builds the queued plans one at a
time while idle (`build_next`), and the shape goes to cuDNN from the next call on.

MLX keeps its plans per thread, in an LRU of MLX_CUDA_SDPA_CACHE_SIZE entries (256 by
default). The shapes counted as planned here are at most half of that, most recently used
kept, so that a shape this table calls planned is still in MLX's cache when other calls on
the thread add plans of their own.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

MAX_WANTED = 64  # shapes queued for idle time; more are met again and queued then


def _mlx_capacity() -> int:
    try:
        return max(1, int(os.environ.get("MLX_CUDA_SDPA_CACHE_SIZE", "256")))
    except ValueError:
        return 256


class AttentionPlans:
    def __init__(self, capacity: int | None = None):
        self._capacity = max(1, (capacity or _mlx_capacity()) // 2)
        self._planned: OrderedDict[Hashable, None] = OrderedDict()
        self._wanted: OrderedDict[Hashable, Callable[[], None]] = OrderedDict()
        self._failed: set[Hashable] = set()
        self._building = 0

    def planned(self, key: Hashable) -> bool:
        """Whether a call of this shape should go to cuDNN: its plan is built, or it is being built now."""
        if self._building and key not in self._failed:
            return True
        if key in self._planned:
            self._planned.move_to_end(key)
            return True
        return False

    def note_planned(self, key: Hashable) -> None:
        """A call of this shape ran through cuDNN (so its plan exists)."""
        self._planned[key] = None
        self._planned.move_to_end(key)
        while len(self._planned) > self._capacity:
            self._planned.popitem(last=False)
        self._wanted.pop(key, None)

    def want(self, key: Hashable, build: Callable[[], None]) -> None:
        """A call of this shape ran without a plan: queue `build` (one call of that shape through
        cuDNN) for idle time. A shape whose build failed is not queued again."""
        if key not in self._wanted and key not in self._failed and len(self._wanted) < MAX_WANTED:
            self._wanted[key] = build

    def pending(self) -> int:
        return len(self._wanted)

    def build_next(self) -> None:
        """Build the oldest queued plan; a failure leaves that shape on the plan-free kernel."""
        key, build = self._wanted.popitem(last=False)
        try:
            with self.building():
                build()
        except Exception:
            self._failed.add(key)
            raise
        self.note_planned(key)

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Calls made inside go to cuDNN whatever their shape (warm-up builds its plans this way)."""
        self._building += 1
        try:
            yield
        finally:
            self._building -= 1
