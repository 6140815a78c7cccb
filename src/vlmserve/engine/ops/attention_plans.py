"""Which attention shapes have a cuDNN plan on this thread; the others wait for idle time.

On CUDA, MLX hands a prompt-shaped `mx.fast.scaled_dot_product_attention` call to cuDNN's
fused attention, which builds a plan the first time it meets a shape: ~70 ms on an H100, on
the request path, while every stream waits. A vision tower meets new shapes with every new
image size. So a call whose shape has no plan yet runs a kernel that needs none (lengths are
launch arguments there), and its shape is queued; the engine builds the queued plans one at a
time while idle (`build_next`), and the shape goes to cuDNN from the next call on. A server
that is never idle (a long captioning job) would keep the slower plan-free kernel for good, so
a shape met by HOT_CALLS calls is built between two steps too, at most one every
HOT_INTERVAL_S: a stall of tens of ms, once per recurring shape, where a one-off shape costs
none.

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
from time import monotonic as _clock  # a module global: the tests move it

MAX_WANTED = 64  # shapes queued for idle time; more are met again and queued then
HOT_CALLS = 3  # calls (`new_call`) that met a shape without its plan before it is built between steps
HOT_INTERVAL_S = 1.0  # at most one such build in this time, so builds take a bounded share of a busy server


def _mlx_capacity() -> int:
    try:
        return max(1, int(os.environ.get("MLX_CUDA_SDPA_CACHE_SIZE", "256")))
    except ValueError:
        return 256


class AttentionPlans:
    def __init__(self, capacity: int | None = None):
        self._capacity = max(1, (capacity or _mlx_capacity()) // 2)
        self._planned: OrderedDict[Hashable, None] = OrderedDict()
        self._wanted: OrderedDict[Hashable, _Wanted] = OrderedDict()
        self._failed: set[Hashable] = set()
        self._building = 0
        self._call = 0
        self._last_hot_build = float("-inf")

    def new_call(self) -> None:
        """A model call (e.g. one vision-tower forward) begins: each shape it meets counts once."""
        self._call += 1

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
        cuDNN). A shape whose build failed is not queued again."""
        wanted = self._wanted.get(key)
        if wanted is not None:
            if wanted.last_call != self._call:
                wanted.calls, wanted.last_call = wanted.calls + 1, self._call
        elif key not in self._failed and len(self._wanted) < MAX_WANTED:
            self._wanted[key] = _Wanted(build, 1, self._call)

    def pending(self) -> int:
        """Shapes queued (built while idle)."""
        return len(self._wanted)

    def hot(self) -> bool:
        """Whether a queued shape has been met often enough to build between steps, and the last
        such build was long enough ago."""
        if _clock() - self._last_hot_build < HOT_INTERVAL_S:
            return False
        return any(w.calls >= HOT_CALLS for w in self._wanted.values())

    def build_next(self, hot: bool = False) -> None:
        """Build the oldest queued plan (`hot`: the oldest hot one); a failure leaves that shape on
        the plan-free kernel."""
        if hot:
            key = next(k for k, w in self._wanted.items() if w.calls >= HOT_CALLS)
            self._last_hot_build = _clock()
        else:
            key = next(iter(self._wanted))
        build = self._wanted.pop(key).build
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


class _Wanted:
    __slots__ = ("build", "calls", "last_call")

    def __init__(self, build: Callable[[], None], calls: int, last_call: int):
        self.build, self.calls, self.last_call = build, calls, last_call
