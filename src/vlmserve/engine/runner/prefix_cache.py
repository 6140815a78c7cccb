"""KV prefix caches: LRUs of prompt KV states keyed by token ids.

The engine keeps two. The text one: requests carrying pixel values never read or write it
(image placeholder tokens are identical for every image, so a token key says nothing about
the pixels). The multimodal one (unless --no-mm-cache): its keys are the token ids with every
image's placeholder tokens replaced by a marker of that image's content (`content_keyed`), so
a prefix matches only where its text and its images both do; a different image behind the
same text matches only the text before it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from vlmserve.engine.sched.kv_budget import KVBudget
from vlmserve.models import kv_caches


def content_keyed(ids: np.ndarray, image_token: int | None, hashes: tuple[str, ...]) -> np.ndarray | None:
    """`ids` with each image's run of placeholder tokens replaced by a negative marker of its
    content hash (no token id is negative); None when the runs and the hashes do not pair up."""
    if image_token is None or not hashes:
        return None
    is_image = ids == image_token
    starts = is_image & ~np.concatenate([[False], is_image[:-1]])
    if int(starts.sum()) != len(hashes):
        return None
    markers = np.array([-(int(h[:15], 16) + 1) for h in hashes], dtype=np.int64)
    key = ids.astype(np.int64)
    key[is_image] = markers[(np.cumsum(starts) - 1)[is_image]]
    return key


class PrefixCache:
    """An LRU of prompt KV, at most `max_tokens`. With a `budget`, its entries are paid for in KV
    blocks (`units(tokens, dtype)`), so they count against the same memory as running rows, and
    give way to them (`reclaim`) before any running row is preempted."""

    def __init__(self, max_tokens: int, budget: KVBudget | None = None, units: Callable[[int, Any], int] | None = None):
        self.max_tokens = max_tokens
        self.budget = budget
        self.units = units or (lambda tokens, dtype: 0)
        # key -> (per-layer KV, budget units, the key as an array: lookups compare arrays, not tuples)
        self._entries: OrderedDict[tuple[int, ...], tuple[list[tuple[mx.array, mx.array]], int, np.ndarray]] = (
            OrderedDict()
        )
        self._tokens = 0

    @property
    def size_tokens(self) -> int:
        return self._tokens

    @staticmethod
    def supports(cache: list[Any]) -> bool:
        return kv_caches.all_plain(cache)

    def lookup(self, tokens: np.ndarray, fresh_cache: list[Any], least: int = 1) -> int:
        """Fill `fresh_cache` with the longest cached prefix (leaving >= 1 token to run) if it holds
        at least `least` tokens; return its length (0: nothing reused)."""
        if not self._entries or not self.supports(fresh_cache):
            return 0
        best_key, best_n = None, 0
        limit = len(tokens) - 1
        for key, (_, _, stored) in self._entries.items():
            stored = stored[:limit]
            same = stored == tokens[: len(stored)]
            n = len(stored) if same.all() else int(np.argmin(same))
            if n > best_n:
                best_key, best_n = key, n
        if best_key is None or best_n < least:
            return 0
        self._entries.move_to_end(best_key)
        for layer, (k, v) in zip(fresh_cache, self._entries[best_key][0]):
            layer.keys, layer.values, layer.offset = k[..., :best_n, :], v[..., :best_n, :], best_n
        return best_n

    def store(self, tokens: np.ndarray, cache: list[Any]) -> None:
        """Keep the KV of `tokens` from a prompt's own cache (per layer, at least that long)."""
        if self.supports(cache):
            n = len(tokens)
            self.store_layers(tokens, lambda: [(c.keys[..., :n, :], c.values[..., :n, :]) for c in cache])

    def store_layers(self, tokens: np.ndarray, layers: Callable[[], list[tuple[mx.array, mx.array]]]) -> None:
        """Keep `layers()`, the KV of `tokens`, (1, kv_heads, len(tokens), dim) per layer (called
        only if the entry is kept). Entries whose keys it extends go: it serves their lookups."""
        n = len(tokens)
        if n > self.max_tokens:
            return
        key = tuple(int(t) for t in tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        tokens = np.array(tokens, dtype=np.int64)
        for old, (_, _, stored) in list(self._entries.items()):
            if len(stored) < n and np.array_equal(stored, tokens[: len(stored)]):
                self._remove(old)
        kv = layers()
        units = self.units(n, kv[0][0].dtype)
        if self.budget is not None:
            self.reclaim(units)  # older entries make way for this one, never a running row
            if not self.budget.take(units):
                return
        # Queued, not waited for: the host goes on to launch the next decode step while the
        # device finishes the work these arrays read.
        mx.async_eval(kv)
        self._entries[key] = (kv, units, tokens)
        self._tokens += n
        while self._tokens > self.max_tokens:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        self._remove(next(iter(self._entries)))

    def _remove(self, key: tuple[int, ...]) -> None:
        _, units, _ = self._entries.pop(key)
        self._tokens -= len(key)
        if self.budget is not None:
            self.budget.give(units)

    def reclaim(self, blocks: int) -> None:
        """Evict the oldest entries until the budget has `blocks` free (or nothing is left)."""
        while self._entries and self.budget is not None and self.budget.free < blocks:
            self._evict_oldest()

    def clear(self) -> None:
        while self._entries:
            self._evict_oldest()
