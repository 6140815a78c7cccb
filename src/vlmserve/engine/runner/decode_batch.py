"""The running batch's KV caches, behind one interface the scheduler drives.

- `SlotDecodeBatch` (plain KV-cache families): fixed-shape slots, so a decode step keeps its
  shapes from step to step and can run as one compiled graph (see slot_cache.py).
- `PaddedDecodeBatch` (anything else, e.g. sliding-window or SSM caches): mlx_vlm's batch
  caches, left-padded, extended on join and filtered on leave.

`layout()` gives the row order of the next step: a list of the rows' owners (any object with
`cache_len`, and what the model adapter's `decode_positions` reads), `None` for an empty slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_vlm.models import cache as vlm_cache

from vlmserve.engine.runner.slot_cache import SlotBatch, buckets_up_to, make_decode_step, round_up

log = logging.getLogger(__name__)


def uses_plain_kv_cache(model) -> bool:
    return all(type(c) is vlm_cache.KVCache for c in vlm_cache.make_prompt_cache(model.language_model))


def _positions_needed(rows: list[Any]) -> int:
    """KV positions the next step needs: it writes each live row's position `cache_len`."""
    return max(r.cache_len for r in rows if r is not None) + 1


class PaddedDecodeBatch:
    def __init__(self, model):
        self.model = model
        self.rows: list[Any] = []
        self.cache: list[Any] | None = None

    def layout(self) -> list[Any]:
        return list(self.rows)

    def join(self, owners: list[Any], rows_cache: list[Any]) -> None:
        """rows_cache: per-layer batch caches (from a prefill) holding `owners` in order."""
        if self.cache is None:
            self.cache = rows_cache
        else:
            for batch_layer, row_layer in zip(self.cache, rows_cache):
                batch_layer.extend(row_layer)
        self.rows.extend(owners)

    def remove(self, owners: list[Any]) -> None:
        keep = [i for i, r in enumerate(self.rows) if r not in owners]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = None
        else:
            index = mx.array(keep, dtype=mx.int32)
            for layer in self.cache:
                layer.filter(index)

    def forward_pieces(self, tokens: mx.array, rows: list[Any]) -> list[tuple[int, int, mx.array]]:
        return [(0, len(rows), self.model.decode(tokens, self.cache, self.model.decode_positions(rows)))]


class SlotDecodeBatch:
    def __init__(self, model, step: Callable, dtype):
        self.model = model
        self.step = step  # DecodeSteps: compiled where traced, eager elsewhere; shared across batches
        self.dtype = dtype  # of its KV buffers
        self.slots: list[Any] = []
        self.kv: SlotBatch | None = None

    def layout(self) -> list[Any]:
        return list(self.slots)

    def join(self, owners: list[Any], rows_cache: list[Any]) -> None:
        """rows_cache: per-layer mlx_vlm BatchKVCache from a prefill, rows left-padded, ending together."""
        if self.kv is None:
            layers, kv_shape, _ = self.model.kv_layout()
            self.kv = SlotBatch(layers, kv_shape, self.dtype, slots=len(owners), capacity=1)
            self.slots = [None] * self.kv.slots
        for i, owner in enumerate(owners):
            n, end = owner.cache_len, rows_cache[0]._idx
            layer_kv = (
                [(c.keys[i : i + 1, :, end - n : end, :], c.values[i : i + 1, :, end - n : end, :]) for c in rows_cache]
                if n
                else []
            )
            slot = self._free_slot()
            self.kv.write(slot, layer_kv, n)
            self.slots[slot] = owner

    def _free_slot(self) -> int:
        if None not in self.slots:
            self.kv.ensure(len(self.slots) + 1, 1)
            self.slots += [None] * (self.kv.slots - len(self.slots))
        return self.slots.index(None)

    def remove(self, owners: list[Any]) -> None:
        self.slots = [None if s is not None and s in owners else s for s in self.slots]
        live = [i for i, s in enumerate(self.slots) if s is not None]
        if not live:
            self.slots, self.kv = [], None
            return
        if round_up(len(live), SlotBatch.SLOT_BUCKETS) * 2 <= self.kv.slots:  # mostly empty: fewer rows per step
            self.kv.compact(live)
            self.slots = [self.slots[i] for i in live] + [None] * (self.kv.slots - len(live))
        # forward() grows the capacity back when a row needs it.
        self.kv.fit_capacity(_positions_needed(self.slots))

    def forward(self, tokens: mx.array, rows: list[Any]) -> mx.array:
        """Logits (rows, V) of one step; `rows` is this step's `layout()`."""
        kv = self.kv
        kv.ensure(kv.slots, _positions_needed(rows))
        lengths = mx.array([0 if r is None else r.cache_len for r in rows], dtype=mx.int32)
        out = self.step(tokens, self.model.decode_positions(rows), lengths, *kv.arrays())
        n = len(kv.keys)
        kv.keys, kv.values = list(out[1 : 1 + n]), list(out[1 + n :])
        return out[0]


def kv_dtype(rows_cache: list[Any]):
    """The dtype of the KV a prefill produced (None for an empty one)."""
    keys = getattr(rows_cache[0], "keys", None) if rows_cache else None
    return None if keys is None else keys.dtype


