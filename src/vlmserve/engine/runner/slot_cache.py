"""A fixed-shape batch KV cache for decode: one slot per running request.

mlx_vlm's BatchKVCache grows by Python-int offsets, re-pads on every join and syncs on every
filter, so the decode graph changes shape every step and cannot be compiled. Here every layer
holds keys/values of shape (slots, kv_heads, capacity, head_dim) and each slot's fill level
is an *array*, so one decode step has the same shapes from step to step: `mx.compile` traces
the whole forward once per (slots, capacity) and replays it with elementwise ops fused — on
CUDA the step is bound by per-kernel launch overhead, not by the weights' bandwidth.

A slot's KV always starts at index 0; positions past its length are masked out. Slot count
and capacity grow in buckets (a copy, rarely), so the number of compiled shapes stays small.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from vlmserve.engine.ops.slot_layer_cache import SlotLayerCache


def round_up(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    step = buckets[-1]
    return -(-n // step) * step


def buckets_up_to(n: int, buckets: tuple[int, ...]) -> list[int]:
    """Every bucket a size of at most n can round up to."""
    return [b for b in buckets if b < n] + [round_up(n, buckets)]


class SlotBatch:
    """Per-layer (slots, heads, capacity, dim) buffers; slot lengths are kept by their owners."""

    SLOT_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
    CAPACITY_BUCKETS = (256, 512, 1024, 2048, 4096)

    def __init__(self, num_layers: int, kv_shape: tuple[int, int, int], dtype, slots: int, capacity: int):
        heads, dim_k, dim_v = kv_shape
        self.slots = round_up(slots, self.SLOT_BUCKETS)
        self.capacity = round_up(capacity, self.CAPACITY_BUCKETS)
        self.keys = [mx.zeros((self.slots, heads, self.capacity, dim_k), dtype) for _ in range(num_layers)]
        self.values = [mx.zeros((self.slots, heads, self.capacity, dim_v), dtype) for _ in range(num_layers)]

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values

    # ---- layout changes (eager, rare) --------------------------------------------
    def ensure(self, slots: int, capacity: int) -> None:
        """Grow to at least `slots` slots and `capacity` positions (bucketed)."""
        slots = max(self.slots, round_up(slots, self.SLOT_BUCKETS))
        capacity = max(self.capacity, round_up(capacity, self.CAPACITY_BUCKETS))
        if (slots, capacity) == (self.slots, self.capacity):
            return
        widths = [(0, slots - self.slots), (0, 0), (0, capacity - self.capacity), (0, 0)]
        self.keys = [mx.pad(k, widths) for k in self.keys]
        self.values = [mx.pad(v, widths) for v in self.values]
        self.slots, self.capacity = slots, capacity

    def compact(self, keep: list[int]) -> None:
        """Keep only slots `keep` (in that order), shrinking to the bucket that fits them."""
        slots = round_up(max(1, len(keep)), self.SLOT_BUCKETS)
        index = keep + [keep[0] if keep else 0] * (slots - len(keep))
        take = mx.array(index, dtype=mx.int32)
        self.keys = [k[take] for k in self.keys]
        self.values = [v[take] for v in self.values]
        self.slots = slots

    def fit_capacity(self, needed: int) -> None:
        """Shrink to the bucket that holds `needed` positions, when that is at most half the capacity.

        Capacity grows for the longest row; without this, once a long request left, every later
        step would still attend over (and write into) its length until the batch emptied, which
        under steady load it never does. The factor of two keeps shrinking and growing apart."""
        capacity = round_up(max(1, needed), self.CAPACITY_BUCKETS)
        if capacity * 2 > self.capacity:
            return
        # Contiguous copies: the compiled step's kernels were built for contiguous KV.
        self.keys = [mx.contiguous(k[:, :, :capacity, :]) for k in self.keys]
        self.values = [mx.contiguous(v[:, :, :capacity, :]) for v in self.values]
        self.capacity = capacity

    def write(self, slot: int, layer_kv: list[tuple[mx.array, mx.array]], length: int) -> None:
        """Put one request's prefilled KV ((1, H, length, D) per layer) into `slot` at positions [0, length)."""
        self.ensure(slot + 1, length + 1)
        if not length:
            return
        for i, (k, v) in enumerate(layer_kv):
            self.keys[i][slot : slot + 1, :, :length, :] = k
            self.values[i][slot : slot + 1, :, :length, :] = v


def make_decode_step(decode: Callable, compiled: bool) -> Callable:
    """fn(tokens (S,), positions (S,) | None, lengths (S,), *kv) -> (logits (S, V), *new_kv).

    `decode(tokens, caches, positions)` is the model's one-token batched forward (ModelAdapter.decode).
    A pure function of its inputs, so `mx.compile` can trace it once per input shape."""

    def step(tokens, positions, lengths, *kv):
        n = len(kv) // 2
        shared: dict = {}
        caches = [SlotLayerCache(kv[i], kv[n + i], lengths, shared) for i in range(n)]
        logits = decode(tokens, caches, positions)
        return (logits, *[c.keys for c in caches], *[c.values for c in caches])

    if not compiled:
        return step
    with_pos = mx.compile(step)
    without_pos = mx.compile(lambda t, n, *kv: step(t, None, n, *kv))  # compiled inputs must be arrays
    return lambda t, p, n, *kv: with_pos(t, p, n, *kv) if p is not None else without_pos(t, n, *kv)
