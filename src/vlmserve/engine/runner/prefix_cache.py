"""KV prefix caches: LRUs of KV in the paged pool (runner/block_pool.py), keyed by token ids.

An entry holds the blocks of the row it came from (the row's prompt once prefilled, its prompt
and answer once finished): no copy. A row whose prompt goes on in pieces into the pool takes
the prefix's full blocks as its first ones at once (sharing them) and copies only the positions
past them into a block of its own; another row copies the prefix into its prompt cache for its
prefill, and at its join takes the full blocks into its own block table. Either way the two
share them. Blocks only entries hold are the pool's slack: rows that need blocks evict
entries (oldest first) before the pool grows. Entries do not count against the KV budget, so
they never cost a row its place.

The engine keeps two. The text one: requests carrying pixel values never read or write it
(image placeholder tokens are identical for every image, so a token key says nothing about
the pixels). The multimodal one (unless --no-mm-cache): its keys are the token ids with every
image's placeholder tokens replaced by a marker of that image's content (of the prompt's
images together where an image's placeholders come in several runs: `content_keyed`), so a
prefix matches only where its text and its images both do; a different image behind the same
text matches only the text before it.

A model whose layers keep fixed-size state beside their KV (convolution windows, recurrent
state) resumes a prefix only where that state is known: its entries hold the row's state at
their key's end too (`whole_keys`), and a lookup takes the longest entry whose whole key the
prompt starts with, never part of one. Each state counts in the cache's size as the positions
of KV its bytes would hold.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vlmserve.engine.runner.block_pool import BlockPool
from vlmserve.engine.runner.prefix_index import PrefixIndex
from vlmserve.models import kv_caches


def content_keyed(ids: np.ndarray, image_token: int | None, hashes: tuple[str, ...]) -> np.ndarray | None:
    """`ids` with each image's placeholder tokens replaced by a negative marker of its content
    hash (no token id is negative); None when the prompt has no placeholder or no hash.

    Where each image is one run of placeholders, each run takes its image's marker. Where the
    runs and the images do not pair up (an image split into tiles, with separator tokens
    between them), every placeholder takes one marker of the prompt's images together, in
    order: keys equal up to a position then still mean the same images there, and a prompt
    that adds an image to earlier ones matches them only up to the first image."""
    if image_token is None or not hashes:
        return None
    is_image = ids == image_token
    starts = is_image & ~np.concatenate([[False], is_image[:-1]])
    runs = int(starts.sum())
    if runs == 0:
        return None
    key = ids.astype(np.int64)
    if runs == len(hashes):
        markers = np.array([_marker(h) for h in hashes], dtype=np.int64)
        key[is_image] = markers[(np.cumsum(starts) - 1)[is_image]]
    else:
        key[is_image] = _marker(hashlib.sha256("|".join(hashes).encode()).hexdigest())
    return key


def _marker(content_hash: str) -> int:
    """A negative id from a hex content hash (60 bits of it)."""
    return -(int(content_hash[:15], 16) + 1)


@dataclass(eq=False)
class PooledKV:
    """The first `length` positions of KV held in `blocks` of `pool` (one hold per block), and
    where the model's layers keep state, the row's state after those positions (a copy, per
    state array in layer order)."""

    pool: BlockPool
    blocks: list[int]
    length: int
    states: list | None = None
    size: int = 0  # what it counts in its cache's size: positions, and its states' bytes in positions

    def release(self) -> None:
        self.pool.release(self.blocks)
        self.blocks = []


@dataclass(eq=False)
class PrefixHit:
    """A lookup's reuse: `length` positions copied into the row's prompt cache, and the full
    blocks among them (held for the row until its join takes them, or `release`)."""

    length: int
    shared: PooledKV | None = field(default=None)

    @classmethod
    def holding(cls, pool: BlockPool, blocks: list[int], length: int) -> PrefixHit:
        """The hit of `length` positions in `blocks` of `pool`, holding the full blocks among them
        (the caller holds them once for it)."""
        full = blocks[: length // pool.block_size]
        return cls(length, PooledKV(pool, full, len(full) * pool.block_size) if full else None)

    def take(self, pool: BlockPool) -> list[int]:
        """The shared blocks, now the caller's (none if they live in another pool)."""
        shared, self.shared = self.shared, None
        if shared is None:
            return []
        if shared.pool is not pool:
            shared.release()
            return []
        return shared.blocks

    def release(self) -> None:
        if self.shared is not None:
            self.shared.release()
            self.shared = None