class DtypeGroupedBatch:
    """Slot batches by KV dtype: a row decodes in the dtype its prefill produced, as it would
    alone. Some prompts prefill in a wider dtype than the model's (float32 image embeddings in
    a bfloat16 model); one shared buffer would widen every other row's attention with them.
    One dtype (the usual case) is one slot batch and one forward, as before."""

    def __init__(self, make: Callable, model_dtype):
        self.make = make  # dtype -> SlotDecodeBatch
        self.model_dtype = model_dtype  # what a row with nothing cached yet decodes in
        self.groups: dict[Any, SlotDecodeBatch] = {}

    def layout(self) -> list[Any]:
        return [row for group in self.groups.values() for row in group.layout()]

    def join(self, owners: list[Any], rows_cache: list[Any]) -> None:
        dtype = kv_dtype(rows_cache) or self.model_dtype
        if dtype not in self.groups:
            self.groups[dtype] = self.make(dtype)
        self.groups[dtype].join(owners, rows_cache)

    def remove(self, owners: list[Any]) -> None:
        for dtype, group in list(self.groups.items()):
            group.remove(owners)
            if group.kv is None:
                del self.groups[dtype]

    def forward_pieces(self, tokens: mx.array, rows: list[Any]) -> list[tuple[int, int, mx.array]]:
        """[(start, end, logits of rows[start:end])], one piece per dtype group, in layout order."""
        pieces, start = [], 0
        for group in self.groups.values():
            end = start + len(group.slots)
            piece = tokens if len(self.groups) == 1 else tokens[start:end]
            pieces.append((start, end, group.forward(piece, rows[start:end])))
            start = end
        return pieces


class DecodeSteps:
    """The decode step at each shape (slots, capacity, KV dtype): compiled where it has been
    traced, eager where it has not.

    A shape's first step runs eagerly (the same kernels, unfused: no trace); its second step
    traces the compiled step on the live arrays (tens of milliseconds, once, with no second set
    of KV buffers) and every later one replays it. Warm-up traces the common shapes ahead."""

    def __init__(self, model, compiled: bool):
        self.model = model
        self.eager = make_decode_step(model.decode, False)
        self.compiled = make_decode_step(model.decode, True) if compiled else None
        self.traced: set[tuple] = set()
        self.seen: set[tuple] = set()  # shapes that ran eagerly once

    def __call__(self, tokens: mx.array, positions, lengths: mx.array, *kv: mx.array):
        if self.compiled is None:
            return self.eager(tokens, positions, lengths, *kv)
        shape = (tokens.shape[0], kv[0].shape[2], kv[0].dtype)
        if shape in self.traced:
            return self.compiled(tokens, positions, lengths, *kv)
        if shape not in self.seen:  # maybe a shape of one step (a capacity on its way elsewhere)
            self.seen.add(shape)
            return self.eager(tokens, positions, lengths, *kv)
        t0 = time.perf_counter()
        out = self.compiled(tokens, positions, lengths, *kv)
        self.traced.add(shape)
        seconds = time.perf_counter() - t0
        log.info("compiled the decode step for %d rows x %d positions in %.2f s", shape[0], shape[1], seconds)
        return out

    def trace(self, slots: int, capacity: int, dtype) -> None:
        """Trace (and on CUDA build) the compiled step at this shape on zeros (warm-up)."""
        layers, kv_shape, _ = self.model.kv_layout()
        kv = SlotBatch(layers, kv_shape, dtype, slots=slots, capacity=capacity)
        zeros = mx.zeros((kv.slots,), dtype=mx.int32)
        mx.eval(self.compiled(zeros, self.model.decode_positions([None] * kv.slots), zeros, *kv.arrays()))
        self.traced.add((kv.slots, kv.capacity, dtype))


class DecodeBatches:
    """Makes the running batch for this model, and pre-compiles its decode shapes."""

    def __init__(self, model, compiled: bool):
        self.model = model
        self.slotted = uses_plain_kv_cache(model)
        self.compiled = compiled and self.slotted
        self.step = DecodeSteps(model, self.compiled) if self.slotted else None

    def new(self):
        if not self.slotted:
            return PaddedDecodeBatch(self.model)
        return DtypeGroupedBatch(lambda dtype: SlotDecodeBatch(self.model, self.step, dtype), self.model.kv_layout()[2])

    def warm(self, max_slots: int, max_capacity: int) -> int:
        """Trace the compiled step at every (slots, capacity) bucket up to these bounds (shapes
        past them are traced when they come: DecodeSteps). Returns shapes traced."""
        if not self.compiled:
            return 0
        slot_counts = buckets_up_to(max_slots, SlotBatch.SLOT_BUCKETS)
        capacities = buckets_up_to(max_capacity, SlotBatch.CAPACITY_BUCKETS)
        dtype = self.model.kv_layout()[2]
        shapes = [(n, cap) for n in slot_counts for cap in capacities]
        t0 = time.perf_counter()
        for i, (n, cap) in enumerate(shapes, 1):
            self.step.trace(n, cap, dtype)
            seconds = time.perf_counter() - t0
            log.info("decode shapes %d/%d: %d rows x %d positions (%.1f s)", i, len(shapes), n, cap, seconds)
        return len(shapes)
