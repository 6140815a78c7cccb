"""Debug guard for invariant 1: every MLX entry point runs on the worker thread.

MLX >= 0.31.2 binds GPU streams to the thread that created them; on CUDA an array
evaluated on another thread fails with "There is no Stream(gpu, N) in current thread".
The CPU backend mostly does not raise, so tests turn this guard on to catch it anyway.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter

import mlx.core as mx

_PATCHED_FUNCS = ("eval", "async_eval")
_PATCHED_METHODS = ("item", "tolist", "__array__")


class ThreadGuard:
    def __init__(self) -> None:
        self.owners: set[int] = set()  # worker threads (one per engine; tests may run several)
        self.calls: Counter[str] = Counter()
        self.violations: list[tuple[str, str]] = []
        self._originals: dict[tuple[object, str], object] = {}
        self._lock = threading.Lock()

    def install(self, owner_ident: int) -> None:
        self.owners.add(owner_ident)
        if self._originals:
            return
        for name in _PATCHED_FUNCS:
            self._wrap(mx, name)
        for name in _PATCHED_METHODS:
            self._wrap(mx.array, name)

    def release(self, owner_ident: int) -> None:
        """A stopped worker's ident is no owner any more (CPython reuses idents of ended threads)."""
        self.owners.discard(owner_ident)

    def uninstall(self) -> None:
        for (target, name), original in self._originals.items():
            setattr(target, name, original)
        self._originals.clear()

    def watch_model(self, model) -> None:
        """Record calls of the model and its language model (`__call__` lives on the class)."""
        for module in {type(model), type(getattr(model, "language_model", model))}:
            self._wrap(module, "__call__")

    def check(self, where: str) -> None:
        with self._lock:
            self.calls[where] += 1
            if self.owners and threading.get_ident() not in self.owners:
                self.violations.append((where, threading.current_thread().name))

    def _wrap(self, target, name: str) -> None:
        if (target, name) in self._originals:
            return
        original = getattr(target, name)
        self._originals[(target, name)] = original
        label = f"mx.{name}" if target is mx else f"{target.__name__}.{name}"
        guard = self

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            guard.check(label)
            return original(*args, **kwargs)

        setattr(target, name, wrapper)


GUARD = ThreadGuard()