STATE_SHARE = 0.25  # of the prefix cache's size, the most its entries' states may take


def state_limit_bytes(max_tokens: int, position_bytes: int) -> int:
    """The device memory cached prefixes' states may take: STATE_SHARE of `max_tokens`
    positions of KV (`position_bytes` each). The engine's KV budget sets it aside."""
    return int(STATE_SHARE * max_tokens * position_bytes)


@dataclass
class StateBudget:
    """The device memory the entries' states of one or more whole-keys caches take together."""

    limit: int
    used: int = 0


class PrefixCache:
    """An LRU of prompt (and answer) KV in the pool, at most `max_tokens` in all.

    `whole_keys`: entries carry the row's state at their end, and only a whole key is reused
    (`state_position_bytes`: the bytes of KV one position takes, to count a state's size).
    Those states live outside the KV pool, within `states` (shared by the engine's caches; by
    default STATE_SHARE of this cache's size), the oldest entries going first past it."""

    def __init__(
        self,
        max_tokens: int,
        whole_keys: bool = False,
        state_position_bytes: int = 1,
        states: StateBudget | None = None,
    ):
        self.max_tokens = max_tokens
        self.whole_keys = whole_keys
        self.state_position_bytes = max(1, state_position_bytes)
        self.states = states or StateBudget(state_limit_bytes(max_tokens, self.state_position_bytes))
        self.state_bytes = 0  # this cache's entries' states (device memory beside the pool's blocks)
        # key -> its KV, least recently used first. A plain dict: it keeps its keys' hashes, where
        # an OrderedDict's iteration hashed every key again (a tuple of the key's length each).
        self._entries: dict[tuple[int, ...], PooledKV] = {}
        self._index = PrefixIndex()  # the keys by their chunks: lookups do not compare every key
        self._tokens = 0
        self._held: Counter = Counter()  # (pool, block) -> entries holding it; read by other threads' gauges

    @property
    def size_tokens(self) -> int:
        return self._tokens

    def has(self, tokens: np.ndarray) -> bool:
        """Whether an entry's key is exactly `tokens`."""
        return tuple(np.asarray(tokens).tolist()) in self._entries

    def blocks_held(self) -> int:
        """Distinct pool blocks the entries hold (some also held by rows)."""
        return len(self._held)

    def supports(self, cache: list[Any]) -> bool:
        return kv_caches.pageable(cache) if self.whole_keys else kv_caches.all_plain(cache)

    def find(self, tokens: np.ndarray, least: int = 1, pool: BlockPool | None = None) -> tuple[PooledKV, int] | None:
        """The entry holding the longest cached prefix of `tokens` (leaving >= 1 token to run), if
        at least `least` tokens, and how many of its positions match; it becomes the most
        recently used. Nothing is copied. With `pool`, None where that entry is in another pool
        (a shorter match there is not looked for)."""
        if not self._entries:
            return None
        if self.whole_keys:
            found = self._longest_whole(tokens)
        else:
            found = self._index.longest(np.asarray(tokens).tolist(), len(tokens) - 1)
        if found is None or found[1] < least or (pool is not None and self._entries[found[0]].pool is not pool):
            return None
        best_key, best_n = found
        kv = self._entries[best_key] = self._entries.pop(best_key)
        return kv, best_n

    def _longest_whole(self, tokens: np.ndarray) -> tuple[tuple[int, ...], int] | None:
        """The longest key that is a proper prefix of `tokens`, whole, and its length."""
        keys = self._index.prefixes_of(tuple(np.asarray(tokens).tolist()))
        if not keys:
            return None
        best = max(keys, key=len)
        return best, len(best)

    def lookup(self, tokens: np.ndarray, fresh_cache: list[Any], least: int = 1) -> PrefixHit | None:
        """Fill `fresh_cache` with the longest cached prefix (leaving >= 1 token to run) if it holds
        at least `least` tokens; None: nothing reused. The copy is lazy: evaluate the cache's
        arrays soon (they hold the pool's arrays of this moment)."""
        if not self.supports(fresh_cache):
            return None
        found = self.find(tokens, least)
        if found is None:
            return None
        kv, best_n = found
        kv.pool.fill(kv_caches.kv_layers(fresh_cache), kv.blocks, best_n, len(tokens))
        restore_states(fresh_cache, kv)
        hit = PrefixHit.holding(kv.pool, kv.blocks, best_n)
        if hit.shared is not None:
            kv.pool.retain(hit.shared.blocks)
        return hit

    def store(self, tokens: np.ndarray, pool: BlockPool, blocks: list[int], states: list | None = None) -> bool:
        """Keep the KV of `tokens`, the first positions of a row's `blocks` in `pool` (the entry
        holds them too), and with `whole_keys` the row's `states` after them. Entries whose keys
        it extends go: it serves their lookups; if a cached key extends it, that entry serves it
        and nothing is added (not with `whole_keys`: a longer entry's state is not this one's).
        Returns whether the entry was added (False: cached already, or past the limits)."""
        n = len(tokens)
        if self.whole_keys and states is None:
            return False
        state_bytes = sum(a.nbytes for a in states) if self.whole_keys else 0
        size = n + -(-state_bytes // self.state_position_bytes)
        if not n or size > self.max_tokens or state_bytes > self.states.limit:
            return False
        key = tuple(np.asarray(tokens).tolist())
        if key in self._entries:
            self._entries[key] = self._entries.pop(key)
            return False
        if not self.whole_keys:
            longer = self._index.extension_of(key)
            if longer is not None:  # a longer entry serves its lookups
                self._entries[longer] = self._entries.pop(longer)
                return False
            for old in self._index.prefixes_of(key):
                self._remove(old)
        held = blocks[: -(-n // pool.block_size)]
        pool.retain(held)
        self._entries[key] = PooledKV(pool, held, n, states if self.whole_keys else None, size)
        self._index.add(key)
        self._held.update((id(pool), b) for b in held)
        self._tokens += size
        self.state_bytes += state_bytes
        self.states.used += state_bytes
        # Past the shared limit this cache gives up its oldest states, the new one last of all
        # (where the other cache's hold the rest).
        while self.states.used > self.states.limit and self._entries:
            self._evict_oldest()
        while self._tokens > self.max_tokens:
            self._evict_oldest()
        return key in self._entries

    def _evict_oldest(self) -> None:
        self._remove(next(iter(self._entries)))

    def _remove(self, key: tuple[int, ...]) -> None:
        kv = self._entries.pop(key)
        self._index.remove(key)
        self._tokens -= kv.size
        if kv.states is not None:
            freed = sum(a.nbytes for a in kv.states)
            self.state_bytes -= freed
            self.states.used -= freed
        self._unhold(kv)
        kv.release()

    def _unhold(self, kv: PooledKV) -> None:
        self._held.subtract((id(kv.pool), b) for b in kv.blocks)
        for b in kv.blocks:
            if self._held[(id(kv.pool), b)] <= 0:
                del self._held[(id(kv.pool), b)]

    def holds(self, pool: BlockPool) -> Counter:
        """Block id -> entries holding it, in `pool`."""
        return Counter({b: n for (p, b), n in self._held.items() if p == id(pool)})

    def reclaim(self, pool: BlockPool, blocks: int) -> None:
        """Evict the oldest entries in `pool` that free blocks until it has `blocks` free, or none
        is left. An entry whose blocks others hold too frees none and stays, unless evicting
        those others (later in the order) made it their last holder: passes repeat until one
        evicts nothing."""
        evicted = True
        while evicted and len(pool.free) < blocks:
            evicted = False
            for key, kv in list(self._entries.items()):
                if len(pool.free) >= blocks:
                    return
                # an entry's own blocks (not shared with a longer prompt's) are its last ones
                if kv.pool is pool and any(pool.refs[b] == 1 for b in reversed(kv.blocks)):
                    self._remove(key)
                    evicted = True

    def renumber(self, pool: BlockPool, mapping: dict[int, int]) -> None:
        """`pool` was compacted: its blocks have new ids."""
        for kv in self._entries.values():
            if kv.pool is pool:
                kv.blocks = [mapping[b] for b in kv.blocks]
        self._held = Counter((id(kv.pool), b) for kv in self._entries.values() for b in kv.blocks)

    def forget(self, pool: BlockPool) -> None:
        """`pool` is gone: its entries with it."""
        for key in [k for k, kv in self._entries.items() if kv.pool is pool]:
            self._remove(key)

    def clear(self) -> None:
        while self._entries:
            self._evict_oldest()


def restore_states(cache: list[Any], kv: PooledKV) -> None:
    """A prompt's own caches resume an entry's end: its state layers take the entry's state."""
    if kv.states is not None:
        kv_caches.put_states(cache, kv.states)
