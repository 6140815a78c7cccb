"""Which attention shapes have a cuDNN plan on this thread; the others wait for idle time.

On CUDA, MLX hands a prompt-shaped `mx.fast.scaled_dot_product_attention` call to cuDNN's
fused attention, which builds a plan the first time it meets a shape: ~70 ms on an H100, on
the request path, while every stream waits. A vision tower meets new shapes with every new
image size. So a call whose shape has no plan yet runs a kernel that needs none (lengths are
launch arguments there), and its shape is queued; the engine builds the queued plans one at a
time while idle (`build_next`), and the shape goes to cuDNN from the next call on. A server
that is never idle (a long captioning job) would keep the slower plan-free kernel for good, so
a shape is also built between two steps once the time it has lost to the plan-free kernel (the
caller's estimate, summed over its calls) reaches what a plan costs to build, PLAN_BUILD_S: the
rent-or-buy rule, which never spends more than twice the best choice made in hindsight. A large
image size that recurs is built after a few calls; a small one, which loses little, waits for
idle time. At most one such build runs every HOT_INTERVAL_S.

MLX keeps its plans per thread, in an LRU of MLX_CUDA_SDPA_CACHE_SIZE entries (256 by
default). The shapes counted as planned here are at most half of that, most recently used
kept, so that a shape this table calls planned is still in MLX's cache when other calls on
the thread add plans of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from time import monotonic as _clock  # a module global: the tests move it

MAX_WANTED = 64  # shapes queued; past it, the shape that lost least makes room (or the new one is dropped)
PLAN_BUILD_S = 0.07  # a cuDNN attention plan's build: 42-108 ms on an H100 (benchmarks/vision_attention.py)
HOT_INTERVAL_S = 1.0  # at most one build between steps in this time: a bounded share of a busy server

# What the plan-free kernel (engine/ops/prefill_attention) loses against cuDNN, for the rent-or-buy
# rule: on an H100 it made 80-135 TFLOPS on 768-1024 px images where cuDNN made 150-280, so about
# half of its time (benchmarks/vision_attention.py). Smaller images run at lower rates on both,
# and lose a little more than this estimate, a fraction of a millisecond a call.
PLAN_FREE_FLOPS = 100e12
PLAN_FREE_LOSS = 0.5


def plan_free_loss_s(count: int, length: int, heads: int, dim: int) -> float:
    """Seconds an unmasked attention call of `count` x `heads` x `length`^2 x `dim` loses without its plan."""
    return PLAN_FREE_LOSS * 4 * count * heads * length * length * dim / PLAN_FREE_FLOPS


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
        self._last_hot_build = float("-inf")

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

    def want(
        self,
        key: Hashable,
        build: Callable[[], None],
        lost_s: float,
        build_s: float = PLAN_BUILD_S,
        notes_itself: bool = False,
    ) -> None:
        """A call of this shape ran without a plan, losing about `lost_s` against cuDNN: queue
        `build` (one call of that shape through cuDNN, costing about `build_s`; with
        `notes_itself` a call that marks the shapes it meets as planned, which may be several).
        A shape whose build failed, or did not meet it, is not queued again."""
        wanted = self._wanted.get(key)
        if wanted is not None:
            wanted.lost_s += lost_s
            return
        if key in self._failed:
            return
        if len(self._wanted) >= MAX_WANTED:  # one-off shapes must not keep a recurring one out
            least = min(self._wanted, key=lambda k: self._wanted[k].lost_s)
            if self._wanted[least].lost_s >= lost_s:
                return
            del self._wanted[least]
        self._wanted[key] = _Wanted(build, lost_s, build_s, notes_itself)

    def pending(self) -> int:
        """Shapes queued (built while idle)."""
        return len(self._wanted)

    def hot(self) -> bool:
        """Whether a queued shape has lost a plan's build to the plan-free kernel (so it is built
        between steps), and the last such build was long enough ago."""
        if _clock() - self._last_hot_build < HOT_INTERVAL_S:
            return False
        return any(w.lost_s >= w.build_s for w in self._wanted.values())

    def build_next(self, hot: bool = False) -> None:
        """Build the plan of the queued shape that lost most (`hot`: between steps, of the shapes
        that have lost their build's cost, which starts the interval); a failure leaves that shape
        on the plan-free kernel (and every shape queued with the same build)."""
        keys = [k for k, w in self._wanted.items() if not hot or w.lost_s >= w.build_s]
        if not keys:
            return
        key = max(keys, key=lambda k: self._wanted[k].lost_s)
        if hot:
            self._last_hot_build = _clock()
        wanted = self._wanted.pop(key)
        try:
            with self.building():
                wanted.build()
        except Exception:
            self._give_up(wanted.build, key)
            raise
        if not wanted.notes_itself:
            self.note_planned(key)
        else:  # what the build met is planned (and out of the queue); what it did not would only fail again
            self._give_up(wanted.build, None if key in self._planned else key)

    def _give_up(self, build: Callable[[], None], key: Hashable | None) -> None:
        """Leave `key` and every shape still queued with `build` on the plan-free kernel for good."""
        keys = [k for k, w in self._wanted.items() if w.build is build]
        for k in keys + ([] if key is None else [key]):
            self._wanted.pop(k, None)
            self._failed.add(k)

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Calls made inside go to cuDNN whatever their shape (warm-up builds its plans this way)."""
        self._building += 1
        try:
            yield
        finally:
            self._building -= 1


@dataclasses.dataclass(slots=True)
class _Wanted:
    build: Callable[[], None]
    lost_s: float  # summed over the calls that met the shape
    build_s: float = PLAN_BUILD_S  # what its build costs: between steps once it has lost as much
    notes_itself: bool = False  # its build marks what it met as planned
